"""Images from what a user passes: a file path, a ``data:image/...;base64,`` URL or an http(s) URL.

Decoding is PIL's, fully (``load()``), under limits: at most ``max_bytes`` of encoded data, at most
``max_pixels`` decoded pixels (checked from the header before any pixel is decoded, so a decompression
bomb costs nothing), no 0-pixel side, no truncated file, and only the formats of ``FORMATS`` (PIL would
otherwise open dozens, EPS through Ghostscript among them). Remote URLs are fetched only when the caller
allows them, with one time limit over the whole fetch (connect, redirects, every read) and the same byte
limit; file paths only when the caller allows them (``adapt serve`` does not). Every failure is one
ImageInputError naming the input (a path, or the first characters of a URL) with a ``code`` for API errors.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from adapt.errors import ImageInputError

MAX_BYTES = 20 << 20  # encoded image bytes
MAX_PIXELS = 64 << 20  # decoded pixels (PIL's own bomb limit is 89.5M)
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # PIL format names decode() opens
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp", "image/x-ms-bmp",
               "image/tiff"}
_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),", re.S)


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_BYTES
    max_pixels: int = MAX_PIXELS
    allow_remote: bool = False
    timeout_s: float = FETCH_TIMEOUT_S
    allow_files: bool = True


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImageInputError("images need pillow: pip install 'adapt[vision]'") from None
    return Image


def describe(src: str) -> str:
    """A short name of an image input for messages."""
    return src if not src.startswith("data:") else src[:32] + ("..." if len(src) > 32 else "")


def _media_type(mt: str, name: str) -> None:
    """Refuse a declared media type no decoder here reads (an empty one is left to the bytes)."""
    mt = mt.strip().lower()
    if mt and mt not in MEDIA_TYPES:
        raise ImageInputError(f"{name}: unsupported media type {mt!r} (supported: "
                              f"{', '.join(sorted(MEDIA_TYPES))})", "invalid_image_format")


def _too_large(name: str, limit: int) -> ImageInputError:
    return ImageInputError(f"{name}: more than {limit} bytes", "image_too_large")


def read_bytes(src: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The encoded bytes of a path, data: URL or (when allowed) http(s) URL."""
    if src.startswith("data:"):
        m = _DATA_URL.match(src)
        if m is None or "base64" not in [p.strip().lower() for p in m.group(2).split(";")]:
            raise ImageInputError(f"{describe(src)}: not a data:image/...;base64, URL", "invalid_image_url")
        _media_type(m.group(1), describe(src))
        body = src[m.end():]
        if len(body) * 3 // 4 > limits.max_bytes:
            raise _too_large(describe(src), limits.max_bytes)
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ImageInputError(f"{describe(src)}: invalid base64", "invalid_image_url") from None
    if src.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise ImageInputError(f"{describe(src)}: remote image URLs are off (--allow-remote-images enables them)",
                                  "remote_images_disabled")
        return fetch(src, limits)
    if not limits.allow_files:
        raise ImageInputError(f"{describe(src)[:64]}: not a data:image/...;base64, or http(s) URL (file paths are "
                              f"not accepted)", "invalid_image_url")
    p = Path(src).expanduser()
    if not p.is_file():
        raise ImageInputError(f"{src}: no such image file")
    if p.stat().st_size > limits.max_bytes:
        raise _too_large(src, limits.max_bytes)
    return p.read_bytes()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def fetch(url: str, limits: ImageLimits) -> bytes:
    """GET an http(s) URL: redirects (http(s) only, at most MAX_REDIRECTS), status 200, a declared image media
    type if any, at most ``max_bytes``, everything within ``timeout_s`` in total."""
    deadline = time.monotonic() + limits.timeout_s
    first = url
    try:
        for _ in range(MAX_REDIRECTS + 1):
            u = urllib.parse.urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ImageInputError(f"{first}: redirected to {url[:80]}, not an http(s) URL", "image_fetch_failed")
            cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
            conn = cls(u.hostname, u.port, timeout=_left(deadline))
            try:
                conn.request("GET", (u.path or "/") + (f"?{u.query}" if u.query else ""),
                             headers={"Accept": "image/*", "User-Agent": "adapt"})
                sock = conn.sock  # the response may take it over (conn.sock None): keep it for the timeouts
                sock.settimeout(_left(deadline))
                r = conn.getresponse()
                if r.status in (301, 302, 303, 307, 308) and r.getheader("Location"):
                    url = urllib.parse.urljoin(url, r.getheader("Location"))
                    continue
                if r.status != 200:
                    raise ImageInputError(f"{first}: HTTP {r.status} {r.reason}", "image_fetch_failed")
                ctype = (r.getheader("Content-Type") or "").split(";")[0].strip().lower()
                if ctype.startswith("image/"):
                    _media_type(ctype, first)
                n = r.getheader("Content-Length") or ""
                if n.isdigit() and int(n) > limits.max_bytes:
                    raise _too_large(first, limits.max_bytes)
                data = bytearray()
                while True:
                    sock.settimeout(_left(deadline))
                    chunk = r.read1(1 << 16)
                    if not chunk:
                        return bytes(data)
                    data += chunk
                    if len(data) > limits.max_bytes:
                        raise _too_large(first, limits.max_bytes)
            finally:
                conn.close()
        raise ImageInputError(f"{first}: more than {MAX_REDIRECTS} redirects", "image_fetch_failed")
    except TimeoutError:
        raise ImageInputError(f"{first}: not fetched within {limits.timeout_s:g} s", "image_fetch_failed") from None
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise ImageInputError(f"{first}: cannot fetch ({type(e).__name__}: {e})", "image_fetch_failed") from None


def decode(data: bytes, name: str, limits: ImageLimits = ImageLimits()):
    """A fully decoded PIL image (the processor converts it to RGB), or ImageInputError."""
    Image = _pil()
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=FORMATS)
            w, h = im.size
            if w <= 0 or h <= 0:
                raise ImageInputError(f"{name}: image is {w}x{h} pixels")
            if w * h > limits.max_pixels:
                raise ImageInputError(f"{name}: {w}x{h} = {w * h} pixels is over the limit of {limits.max_pixels}",
                                      "image_too_large")
            im.load()
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageInputError(f"{name}: decompression bomb refused ({e})", "image_too_large") from None
    except Image.UnidentifiedImageError:
        raise ImageInputError(f"{name}: not a readable image (no {', '.join(FORMATS)} data)") from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL: truncated or corrupt data
        raise ImageInputError(f"{name}: not a readable image ({e})") from None
    return im


def load_image(src: str, limits: ImageLimits = ImageLimits()):
    """read_bytes then decode."""
    return decode(read_bytes(src, limits), describe(src), limits)
