"""The OpenAI-compatible API's bodies as pydantic models: requests adapt serve accepts, responses it sends.

Pure data, no server state: ``adapt validate --endpoint`` and ``adapt bench serve`` build and parse the
same bodies against any OpenAI-compatible endpoint (vLLM, SGLang, adapt serve).

Requests are strict (``extra="forbid"``, no coercion: ``"8"`` is not an integer, ``true`` is not a
number), so a client never gets an answer computed with a field silently dropped or reinterpreted.
Fields adapt serve does not implement are still declared when OpenAI defines them (``suffix``,
``tools`` ...); the service accepts them only at their no-op value (``requests.py``). Extensions, as
vLLM spells them: ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``prompt_logprobs``, ``return_token_ids``, ``stream_options.continuous_usage_stats``. Chat content parts:
``text`` and ``image_url`` (vision models).

Responses are lenient (``extra="allow"``): other servers add fields of their own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP = 4  # OpenAI's limit on stop sequences

Number = Annotated[Union[StrictInt, StrictFloat], Field(allow_inf_nan=False)]
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- requests -----------------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM: usage on every chunk


class _Sampling(_Request):
    """Fields shared by completions and chat completions."""

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    temperature: Annotated[Number, Field(ge=0)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None  # 0 or -1: off
    min_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: Annotated[StrictInt, Field(ge=1)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: TokenIds | None = None
    return_token_ids: StrictBool | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions. ``prompt``: a string, a list of strings, token ids or a list of token-id lists."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool | None = None
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None
    suffix: StrictStr | None = None


class TextContentPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Request):
    """``url``: a ``data:image/...;base64,`` URL, or an http(s) URL where the server allows remote images.
    ``detail``: the checkpoint's image processor sets the resolution, so adapt serve takes only ``"auto"``."""

    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ImageContentPart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


# The content parts a chat message may carry: a discriminated union on ``type``.
ContentPart = Annotated[Union[TextContentPart, ImageContentPart], Field(discriminator="type")]


class ChatMessage(_Request):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """POST /tokenize: ``prompt`` text, or chat ``messages`` through the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None


class DetokenizeRequest(_Request):
    """POST /detokenize."""

    model: StrictStr | None = None
    tokens: TokenIds


# -- responses ----------------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """Every non-2xx body: ``{"error": {message, type, param, code}}``."""

    error: ErrorInfo


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionLogprobs(_Response):
    """The legacy completions ``logprobs``; with ``echo`` the prompt's tokens come first, the first of
    them with ``None`` (nothing precedes it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    """The body of /v1/completions, and each streamed chunk (``object: "text_completion"`` both)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(_Response):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
