"""The one place where a request's image inputs are read and decoded, each step bounded.

An image input is attacker-chosen: it can be huge, name a file it should not, point at a slow server, or be
a small file that declares a gigapixel canvas (a decompression bomb). Every source goes through here so that
the bounds of ServerArgs (--max-image-bytes, --max-image-pixels, --max-images-per-request,
--allowed-local-media-path, --allow-remote-media) hold for all of them, and so that a bad image is an
`ImageInputError` (a 400 naming the image) rather than a worker that dies or stalls.

Order of checks, cheapest first: the count of images, the encoded size (before base64 decoding, before a
read, from the file's stat), the pixel count from the header (before any pixel is decoded), then the decode.

What comes back is always a fully loaded RGB `PIL.Image.Image`, detached from any file, so that the
processor and `image_hash` see one representation whatever the encoding was.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import http.client
import io
import os
import re
import stat
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

if TYPE_CHECKING:
    from radixserve.server_args import ServerArgs


@dataclass(frozen=True)
class MediaLimits:
    """The bounds one image input is held to; defaults are ServerArgs' defaults.

    A separate value rather than ServerArgs itself, so that the loader can run (and be tested) without a
    server, and so that the remote timeout, which has no flag, has a home.
    """

    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_images_per_request: int = 16
    allowed_local_media_path: str | None = None
    allow_remote_media: bool = False
    remote_timeout_s: float = 10.0

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> MediaLimits:
        """The limits a server started with `args` (a ServerArgs) enforces."""
        # Plain attribute reads: a renamed ServerArgs field should fail here, not fall back to a default.
        return cls(
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            max_images_per_request=args.max_images_per_request,
            allowed_local_media_path=args.allowed_local_media_path,
            allow_remote_media=args.allow_remote_media,
        )


class ImageInputError(ValueError):
    """An image input that is refused: the message names the image ("image 1: ...") and the problem.

    A ValueError so that an API layer that already maps ValueError to a 400 needs nothing new.
    """


# Pillow opens ~40 formats, some through external programs (EPS runs Ghostscript) or little-used decoders;
# a request gets only the formats a client plausibly sends. MPO is how Pillow names many phones' JPEGs.
_ACCEPTED_FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "AVIF")
# A URI scheme is two or more letters, so a Windows drive ("C:\\x") is not one.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_REMOTE_CHUNK = 64 * 1024
_HASH_ROWS = 512


def load_images(sources: list, limits: MediaLimits) -> list[Image.Image]:
    """Every image of one request, in order, as RGB; the count is checked before any image is read,
    so a request listing a million images costs one len()."""
    count = len(sources)
    if count > limits.max_images_per_request:
        raise ImageInputError(
            f"{count} images in one request; at most {limits.max_images_per_request} are allowed "
            "(--max-images-per-request)")
    return [load_image(source, limits, index) for index, source in enumerate(sources)]


def load_image(source, limits: MediaLimits, index: int = 0) -> Image.Image:
    """One image input as a fully loaded RGB image, or ImageInputError naming `index`.

    `source` is a PIL image, encoded bytes, a `data:image/...;base64,` URI, an http(s) URL (only with
    allow_remote_media), or a `file://` URI / local path (only inside allowed_local_media_path; a relative
    path is taken relative to that directory, not to the server's working directory).
    """
    if isinstance(source, Image.Image):
        return _from_pil(source, limits, index)
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        _check_bytes(len(data), limits, index)
        return _decode(data, limits, index)
    if isinstance(source, os.PathLike):
        return _decode(_read_local(os.fspath(source), limits, index), limits, index)
    if not isinstance(source, str):
        raise ImageInputError(f"image {index}: unsupported image source of type {type(source).__name__}")
    match = _SCHEME.match(source)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        data = _decode_data_uri(source, limits, index)
    elif scheme in ("http", "https"):
        data = _fetch_remote(source, limits, index)
    elif scheme == "file":
        data = _read_local(_file_uri_path(source, index), limits, index)
    elif scheme:
        raise ImageInputError(f"image {index}: unsupported URI scheme {scheme!r}")
    else:
        data = _read_local(source, limits, index)
    return _decode(data, limits, index)


def image_hash(image: Image.Image) -> int:
    """A 63-bit id of an image's pixels: the first 8 bytes of a sha256 over (mode, size, pixel bytes) of its
    RGB form, shifted right by one.

    Two inputs with the same pixels (a PNG and a lossless WebP of it, a PIL image) get the same id, so the
    radix cache and the vision-encoder cache share their work. 63 bits so that it fits a signed int64 tensor.
    A non-RGB image is first converted as load_image would, so hashing before or after loading agrees.
    """
    rgb = image if image.mode == "RGB" else _to_rgb(image)
    width, height = rgb.size
    digest = hashlib.sha256()
    digest.update(rgb.mode.encode())
    digest.update(struct.pack("<QQ", width, height))
    # In strips of rows: one full-size copy of a 40-megapixel image would be another ~120 MB.
    for top in range(0, height, _HASH_ROWS):
        digest.update(rgb.crop((0, top, width, min(height, top + _HASH_ROWS))).tobytes())
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def _check_bytes(size: int, limits: MediaLimits, index: int) -> None:
    if size > limits.max_image_bytes:
        raise ImageInputError(
            f"image {index}: {size} bytes is more than the {limits.max_image_bytes} allowed (--max-image-bytes)")


def _check_pixels(size: tuple[int, int], limits: MediaLimits, index: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageInputError(f"image {index}: empty image ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise ImageInputError(
            f"image {index}: {width}x{height} = {width * height} pixels is more than the "
            f"{limits.max_image_pixels} allowed (--max-image-pixels)")


def _from_pil(image: Image.Image, limits: MediaLimits, index: int) -> Image.Image:
    _check_pixels(image.size, limits, index)
    try:
        # A caller's image may still be lazy (Image.open); loading it can fail like any decode.
        image.load()
        return _to_rgb(image)
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error) as exc:
        raise ImageInputError(f"image {index}: cannot decode the image ({exc})") from exc


@functools.cache
def _accepted_formats() -> tuple[str, ...]:
    # Image.open raises KeyError on a format this Pillow build lacks (AVIF is optional), so keep only known ones.
    Image.init()
    return tuple(f for f in _ACCEPTED_FORMATS if f in Image.OPEN)


def _decode(data: bytes, limits: MediaLimits, index: int) -> Image.Image:
    """Decode, refusing from the header alone an image with too many pixels."""
    # Image.open runs Pillow's own bomb check before we see the size; between Image.MAX_IMAGE_PIXELS (~89.5M)
    # and twice that it only warns, and a warning a filter hides would let the decode go ahead; so ServerArgs
    # caps --max-image-pixels there. (catch_warnings swaps the process-wide
    # filter list: before Python 3.14 it is not isolated between threads.)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=_accepted_formats()) as image:
                # Image.open has read only the header: the size is known, no pixel is decoded yet.
                _check_pixels(image.size, limits, index)
                # Animated GIF/WebP/APNG: the image is its first frame, which open() already selects.
                image.load()
                return _to_rgb(image)
        except ImageInputError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageInputError(f"image {index}: refused as a decompression bomb ({exc})") from exc
        except Image.UnidentifiedImageError as exc:
            raise ImageInputError(
                f"image {index}: not an image in an accepted format ({', '.join(_accepted_formats())})"
            ) from exc
        # Pillow reports a truncated or corrupt file through any of these, on open() or on load().
        except (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error) as exc:
            raise ImageInputError(f"image {index}: corrupt or truncated image ({exc})") from exc


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white, and 16-bit grey scaled to 8 bits.

    White, not black: a transparent background is most often a document, logo or screenshot drawn on a
    white page, and dropping the alpha channel would show whatever colour the transparent pixels happen to
    store (often black). Always a new image, so the result holds no file handle of the source.
    """
    if image.mode.startswith("I;16"):
        # Pillow's own conversion clips 16-bit grey to 0..255, so a 16-bit scan would come out white.
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _decode_data_uri(uri: str, limits: MediaLimits, index: int) -> bytes:
    header, comma, payload = uri[len("data:"):].partition(",")
    if not comma:
        raise ImageInputError(f"image {index}: malformed data URI (no ',')")
    params = [p.strip().lower() for p in header.split(";")]
    mime = params[0]
    if not mime.startswith("image/"):
        raise ImageInputError(f"image {index}: data URI media type {mime or '(none)'!r} is not image/*")
    if params[-1] != "base64":
        raise ImageInputError(f"image {index}: data URI is not base64 (';base64,' expected)")
    # Bound the text before decoding it: 4 characters per 3 bytes.
    max_chars = 4 * -(-limits.max_image_bytes // 3)
    if len(payload) > max_chars:
        raise ImageInputError(
            f"image {index}: data URI of {len(payload)} base64 characters encodes more than the "
            f"{limits.max_image_bytes} bytes allowed (--max-image-bytes)")
    try:
        # Strict: whitespace or a stray character is an error, not silently skipped.
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageInputError(f"image {index}: data URI is not valid base64 ({exc})") from exc
    _check_bytes(len(data), limits, index)
    return data


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows a redirect to ftp:// too; an image URL may only lead to another http(s) URL."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a non-http(s) URL refused", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch_remote(url: str, limits: MediaLimits, index: int) -> bytes:
    if not limits.allow_remote_media:
        raise ImageInputError(
            f"image {index}: remote image URLs are disabled on this server (--allow-remote-media); "
            "send the image inline as a base64 data URI")
    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    request = urllib.request.Request(url, headers={"User-Agent": "radixserve-image-loader"})
    # The socket timeout bounds each read; the deadline bounds them all (a server may trickle bytes).
    deadline = time.monotonic() + limits.remote_timeout_s
    try:
        with opener.open(request, timeout=limits.remote_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit():
                _check_bytes(int(declared), limits, index)
            chunks: list[bytes] = []
            received = 0
            while True:
                chunk = response.read1(_REMOTE_CHUNK)
                if not chunk:
                    break
                received += len(chunk)
                _check_bytes(received, limits, index)
                if time.monotonic() > deadline:
                    raise ImageInputError(f"image {index}: fetching {url} took over {limits.remote_timeout_s} s")
                chunks.append(chunk)
    except ImageInputError:
        raise
    except urllib.error.HTTPError as exc:
        raise ImageInputError(f"image {index}: fetching {url} failed with HTTP {exc.code}") from exc
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as exc:
        raise ImageInputError(f"image {index}: fetching {url} failed ({exc})") from exc
    return b"".join(chunks)


def _file_uri_path(uri: str, index: int) -> str:
    parts = urllib.parse.urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise ImageInputError(f"image {index}: file URI names another host ({parts.netloc!r})")
    return urllib.request.url2pathname(parts.path)


def _read_local(path: str, limits: MediaLimits, index: int) -> bytes:
    """The bytes of a local file, only from inside allowed_local_media_path."""
    if not limits.allowed_local_media_path:
        raise ImageInputError(
            f"image {index}: local image files are disabled on this server (--allowed-local-media-path)")
    try:
        allowed = os.path.realpath(limits.allowed_local_media_path)
        # realpath resolves `..` and every symlink, so what is compared is where the bytes really are.
        real = os.path.realpath(os.path.join(allowed, path))
        if os.path.commonpath([real, allowed]) != allowed:
            raise ImageInputError(f"image {index}: {path!r} is outside the allowed media directory")
        # O_NOFOLLOW: a symlink swapped in after the check is not followed; O_NONBLOCK: a FIFO does not
        # block the open (it is refused below as not a regular file).
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(real, flags)
    except ImageInputError:
        raise
    except FileNotFoundError as exc:
        raise ImageInputError(f"image {index}: no such file {path!r}") from exc
    except (OSError, ValueError) as exc:
        raise ImageInputError(f"image {index}: cannot open {path!r} ({exc.__class__.__name__})") from exc
    try:
        # fstat of the open file, not a stat of the path: it describes the file that is then read.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageInputError(f"image {index}: {path!r} is not a regular file")
        _check_bytes(info.st_size, limits, index)
        # Read one byte past the bound: a file that grew since the fstat is still refused.
        chunks: list[bytes] = []
        remaining = limits.max_image_bytes + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise ImageInputError(f"image {index}: cannot read {path!r} ({exc.__class__.__name__})") from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    _check_bytes(len(data), limits, index)
    return data
