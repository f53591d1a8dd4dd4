"""The images API requests carry, decoded within limits into ``ImageInput`` (RGB pixels and their digest).

Three ways in, one decoder: a ``data:image/...;base64,`` URL (OpenAI's ``image_url``), bare base64 with an
optional media type (Anthropic's ``{"type": "base64", ...}``, Ollama's ``images``), and, only where the operator
names hosts in ``GGUF_IMAGE_URL_HOSTS``, an http(s) URL fetched under the remote probe's guards
(``sizing.probe.remote``). Every limit is checked before the work it bounds: the encoded length before base64 is
decoded, the bytes before Pillow sees them, the header's width x height before a pixel is decompressed. Every
refusal is the client's (400, or 413 for bytes), naming the request field in ``param``; nothing a client or a
remote server sent is quoted back.

A chat's images are found first (``image_parts``), refused whole where the model takes none or there are too many
or a URL is not one this server fetches, all before any image is fetched or decoded; then each is decoded
(``decode_images``). Decoding (Pillow's, bounded by the limits above) runs on asyncio's default threads; fetches run
on threads of their own (``ImageFetches``), at most ``GGUF_IMAGE_FETCHES`` at once and
``GGUF_IMAGE_FETCHES_PER_CLIENT`` for one client, beyond either a 429 with Retry-After: slow image hosts can never
hold the threads that decode inline images or serve the rest of the server, and no request waits for a fetch slot.
"""

from __future__ import annotations

import asyncio
import binascii
import concurrent.futures
import io
import ipaddress
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from PIL import Image, ImageOps, UnidentifiedImageError

from sizing.errors import InvalidURLError

from ..engine.base import ImageInput
from ..errors import BadRequest, PayloadTooLarge, QueueFull

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
    host = check_image_url(url, limits, param)
    if host is None:
        return image_from_data_url(url, limits, param)
    return decode_image(_fetch(url, host, limits, param), limits, param)


def check_image_url(url: str, limits: ImageLimits, param: str) -> str | None:
    """None for a data: URL (decoded, not fetched); for an http(s) URL the host it is fetched from, once it is a
    URL the remote probe takes (``check_url``) of a host ``url_hosts`` lists; ``BadRequest`` otherwise. No
    connection is opened: a chat's every URL is checked before any of its images is fetched."""
    if url[:5].lower() == "data:":
        return None
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
    return host


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


@dataclass(frozen=True)
class ImagePart:
    """One image part of a chat (an ``image_url`` part: the other APIs' images are converted to them by their
    adapters), found before any image is fetched or decoded."""

    message: int
    part: int
    url: str

    @property
    def where(self) -> str:
        return f"messages[{self.message}].content[{self.part}]"

    @property
    def param(self) -> str:
        return f"{self.where}.image_url"


def image_parts(messages: list[dict[str, Any]]) -> list[ImagePart]:
    """The chat's ``image_url`` parts in order; ``BadRequest`` for one without a URL."""
    found = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = image_url_of(p)
                if not isinstance(url, str) or not url:
                    param = f"messages[{i}].content[{j}].image_url"
                    raise BadRequest(f"{param}: an image_url part needs {{\"url\": string}}", param=param)
                found.append(ImagePart(i, j, url))
    return found


def takes_no_images(part: ImagePart) -> BadRequest:
    """The refusal of an image to a model loaded without a vision projector (the words and ``param`` of the
    prompt's own check, ``service.text.prompts``), raised before the image is fetched or decoded."""
    return BadRequest(f"{part.where}: this model takes no images (it was loaded without a vision projector: mmproj)",
                      param=part.where)


class ImageFetches:
    """The image URLs being fetched, on threads of their own: at most ``total`` at once and ``per_client`` for one
    client (its API key, or its address: ``service.api.generation.image_client``); beyond either ``QueueFull``
    (429 with Retry-After) at once, never a wait. A fetch ends within ``GGUF_REMOTE_TIMEOUT_S`` (``_fetch``), so a
    slot is free again within that. A slot is held until the fetch's thread is done, even where the request has
    gone: the threads are never more than ``total``, so a fetch never queues behind another."""

    retry_after_s = 2

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.busy = 0
        self.by_client: dict[str, int] = {}
        self._lock = threading.Lock()  # released from the fetch's thread, when it ends
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=total, thread_name_prefix="image-fetch")

    def _take(self, client: str) -> None:
        with self._lock:
            mine = self.by_client.get(client, 0)
            if mine >= self.per_client:
                raise QueueFull(f"this client has {mine} images being fetched, the most one client may "
                                "(GGUF_IMAGE_FETCHES_PER_CLIENT); retry shortly", retry_after_s=self.retry_after_s)
            if self.busy >= self.total:
                raise QueueFull(f"{self.busy} images are being fetched, the most this server fetches at once "
                                "(GGUF_IMAGE_FETCHES); retry shortly", retry_after_s=self.retry_after_s)
            self.busy += 1
            self.by_client[client] = mine + 1

    def _release(self, client: str) -> None:
        with self._lock:
            self.busy -= 1
            left = self.by_client[client] - 1
            if left:
                self.by_client[client] = left
            else:
                del self.by_client[client]

    async def fetch(self, url: str, host: str, limits: ImageLimits, param: str, client: str) -> bytes:
        """The body of ``url`` (``_fetch``: within ``limits``, a ``BadRequest`` for every failure), fetched on
        these threads; ``QueueFull`` at once where ``client`` or the server is at its limit."""
        self._take(client)
        try:
            future = self._pool.submit(_fetch, url, host, limits, param)
        except BaseException:
            self._release(client)
            raise
        future.add_done_callback(lambda _: self._release(client))
        return await asyncio.wrap_future(future)


async def decode_images(messages: list[dict[str, Any]], parts: list[ImagePart], limits: ImageLimits,
                        fetches: ImageFetches, client: str) -> list[dict[str, Any]]:
    """The chat's messages with each image part (``parts``, as ``image_parts`` found them) decoded into the
    engine's ``{"type": "image", "image": ImageInput}`` (``service.text.prompts``).

    Every part is counted against ``max_images`` and every URL checked (``check_image_url``) before the first
    image is fetched or decoded: a request refused for its fifth image fetches none. Then, in order, a data: URL is
    decoded on asyncio's default threads, an http(s) URL fetched on ``fetches``' (``QueueFull`` beyond its
    limits) and then decoded there too."""
    budget = limits.budget()
    for p in parts:
        budget.take(p.param)
    hosts = [check_image_url(p.url, limits, p.param) for p in parts]
    images: dict[tuple[int, int], ImageInput] = {}
    for p, host in zip(parts, hosts):
        if host is None:
            image = await asyncio.to_thread(image_from_data_url, p.url, limits, p.param)
        else:
            data = await fetches.fetch(p.url, host, limits, p.param, client)
            image = await asyncio.to_thread(decode_image, data, limits, p.param)
        images[(p.message, p.part)] = image
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list) and any((i, j) in images for j in range(len(content))):
            m = {**m, "content": [{"type": "image", "image": images[(i, j)]} if (i, j) in images else part
                                  for j, part in enumerate(content)]}
        out.append(m)
    return out
