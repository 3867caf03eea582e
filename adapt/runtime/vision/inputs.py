"""Images from what a user passes: a file path, a ``data:image/...;base64,`` URL or an http(s) URL.

Decoding is PIL's, fully (``load()``), under limits: at most ``max_bytes`` of encoded data, at most
``max_pixels`` decoded pixels (checked from the header before any pixel is decoded, so a decompression
bomb costs nothing), no 0-pixel side, no truncated file. Remote URLs are fetched only when the caller
allows them, with a time limit and the same byte limit. Every failure is one ImageInputError naming the
input (a path, or the first characters of a URL).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from adapt.errors import ImageInputError

MAX_BYTES = 20 << 20  # encoded image bytes
MAX_PIXELS = 64 << 20  # decoded pixels (PIL's own bomb limit is 89.5M)
FETCH_TIMEOUT_S = 10.0
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[^,]*)?,", re.S)


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_BYTES
    max_pixels: int = MAX_PIXELS
    allow_remote: bool = False
    timeout_s: float = FETCH_TIMEOUT_S


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImageInputError("images need pillow: pip install 'adapt[vision]'") from None
    return Image


def describe(src: str) -> str:
    """A short name of an image input for messages."""
    return src if not src.startswith("data:") else src[:32] + ("..." if len(src) > 32 else "")


def read_bytes(src: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The encoded bytes of a path, data: URL or (when allowed) http(s) URL."""
    if src.startswith("data:"):
        m = _DATA_URL.match(src)
        if m is None or ";base64" not in (m.group(2) or ""):
            raise ImageInputError(f"{describe(src)}: not a data:image/...;base64, URL")
        body = src[m.end():]
        if len(body) * 3 // 4 > limits.max_bytes:
            raise ImageInputError(f"{describe(src)}: more than {limits.max_bytes} bytes")
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise ImageInputError(f"{describe(src)}: invalid base64") from None
    if src.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise ImageInputError(f"{describe(src)}: remote image URLs are off (--allow-remote-images enables them)")
        try:
            with urllib.request.urlopen(src, timeout=limits.timeout_s) as r:
                data = r.read(limits.max_bytes + 1)
        except (OSError, ValueError) as e:
            raise ImageInputError(f"{src}: cannot fetch ({e})") from None
        if len(data) > limits.max_bytes:
            raise ImageInputError(f"{src}: more than {limits.max_bytes} bytes")
        return data
    p = Path(src).expanduser()
    if not p.is_file():
        raise ImageInputError(f"{src}: no such image file")
    if p.stat().st_size > limits.max_bytes:
        raise ImageInputError(f"{src}: more than {limits.max_bytes} bytes")
    return p.read_bytes()


def decode(data: bytes, name: str, limits: ImageLimits = ImageLimits()):
    """A fully decoded RGB PIL image, or ImageInputError."""
    Image = _pil()
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            if w <= 0 or h <= 0:
                raise ImageInputError(f"{name}: image is {w}x{h} pixels")
            if w * h > limits.max_pixels:
                raise ImageInputError(f"{name}: {w}x{h} = {w * h} pixels is over the limit of {limits.max_pixels}")
            im.load()
    except ImageInputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageInputError(f"{name}: decompression bomb refused ({e})") from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL: UnidentifiedImageError, truncated data
        raise ImageInputError(f"{name}: not a readable image ({e})") from None
    return im


def load_image(src: str, limits: ImageLimits = ImageLimits()):
    """read_bytes then decode."""
    return decode(read_bytes(src, limits), describe(src), limits)
