"""The image loader: every source decodes to the same RGB pixels, and every bound refuses before the costly
step it guards (a count before any read, a size before base64 decoding, a header before pixel decoding).

Real files made with Pillow in tmp_path and a real HTTP server on 127.0.0.1; nothing is mocked.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import os
import random
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageChops

from radixserve.multimodal.image_loader import (
    ImageInputError,
    MediaLimits,
    image_hash,
    load_image,
    load_images,
)
from radixserve.server_args import ServerArgs

FORMATS = ["PNG", "JPEG", "WEBP", "GIF"]
LOSSLESS = {"PNG", "WEBP", "GIF"}


def _picture(size: tuple[int, int] = (24, 16)) -> Image.Image:
    """Few colours (a GIF palette holds them exactly), each pixel depending on its place."""
    image = Image.new("RGB", size)
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (240, 240, 20), (0, 0, 0), (255, 255, 255)]
    image.putdata([colours[(x // 4 + y // 4) % len(colours)] for y in range(size[1]) for x in range(size[0])])
    return image


def _noise(size: tuple[int, int] = (64, 64), seed: int = 0) -> Image.Image:
    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


def _encode(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    # WebP lossless so that "same pixels" can be asserted; JPEG at high quality, without chroma subsampling
    # (the picture's colour edges are sharp), compared with a tolerance.
    options = {"WEBP": {"lossless": True}, "JPEG": {"quality": 95, "subsampling": 0}}.get(fmt, {})
    image.save(out, format=fmt, **options)
    return out.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR (1-bit greyscale) declaring width x height, with a few bytes of
    pixel data: tiny on disk, enormous once decoded. Decoding it would fail as truncated, so a refusal
    that names pixels was made from the header alone."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def _same_pixels(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes()


def _max_difference(a: Image.Image, b: Image.Image) -> int:
    return max(high for _, high in ImageChops.difference(a, b).getextrema())


# --- every source decodes ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["bytes", "data_uri", "path", "file_uri", "relative", "pil"])
def test_every_source_and_format_decodes_to_the_pixels(tmp_path: Path, fmt: str, kind: str) -> None:
    original = _picture()
    data = _encode(original, fmt)
    (tmp_path / f"pic.{fmt.lower()}").write_bytes(data)
    source = {
        "bytes": data,
        "data_uri": _data_uri(data, f"image/{fmt.lower()}"),
        "path": str(tmp_path / f"pic.{fmt.lower()}"),
        "file_uri": (tmp_path / f"pic.{fmt.lower()}").as_uri(),
        "relative": f"pic.{fmt.lower()}",
        "pil": Image.open(io.BytesIO(data)),  # lazy, as a caller's Image.open leaves it
    }[kind]
    image = load_image(source, MediaLimits(allowed_local_media_path=str(tmp_path)))
    assert image.mode == "RGB" and image.size == original.size
    if fmt in LOSSLESS:
        assert _same_pixels(image, original)
    else:
        assert _max_difference(image, original) < 48
    # Fully loaded and detached: usable after the source is gone.
    assert getattr(image, "fp", None) is None
    image.getpixel((0, 0))


def test_an_animated_gif_is_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    assert load_image(out.getvalue(), MediaLimits()).getpixel((4, 4)) == (255, 0, 0)


def test_transparency_is_composited_on_white() -> None:
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(10, 20, 30, 0), (10, 20, 30, 255), (0, 0, 0, 128)])
    image = load_image(_encode(rgba, "PNG"), MediaLimits())
    assert image.mode == "RGB"
    assert image.getpixel((0, 0)) == (255, 255, 255)  # transparent: white, not the stored colour
    assert image.getpixel((1, 0)) == (10, 20, 30)
    assert all(abs(c - 127) <= 1 for c in image.getpixel((2, 0)))  # half black over white

    la = Image.new("LA", (1, 1), (0, 0))
    assert load_image(la, MediaLimits()).getpixel((0, 0)) == (255, 255, 255)

    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 255, 0, 0])
    palette.putdata([0, 1])
    out = io.BytesIO()
    palette.save(out, format="GIF", transparency=0)
    assert list(load_image(out.getvalue(), MediaLimits()).getdata()) == [(255, 255, 255), (255, 0, 0)]


def test_16_bit_grey_is_scaled_not_clipped() -> None:
    out = io.BytesIO()
    Image.new("I;16", (2, 2), 40_000).save(out, format="PNG")
    assert load_image(out.getvalue(), MediaLimits()).getpixel((0, 0)) == (156, 156, 156)  # 40000 // 256


# --- image_hash -------------------------------------------------------------------------------------


def test_image_hash_follows_pixels_not_encoding() -> None:
    original = _noise((32, 20))
    from_png = load_image(_encode(original, "PNG"), MediaLimits())
    from_webp = load_image(_encode(original, "WEBP"), MediaLimits())
    assert image_hash(from_png) == image_hash(from_webp) == image_hash(original)
    assert 0 <= image_hash(original) < 2**63

    changed = original.copy()
    r, g, b = changed.getpixel((31, 19))
    changed.putpixel((31, 19), (r ^ 1, g, b))
    assert image_hash(changed) != image_hash(original)
    # Same bytes, other shape: the size is part of the hash.
    assert image_hash(original) != image_hash(Image.frombytes("RGB", (20, 32), original.tobytes()))


def test_image_hash_of_a_non_rgb_image_is_that_of_its_loaded_form() -> None:
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert image_hash(rgba) == image_hash(load_image(_encode(rgba, "PNG"), MediaLimits()))


def test_image_hash_over_many_row_strips() -> None:
    # Taller than one hashing strip: a row missed at a strip edge would go unnoticed otherwise.
    original = Image.new("RGB", (3, 1500), (5, 5, 5))
    changed = original.copy()
    changed.putpixel((2, 1023), (5, 5, 6))
    assert image_hash(changed) != image_hash(original)


# --- bounds -----------------------------------------------------------------------------------------


def test_media_limits_defaults_are_server_args_defaults() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    limits = MediaLimits()
    for name in ("max_image_bytes", "max_image_pixels", "max_images_per_request",
                 "allowed_local_media_path", "allow_remote_media"):
        assert getattr(limits, name) == defaults[name], name


def test_media_limits_from_server_args(tmp_path: Path) -> None:
    args = ServerArgs(max_image_bytes=4096, max_image_pixels=1000, max_images_per_request=3,
                      allowed_local_media_path=str(tmp_path), allow_remote_media=True)
    assert MediaLimits.from_server_args(args) == MediaLimits(4096, 1000, 3, str(tmp_path), True)


def test_count_is_bounded() -> None:
    png = _encode(_picture(), "PNG")
    assert len(load_images([png, png], MediaLimits(max_images_per_request=2))) == 2
    with pytest.raises(ImageInputError, match=r"^3 images .* at most 2"):
        load_images([png, png, png], MediaLimits(max_images_per_request=2))
    with pytest.raises(ImageInputError, match="1 images"):
        load_images([png], MediaLimits(max_images_per_request=0))


def test_a_million_sources_are_refused_by_count_before_any_decoding() -> None:
    start = time.perf_counter()
    # Not images at all: had one been decoded, the error would name image 0, not the count.
    with pytest.raises(ImageInputError, match=r"^1000000 images"):
        load_images([b"not an image"] * 10**6, MediaLimits())
    assert time.perf_counter() - start < 0.5


def test_the_failing_image_is_named_by_its_index() -> None:
    png = _encode(_picture(), "PNG")
    with pytest.raises(ImageInputError, match=r"^image 2: "):
        load_images([png, png, b"junk", png], MediaLimits())
    with pytest.raises(ImageInputError, match=r"^image 7: "):
        load_image(b"junk", MediaLimits(), index=7)


def test_encoded_bytes_are_bounded(tmp_path: Path) -> None:
    data = _encode(_noise(), "PNG")
    limits = MediaLimits(max_image_bytes=len(data) - 1, allowed_local_media_path=str(tmp_path))
    (tmp_path / "big.png").write_bytes(data)
    for source in (data, bytearray(data), _data_uri(data), str(tmp_path / "big.png")):
        with pytest.raises(ImageInputError, match="max-image-bytes"):
            load_image(source, limits)
    assert load_image(data, dataclasses.replace(limits, max_image_bytes=len(data))).size == (64, 64)


def test_a_data_uri_is_bounded_before_base64_decoding() -> None:
    limits = MediaLimits(max_image_bytes=1024)
    # Not base64 at all: refused for its length, so the decoder never saw it.
    with pytest.raises(ImageInputError, match="base64 characters encodes more"):
        load_image("data:image/png;base64," + "!" * 1400, limits)


def test_pixels_are_bounded() -> None:
    limits = MediaLimits(max_image_pixels=100)
    assert load_image(_encode(Image.new("RGB", (10, 10)), "PNG"), limits).size == (10, 10)
    for source in (_encode(Image.new("RGB", (11, 10)), "PNG"), Image.new("RGB", (11, 10))):
        with pytest.raises(ImageInputError, match=r"11x10 = 110 pixels .*max-image-pixels"):
            load_image(source, limits)


@pytest.mark.parametrize("width, height", [(8_000, 8_000), (100_000, 100_000)])
def test_a_decompression_bomb_is_refused_from_its_header(width: int, height: int) -> None:
    bomb = _png_header(width, height)
    assert len(bomb) < 200
    start = time.perf_counter()
    # 8000^2 is below Pillow's own limit: only the loader's check stands between it and the decoder.
    with pytest.raises(ImageInputError, match="pixels"):
        load_image(bomb, MediaLimits())
    assert time.perf_counter() - start < 1.0


def test_pillows_bomb_warning_is_an_error() -> None:
    # A limit above Pillow's MAX_IMAGE_PIXELS: Pillow only warns for this size, and the warning must refuse
    # it rather than let a decode start (which would fail differently, as truncated).
    assert Image.MAX_IMAGE_PIXELS is not None and 12_000**2 > Image.MAX_IMAGE_PIXELS
    with pytest.raises(ImageInputError, match="decompression bomb"):
        load_image(_png_header(12_000, 12_000), MediaLimits(max_image_pixels=400_000_000))


def test_a_pillow_written_bomb_is_refused() -> None:
    # A real file, not a crafted header: one pixel over the default bound, a few kilobytes on disk.
    out = io.BytesIO()
    Image.new("1", (20_001, 2_000)).save(out, format="PNG")
    assert len(out.getvalue()) < 100_000
    start = time.perf_counter()
    with pytest.raises(ImageInputError, match="40002000 pixels"):
        load_image(out.getvalue(), MediaLimits())
    assert time.perf_counter() - start < 1.0


# --- corrupt and lying files ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_truncated_file_is_refused(fmt: str) -> None:
    data = _encode(_noise(), fmt)
    load_image(data, MediaLimits())
    with pytest.raises(ImageInputError, match="corrupt or truncated"):
        load_image(data[: len(data) // 2], MediaLimits())


def test_random_bytes_and_empty_bytes_are_refused() -> None:
    for junk in (random.Random(1).randbytes(4096), b""):
        with pytest.raises(ImageInputError, match="not an image"):
            load_image(junk, MediaLimits())


def test_the_content_decides_not_the_name(tmp_path: Path) -> None:
    (tmp_path / "text.png").write_text("hello, I am not a picture\n")
    (tmp_path / "photo.png").write_bytes(_encode(_picture(), "JPEG"))
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    with pytest.raises(ImageInputError, match="not an image"):
        load_image(str(tmp_path / "text.png"), limits)
    assert load_image(str(tmp_path / "photo.png"), limits).size == (24, 16)
    # A data URI's image/* subtype may lie too.
    assert load_image(_data_uri(_encode(_picture(), "PNG"), "image/gif"), limits).size == (24, 16)


def test_a_format_outside_the_accepted_set_is_refused() -> None:
    out = io.BytesIO()
    _picture().save(out, format="PPM")  # Pillow reads PPM; a request may not send it
    with pytest.raises(ImageInputError, match="accepted format"):
        load_image(out.getvalue(), MediaLimits())


@pytest.mark.parametrize("uri, problem", [
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo= AAAA", "not valid base64"),  # whitespace is not skipped
    ("data:text/plain;base64," + base64.b64encode(b"hi").decode(), "not image/"),
    ("data:;base64,aGk=", "not image/"),
    ("data:image/png,%89PNG", "not base64"),
    ("data:image/png;base64", "no ','"),
])
def test_bad_data_uris_are_refused(uri: str, problem: str) -> None:
    with pytest.raises(ImageInputError, match=problem):
        load_image(uri, MediaLimits())


@pytest.mark.parametrize("source, named", [
    (42, "int"), ({"url": "x"}, "dict"), (None, "NoneType"), ("ftp://example.com/a.png", "'ftp'"),
    ("gopher://x", "'gopher'"),
])
def test_unsupported_sources_are_named(source, named: str) -> None:
    with pytest.raises(ImageInputError, match=named):
        load_image(source, MediaLimits())


# --- local files ------------------------------------------------------------------------------------


@pytest.fixture
def media(tmp_path: Path) -> tuple[Path, Path]:
    """(allowed directory with ok.png, a sibling directory with secret.png)."""
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(_encode(_picture(), "PNG"))
    (outside / "secret.png").write_bytes(_encode(_picture(), "PNG"))
    return allowed, outside


def test_local_files_are_refused_unless_allowed(media: tuple[Path, Path]) -> None:
    allowed, _ = media
    for limits in (MediaLimits(), MediaLimits(allowed_local_media_path="")):
        for source in (str(allowed / "ok.png"), (allowed / "ok.png").as_uri(), allowed / "ok.png"):
            with pytest.raises(ImageInputError, match="local image files are disabled"):
                load_image(source, limits)
    assert load_image(allowed / "ok.png", MediaLimits(allowed_local_media_path=str(allowed))).size == (24, 16)


def test_local_files_outside_the_allowed_directory_are_refused(media: tuple[Path, Path]) -> None:
    allowed, outside = media
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "linkdir").symlink_to(outside)
    escapes = [
        str(outside / "secret.png"),
        (outside / "secret.png").as_uri(),
        str(allowed / ".." / "private" / "secret.png"),
        "../private/secret.png",
        str(allowed / "link.png"),
        "linkdir/secret.png",
        "/etc/passwd",
    ]
    for source in escapes:
        with pytest.raises(ImageInputError, match="outside the allowed media directory"):
            load_image(source, limits)
    # A sibling whose name merely starts with the allowed one's is outside too.
    (allowed.parent / "media2").mkdir()
    (allowed.parent / "media2" / "x.png").write_bytes(_encode(_picture(), "PNG"))
    with pytest.raises(ImageInputError, match="outside"):
        load_image(str(allowed.parent / "media2" / "x.png"), limits)


def test_a_symlinked_allowed_directory_still_serves_its_files(media: tuple[Path, Path], tmp_path: Path) -> None:
    allowed, _ = media
    (tmp_path / "alias").symlink_to(allowed)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path / "alias"))
    assert load_image(str(tmp_path / "alias" / "ok.png"), limits).size == (24, 16)
    assert load_image("ok.png", limits).size == (24, 16)


def test_only_regular_files_are_read(media: tuple[Path, Path]) -> None:
    allowed, _ = media
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    (allowed / "sub").mkdir()
    for source in (str(allowed / "sub"), str(allowed)):
        with pytest.raises(ImageInputError, match="not a regular file"):
            load_image(source, limits)
    with pytest.raises(ImageInputError, match="no such file"):
        load_image("missing.png", limits)
    with pytest.raises(ImageInputError, match="another host"):
        load_image("file://example.com/ok.png", limits)


def test_a_fifo_is_refused_without_waiting_for_a_writer(media: tuple[Path, Path]) -> None:
    allowed, _ = media
    os.mkfifo(allowed / "pipe")
    outcome: list[ImageInputError | None] = []

    def load() -> None:
        try:
            load_image("pipe", MediaLimits(allowed_local_media_path=str(allowed)))
            outcome.append(None)
        except ImageInputError as exc:  # handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=2.0)
    if thread.is_alive():
        # Blocked in open(): a writer releases it, so the failure does not hang the run.
        os.close(os.open(allowed / "pipe", os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
        pytest.fail("opening a FIFO blocked until a writer came")
    assert outcome and "not a regular file" in str(outcome[0])


# --- remote URLs ------------------------------------------------------------------------------------


PNG_BODY = _encode(_picture(), "PNG")
REMOTE_LIMIT = 4096


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/ok.png":
            self._send(200, PNG_BODY, length=True)
        elif self.path == "/big":
            self._send(200, b"\0" * (REMOTE_LIMIT + 1), length=True)
        elif self.path == "/huge-declared":  # refused from the header, before a byte of the body is read
            self._send(200, PNG_BODY, length=True, declared=10**12)
        elif self.path == "/big-unsized":  # no Content-Length: only the bounded read can stop it
            self._send(200, b"\0" * (REMOTE_LIMIT * 4), length=False)
        elif self.path == "/redirect-ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://127.0.0.1/x.png")
            self.end_headers()
        else:
            self._send(404, b"not found", length=True)

    def _send(self, code: int, body: bytes, length: bool, declared: int | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "image/png")
        if length:
            self.send_header("Content-Length", str(len(body) if declared is None else declared))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_remote_urls_are_refused_by_default(server: str) -> None:
    for url in (f"{server}/ok.png", "https://example.com/cat.png", "HTTP://example.com/cat.png"):
        with pytest.raises(ImageInputError, match="remote image URLs are disabled"):
            load_image(url, MediaLimits())


def test_remote_urls_when_allowed(server: str) -> None:
    limits = MediaLimits(allow_remote_media=True, max_image_bytes=REMOTE_LIMIT, remote_timeout_s=5.0)
    assert _same_pixels(load_image(f"{server}/ok.png", limits), _picture())
    for path in ("/big", "/big-unsized", "/huge-declared"):
        with pytest.raises(ImageInputError, match="max-image-bytes"):
            load_image(f"{server}{path}", limits)
    with pytest.raises(ImageInputError, match="HTTP 404"):
        load_image(f"{server}/missing.png", limits)
    with pytest.raises(ImageInputError, match="HTTP 302"):
        load_image(f"{server}/redirect-ftp", limits)
