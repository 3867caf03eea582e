"""Image inputs decoded under limits: one ImageInputError naming the input for every bad case."""

from __future__ import annotations

import base64
import io

import pytest

PIL = pytest.importorskip("PIL")

from adapt.errors import ImageInputError  # noqa: E402
from adapt.runtime.vision.inputs import ImageLimits, decode, load_image  # noqa: E402


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def test_a_data_url_and_a_path_decode_to_the_same_pixels(tmp_path):
    from PIL import Image

    im = Image.new("RGB", (7, 5), (10, 20, 30))
    im.save(tmp_path / "a.png")
    url = "data:image/png;base64," + base64.b64encode(_png(im)).decode()
    a, b = load_image(url), load_image(str(tmp_path / "a.png"))
    assert a.size == b.size == (7, 5) and a.tobytes() == b.tobytes()


def test_a_decompression_bomb_is_refused_from_its_header():
    from PIL import Image

    data = _png(Image.new("1", (9000, 8000)))  # 72M pixels in a few kB
    assert len(data) < 100_000
    with pytest.raises(ImageInputError, match="over the limit"):
        decode(data, "bomb.png")
    with pytest.raises(ImageInputError, match="over the limit"):
        decode(_png(Image.new("RGB", (40, 40))), "x", ImageLimits(max_pixels=1000))


@pytest.mark.parametrize("src,match", [
    ("data:image/png;base64,aGVsbG8=", "not a readable image"),
    ("data:text/plain,hello", "not a data:image"),
    ("https://example.com/a.png", "remote image URLs are off"),
    ("/nonexistent/a.png", "no such image file"),
])
def test_bad_sources(src, match):
    with pytest.raises(ImageInputError, match=match):
        load_image(src)


def test_truncated_and_oversized():
    from PIL import Image

    data = _png(Image.new("RGB", (50, 50), (1, 2, 3)))
    with pytest.raises(ImageInputError, match="not a readable image"):
        decode(data[: len(data) // 2], "half.png")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    with pytest.raises(ImageInputError, match="more than"):
        load_image(url, ImageLimits(max_bytes=10))


def test_only_the_listed_formats_and_media_types_decode(tmp_path):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buf, "PPM")  # PIL reads PPM, adapt's decoder does not (FORMATS)
    with pytest.raises(ImageInputError, match="not a readable image") as e:
        decode(buf.getvalue(), "a.ppm")
    assert e.value.code == "invalid_image"
    with pytest.raises(ImageInputError, match="unsupported media type") as e:
        load_image("data:application/pdf;base64," + base64.b64encode(_png(Image.new("RGB", (4, 4)))).decode())
    assert e.value.code == "invalid_image_format"
    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    assert load_image(str(tmp_path / "a.png")).size == (4, 4)
    with pytest.raises(ImageInputError, match="file paths are not accepted"):
        load_image(str(tmp_path / "a.png"), ImageLimits(allow_files=False))
