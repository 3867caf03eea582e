"""The service's errors: an HTTP status plus OpenAI's error body ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the service refuses or could not finish; ``body()`` is what the client receives."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)
