"""The images API requests carry, decoded within limits into ``ImageInput`` (RGB pixels and their digest).

Three ways in, one decoder: a ``data:image/...;base64,`` URL (OpenAI's ``image_url``), bare base64 with an
optional media type (Anthropic's ``{"type": "base64", ...}``, Ollama's ``images``), and, only where the operator
names hosts in ``GGUF_IMAGE_URL_HOSTS``, an http(s) URL fetched under the remote probe's guards
(``sizing.probe.remote``). Every limit is checked before the work it bounds: the encoded length before base64 is
decoded, the bytes before Pillow sees them, the header's width x height before a pixel is decompressed. Every
refusal is the client's (400, or 413 for bytes), naming the request field in ``param``; nothing a client or a
remote server sent is quoted back.

All of it blocks (Pillow's decoding, the fetch): the API adapters call it from a worker thread.
"""

from __future__ import annotations

import binascii
import io
import ipaddress
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from PIL import Image, ImageOps, UnidentifiedImageError

from sizing.errors import InvalidURLError

from ..engine.base import ImageInput
from ..errors import BadRequest, PayloadTooLarge

if TYPE_CHECKING:
    from ..settings import Settings

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The formats Pillow may try, and nothing else: a file of any other (TIFF, PSD, EPS...) never reaches that
format's parser. A JPEG holding several pictures (MPO, as some cameras write) is read as its first."""
_READABLE = "PNG, JPEG, WebP, GIF or BMP"
_MALFORMED = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError)
"""What Pillow raises for a truncated or malformed file (``UnidentifiedImageError`` is an OSError); its plugins
raise the last four where a header's fields do not add up."""
_WHITE = (255, 255, 255, 255)


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be: the ``GGUF_IMAGE_*`` settings, read once."""

    max_bytes: int
    """Most bytes of one image as sent (after base64 decoding, or as fetched)."""
    max_pixels: int
    """Most width x height of one image, checked from its header."""
    max_images: int
    """Most images in one request, all its messages together."""
    url_hosts: tuple[str, ...] = ()
    """Hosts (names, exact), addresses and networks (CIDR) http(s) image URLs may name; empty: data: URLs only."""
    timeout_s: float = 20.0
    """Total time to fetch one image by URL."""

    @staticmethod
    def of(settings: Settings) -> ImageLimits:
        from sizing.probe import parse_allow_hosts

        return ImageLimits(max_bytes=settings.image_max_bytes, max_pixels=settings.image_max_pixels,
                           max_images=settings.images_per_request,
                           url_hosts=parse_allow_hosts(settings.image_url_hosts), timeout_s=settings.remote_timeout_s)

    def budget(self) -> ImageBudget:
        return ImageBudget(self.max_images)


class ImageBudget:
    """The images of one request, counted as the adapters meet them: refused at the first beyond the limit, before
    it is decoded (so a request of a thousand images costs one decode past the limit, not a thousand)."""

    def __init__(self, max_images: int) -> None:
        self.max_images = max_images
        self.count = 0

    def take(self, param: str) -> None:
        """Count one more image (the one ``param`` names); ``BadRequest`` beyond the limit."""
        if self.count >= self.max_images:
            if self.max_images == 0:
                raise BadRequest(f"{param}: this server takes no images (GGUF_IMAGES_PER_REQUEST is 0)", param=param)
            raise BadRequest(f"{param}: more than {self.max_images} images in one request (GGUF_IMAGES_PER_REQUEST)",
                             param=param, max_images=self.max_images)
        self.count += 1


def _too_large(param: str, size: str, limits: ImageLimits) -> PayloadTooLarge:
    return PayloadTooLarge(f"{param}: the image is {size}, beyond the {limits.max_bytes} byte limit "
                           "(GGUF_IMAGE_MAX_BYTES)", param=param, max_bytes=limits.max_bytes)


def _unreadable(param: str, why: str) -> BadRequest:
    return BadRequest(f"{param}: not an image this server can read ({_READABLE}): {why}", param=param)


def decode_image(data: bytes, limits: ImageLimits, param: str) -> ImageInput:
    """The RGB pixels of one encoded image, upright (EXIF orientation applied), transparency composited on white
    (what a model trained on screenshots and photos expects behind a logo; black would be the bytes' accident).

    Refused before decoding: more than ``max_bytes`` bytes (``PayloadTooLarge``), a format not in ``FORMATS``,
    more than ``max_pixels`` pixels by the header (``BadRequest`` with the figures). Pillow's own
    decompression-bomb check (its warning, an error where warnings are errors, and its error at twice
    ``Image.MAX_IMAGE_PIXELS``) is a refusal too, never a 500; it is not loosened, so it stays a second net
    above ``max_pixels``. A file that ends early or does not parse is a ``BadRequest``, never a partial image
    (``ImageFile.LOAD_TRUNCATED_IMAGES`` stays off)."""
    if len(data) > limits.max_bytes:
        raise _too_large(param, f"{len(data)} bytes", limits)
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            width, height = im.size
            if width * height > limits.max_pixels:
                raise BadRequest(f"{param}: the image is {width}x{height} = {width * height} pixels, beyond the "
                                 f"{limits.max_pixels} pixel limit (GGUF_IMAGE_MAX_PIXELS)", param=param,
                                 width=width, height=height, max_pixels=limits.max_pixels)
            upright = ImageOps.exif_transpose(im)  # loads the pixels: only after the check above
            rgb = _to_rgb(upright)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadRequest(f"{param}: the image has more pixels than this server decodes (GGUF_IMAGE_MAX_PIXELS is "
                         f"{limits.max_pixels}; Pillow's decompression-bomb check refused it)", param=param,
                         max_pixels=limits.max_pixels) from None
    except UnidentifiedImageError:
        raise _unreadable(param, "not a format it knows") from None
    except _MALFORMED as exc:
        raise _unreadable(param, f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return ImageInput.of(rgb.width, rgb.height, rgb.tobytes())


def _to_rgb(im: Image.Image) -> Image.Image:
    """8-bit RGB. Modes with alpha, and palette or RGB/L images with a transparent colour (``info["transparency"]``),
    go through RGBA onto white; 16-bit grey (PNG's ``I;16``) is scaled to 8 bits first, since Pillow's
    ``convert`` would clip every value above 255 to white; the rest (P, L, LA, CMYK, YCbCr) ``convert`` handles."""
    if im.mode.startswith("I"):
        im = im.convert("I").point(lambda v: v / 257).convert("L")
    if "A" in im.mode or "a" in im.mode or "transparency" in im.info:
        rgba = im.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, _WHITE)
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def _strict_b64(text: str, limits: ImageLimits, param: str) -> bytes:
    """Standard base64 (the alphabet only, padded to whole quads), whitespace aside; its decoded length checked
    before it is decoded, so an oversized image is refused without being held twice."""
    compact = "".join(text.split())
    decoded_len = len(compact) // 4 * 3 - compact[-2:].count("=")
    if decoded_len > limits.max_bytes:
        raise _too_large(param, f"about {decoded_len} bytes", limits)
    invalid = BadRequest(f"{param}: the image is not valid base64", param=param)
    if not compact.isascii() or len(compact) % 4:  # strict_mode alone lets a stray "=" after a quad through
        raise invalid
    try:
        # strict_mode (3.11): the alphabet only, padding only at the end and nothing after it
        return binascii.a2b_base64(compact, strict_mode=True)
    except binascii.Error:
        raise invalid from None


def _check_media_type(media_type: str, param: str) -> None:
    if not media_type.lower().startswith("image/"):
        raise BadRequest(f"{param}: the media type {media_type[:60]!r} is not an image/* type", param=param)


def image_from_base64(data: str, media_type: str | None, limits: ImageLimits, param: str) -> ImageInput:
    """An image sent as base64: Anthropic's ``{"type": "base64", "media_type": ..., "data": ...}`` (media type
    given) or one of Ollama's ``images`` (none). The media type must be ``image/*``; the format is read from the
    bytes themselves, as Pillow identifies it, never taken from the label."""
    if media_type is not None:
        _check_media_type(media_type, param)
    return decode_image(_strict_b64(data, limits, param), limits, param)


def image_from_data_url(url: str, limits: ImageLimits, param: str) -> ImageInput:
    """``data:image/<type>[;parameters];base64,<data>`` (RFC 2397): base64 only (a percent-encoded image is
    refused rather than guessed at), an ``image/*`` media type."""
    head, comma, payload = url.partition(",")
    if not head[:5].lower() == "data:" or not comma:
        raise BadRequest(f"{param}: not a data: URL (data:image/<type>;base64,<data>)", param=param)
    fields = [f.strip() for f in head[5:].split(";")]
    if fields[-1].lower() != "base64" or len(fields) < 2:
        raise BadRequest(f"{param}: a data: URL's image must be base64 (data:image/<type>;base64,<data>)",
                         param=param)
    _check_media_type(fields[0], param)
    return decode_image(_strict_b64(payload, limits, param), limits, param)


def host_listed(host: str, url_hosts: tuple[str, ...]) -> bool:
    """Whether an image URL's host (lower case, no brackets) is one the operator named: the same name (any case),
    or an address that is, or lies in, a listed address or network (an IPv4 address reached through an IPv6
    transition address, ``::ffff:127.0.0.1``, judged as itself, as the probe's address rule judges it). A name is
    never matched through what it resolves to: DNS could answer one address now and another when the connection
    is made."""
    from sizing.probe import remote

    if remote.ProbeLimits(public_only=True, allow_hosts=url_hosts).host_allowed(host):
        return True
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    for entry in url_hosts:
        try:
            net = ipaddress.ip_network(entry.strip("[]"), strict=False)
        except ValueError:
            continue
        if ip in net or remote.embedded_ipv4(ip) in net:
            return True
    return False


def image_from_url(url: str, limits: ImageLimits, param: str) -> ImageInput:
    """An image named by URL: a data: URL decoded; an http(s) URL fetched only from a host ``url_hosts`` lists
    (``host_listed``), checked before any connection is opened.

    The fetch is the remote probe's (``sizing.probe.remote.probe_client``): no proxies from the environment, and
    connections opened only to addresses its limits allow (a listed name connects whatever it resolves to, the
    operator having named it; an address must be listed). Redirects are not followed: a 3xx is a ``BadRequest``,
    since its target would need the same host check and a client can send the final URL itself. At most
    ``max_bytes`` are read (``Content-Length`` checked first, the body counted as it arrives: ``PayloadTooLarge``)
    within ``timeout_s`` in all. Every failure of the fetch (a non-2xx status, a refused or failed connection, a
    timeout) is a ``BadRequest``: the client sent a URL this server cannot fetch, not a fault of the server's."""
    if url[:5].lower() == "data:":
        return image_from_data_url(url, limits, param)
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme not in ("http", "https"):
        raise BadRequest(f"{param}: not a data: or http(s) URL", param=param)
    if not limits.url_hosts:
        raise BadRequest(f"{param}: image URLs are not fetched here: send a data: URL, or set GGUF_IMAGE_URL_HOSTS",
                         param=param)
    from sizing.probe import remote

    try:
        remote.check_url(url)
    except InvalidURLError as exc:
        raise BadRequest(f"{param}: {exc.reason}", param=param) from None
    host = urlsplit(url).hostname or ""
    if not host_listed(host, limits.url_hosts):
        raise BadRequest(f"{param}: images are not fetched from {host[:80]} (GGUF_IMAGE_URL_HOSTS names the hosts "
                         "they are)", param=param)
    return decode_image(_fetch(url, host, limits, param), limits, param)


def _fetch(url: str, host: str, limits: ImageLimits, param: str) -> bytes:
    """The body of a GET of ``url``, within ``limits``; the message of every refusal is ours, never the server's."""
    import httpx

    from sizing.probe import remote

    probe = remote.ProbeLimits(deadline_s=limits.timeout_s, max_bytes=limits.max_bytes, public_only=True,
                               allow_hosts=limits.url_hosts)
    deadline = time.monotonic() + limits.timeout_s
    late = BadRequest(f"{param}: {host[:80]} did not send the image within {limits.timeout_s:g} s", param=param)
    try:
        with remote.probe_client(probe, {"Accept": "image/*"}) as client, \
                client.stream("GET", url, timeout=limits.timeout_s) as resp:
            if resp.is_redirect:
                raise BadRequest(f"{param}: the image URL answered a redirect (HTTP {resp.status_code}), which is "
                                 "not followed: send the URL it leads to", param=param)
            if not resp.is_success:
                raise BadRequest(f"{param}: fetching the image failed: HTTP {resp.status_code}", param=param)
            try:
                declared = int(resp.headers.get("content-length", ""))
            except ValueError:
                declared = -1
            if declared > limits.max_bytes:
                raise _too_large(param, f"{declared} bytes (its Content-Length)", limits)
            chunks: list[bytes] = []
            got = 0
            for chunk in resp.iter_bytes():
                got += len(chunk)
                if got > limits.max_bytes:
                    raise _too_large(param, f"more than {limits.max_bytes} bytes", limits)
                chunks.append(chunk)
                if time.monotonic() > deadline:  # a server trickling bytes cannot outlast the limit
                    raise late
            return b"".join(chunks)
    except remote.Refused:
        # Unreachable after host_listed (a listed name skips the address check, a listed address passes it);
        # kept so that a change to either rule is a 400, not a 500. sizing.probe exports no name for it.
        raise BadRequest(f"{param}: {host[:80]} is not an address images are fetched from", param=param) from None
    except httpx.TimeoutException:
        raise late from None
    except httpx.ConnectError:
        # One message for refused, unreachable and unresolvable: the answer must not map which ports are open.
        raise BadRequest(f"{param}: could not connect to {host[:80]}", param=param) from None
    except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:
        # UnicodeError: httpx reading a malformed Location of a redirect it then reports.
        raise BadRequest(f"{param}: fetching the image failed ({type(exc).__name__})", param=param) from None


def image_url_of(part: dict[str, object]) -> object:
    """The URL of an OpenAI ``image_url`` part: ``{"image_url": {"url": ...}}`` (OpenAI's shape) or a bare string
    (what several clients send)."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def decode_message_images(messages: list[dict[str, object]], limits: ImageLimits) -> list[dict[str, object]]:
    """The chat's messages with each ``image_url`` part decoded into the engine's ``{"type": "image", "image":
    ImageInput}`` (``service.text.prompts``), counted against ``max_images`` before each is decoded. The other
    APIs' images arrive here as ``image_url`` parts (Anthropic's base64 blocks, Ollama's ``images``, the Responses
    API's ``input_image`` are converted by their adapters). Blocking: from a worker thread."""
    budget = limits.budget()
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            parts: list[object] = []
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("type") == "image_url":
                    param = f"messages[{i}].content[{j}].image_url"
                    url = image_url_of(p)
                    if not isinstance(url, str) or not url:
                        raise BadRequest(f"{param}: an image_url part needs {{\"url\": string}}", param=param)
                    budget.take(param)
                    parts.append({"type": "image", "image": image_from_url(url, limits, param)})
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out
