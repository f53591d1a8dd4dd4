"""``service.api.images``: real images encoded by Pillow here, hostile ones built byte by byte, and a real HTTP
server on 127.0.0.1 for the fetch; every refusal a 400 (or a 413 for bytes) naming its field."""

from __future__ import annotations

import base64
import http.server
import io
import os
import socket
import struct
import threading
import time
import warnings
import zlib
from typing import Any, Iterator

import pytest
from PIL import Image

from service.api.images import (ImageBudget, ImageLimits, decode_image, host_listed, image_from_base64,
                                image_from_data_url, image_from_url)
from service.errors import BadRequest, PayloadTooLarge
from service.settings import Settings

P = "messages[0].content[1].image_url"
LIMITS = ImageLimits(max_bytes=64 * 1024, max_pixels=1 << 20, max_images=2)


def encode(im: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def pattern(w: int = 5, h: int = 3) -> Image.Image:
    """An RGB image whose every pixel differs: a lossless decode must give these bytes back."""
    im = Image.new("RGB", (w, h))
    im.putdata([(x * 40, y * 80, (x + y) * 20) for y in range(h) for x in range(w)])
    return im


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` in its IHDR, with an IDAT that is not zlib: reading its pixels
    would fail, so a refusal that names the size proves the size was checked before any pixel was read."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"not zlib") + chunk(b"IEND", b"")


# -- formats ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, kw", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True})])
def test_lossless_formats_give_back_the_exact_pixels(fmt: str, kw: dict[str, Any]) -> None:
    im = pattern()
    out = decode_image(encode(im, fmt, **kw), LIMITS, P)
    assert (out.width, out.height) == (5, 3)
    assert out.rgb == im.tobytes()


def test_a_jpeg_decodes_to_its_size_and_near_its_colour() -> None:
    out = decode_image(encode(Image.new("RGB", (16, 8), (200, 30, 60)), "JPEG", quality=95), LIMITS, P)
    assert (out.width, out.height, len(out.rgb)) == (16, 8, 16 * 8 * 3)
    r, g, b = out.rgb[:3]
    assert abs(r - 200) <= 4 and abs(g - 30) <= 4 and abs(b - 60) <= 4


def test_a_cmyk_jpeg_becomes_rgb() -> None:
    out = decode_image(encode(Image.new("CMYK", (4, 4), (0, 255, 255, 0)), "JPEG", quality=95), LIMITS, P)
    assert len(out.rgb) == 4 * 4 * 3
    r, g, b = out.rgb[:3]
    assert r > 240 and g < 15 and b < 15  # no cyan, full magenta and yellow: red


def test_a_gif_is_read_as_its_first_frame_with_its_palette_colours() -> None:
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    out = decode_image(gif, LIMITS, P)
    assert out.rgb == bytes([255, 0, 0]) * 16


def test_a_palette_png_gives_its_colours_and_its_transparent_index_is_white() -> None:
    im = Image.new("P", (3, 1))
    im.putpalette([10, 20, 30, 200, 100, 50, 0, 0, 0])
    im.putdata([0, 1, 2])
    out = decode_image(encode(im, "PNG", transparency=2), LIMITS, P)
    assert out.rgb == bytes([10, 20, 30, 200, 100, 50, 255, 255, 255])


def test_alpha_is_composited_on_white() -> None:
    im = Image.new("RGBA", (3, 1))
    im.putdata([(255, 0, 0, 255), (0, 0, 0, 0), (0, 0, 255, 128)])
    out = decode_image(encode(im, "PNG"), LIMITS, P)
    assert out.rgb[:3] == bytes([255, 0, 0])
    assert out.rgb[3:6] == bytes([255, 255, 255])  # transparent: white, not the black its colour bytes hold
    r, g, b = out.rgb[6:9]
    assert b == 255 and abs(r - 127) <= 1 and abs(g - 127) <= 1


def test_grey_with_alpha_is_composited_on_white() -> None:
    im = Image.new("LA", (2, 1))
    im.putdata([(0, 255), (0, 0)])
    assert decode_image(encode(im, "PNG"), LIMITS, P).rgb == bytes([0, 0, 0, 255, 255, 255])


def test_sixteen_bit_grey_is_scaled_not_clipped() -> None:
    im = Image.new("I;16", (2, 1))
    im.putdata([40000, 1000])
    png = encode(im, "PNG")
    assert Image.open(io.BytesIO(png)).mode.startswith("I")
    assert decode_image(png, LIMITS, P).rgb == bytes([155] * 3 + [3] * 3)  # 40000 / 257, 1000 / 257


def test_exif_orientation_is_applied() -> None:
    im = Image.new("RGB", (8, 2), (0, 200, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to show
    out = decode_image(encode(im, "JPEG", exif=exif), LIMITS, P)
    assert (out.width, out.height) == (2, 8)
    assert decode_image(encode(im, "JPEG"), LIMITS, P).width == 8


def test_the_digest_is_the_pixels_not_the_encoding() -> None:
    a = decode_image(encode(pattern(), "PNG"), LIMITS, P)
    b = decode_image(encode(pattern(), "BMP"), LIMITS, P)
    assert a.digest == b.digest
    other = pattern()
    other.putpixel((2, 1), (1, 2, 3))
    assert decode_image(encode(other, "PNG"), LIMITS, P).digest != a.digest
    assert decode_image(encode(pattern(3, 5), "PNG"), LIMITS, P).digest != a.digest


# -- refusals of the bytes -------------------------------------------------------------------------------------

def test_too_many_bytes_is_refused_before_decoding() -> None:
    with pytest.raises(PayloadTooLarge) as e:
        decode_image(b"\x89PNG" + b"\0" * LIMITS.max_bytes, LIMITS, P)
    assert e.value.param == P and str(LIMITS.max_bytes) in e.value.message


def test_an_oversized_data_url_is_refused_by_its_length_before_base64_is_read() -> None:
    # Not base64 at all: the size is refused first, so nothing was decoded.
    too_long = "!" * (LIMITS.max_bytes // 3 * 4 + 8)
    with pytest.raises(PayloadTooLarge) as e:
        image_from_data_url("data:image/png;base64," + too_long, LIMITS, P)
    assert e.value.param == P
    with pytest.raises(PayloadTooLarge):
        image_from_base64(too_long, "image/png", LIMITS, "images[0]")
    # One byte within: the length check is exact, not a round figure.
    fits = encode(Image.new("RGB", (1, 1)), "PNG")
    exact = ImageLimits(max_bytes=len(fits), max_pixels=64, max_images=1)
    assert image_from_base64(base64.b64encode(fits).decode(), None, exact, "images[0]").width == 1
    with pytest.raises(PayloadTooLarge):
        image_from_base64(base64.b64encode(fits + b"\0").decode(), None, exact, "images[0]")


def test_base64_split_over_lines_is_read() -> None:
    text = base64.encodebytes(encode(pattern(), "PNG")).decode()  # 76-character lines
    assert "\n" in text
    assert image_from_base64(text, None, LIMITS, "images[0]").rgb == pattern().tobytes()
    assert image_from_data_url("data:image/png;base64,\n" + text, LIMITS, P).width == 5


@pytest.mark.parametrize("text", ["@@@@", "QUI", "QUJD=", "QU JD-_", "QUJDé"])
def test_invalid_base64_is_a_bad_request(text: str) -> None:
    with pytest.raises(BadRequest) as e:
        image_from_base64(text, "image/png", LIMITS, "images[0]")
    assert e.value.param == "images[0]" and "base64" in e.value.message
    with pytest.raises(BadRequest):
        image_from_data_url("data:image/png;base64," + text, LIMITS, P)


@pytest.mark.parametrize("url", [
    "data:text/plain;base64,aGVsbG8=",
    "data:;base64,aGVsbG8=",
    "data:image/png,%89PNG",  # not base64
    "data:image/png;base64",  # no comma
    "data:base64,aGVsbG8=",
])
def test_a_data_url_must_be_base64_of_an_image_type(url: str) -> None:
    with pytest.raises(BadRequest) as e:
        image_from_data_url(url, LIMITS, P)
    assert e.value.param == P


def test_a_non_image_media_type_is_refused_for_base64() -> None:
    png = base64.b64encode(encode(pattern(), "PNG")).decode()
    with pytest.raises(BadRequest) as e:
        image_from_base64(png, "application/pdf", LIMITS, "messages[0].content[0].source")
    assert e.value.param == "messages[0].content[0].source" and "application/pdf" in e.value.message
    assert image_from_base64(png, "IMAGE/PNG", LIMITS, "x").width == 5


# -- refusals of the image -------------------------------------------------------------------------------------

def test_too_many_pixels_is_refused_from_the_header_before_any_pixel_is_read() -> None:
    with pytest.raises(BadRequest) as e:
        decode_image(png_header(5000, 3000), LIMITS, P)
    assert e.value.param == P
    assert "5000x3000" in e.value.message and str(LIMITS.max_pixels) in e.value.message
    assert e.value.details == {"width": 5000, "height": 3000, "max_pixels": LIMITS.max_pixels}
    # The same bytes within a larger limit: now the pixels are read, and the bogus IDAT is what refuses them.
    roomy = ImageLimits(max_bytes=LIMITS.max_bytes, max_pixels=5000 * 3000, max_images=1)
    with pytest.raises(BadRequest) as e2:
        decode_image(png_header(5000, 3000), roomy, P)
    assert "not an image this server can read" in e2.value.message


def test_a_real_image_one_pixel_past_the_limit_is_refused() -> None:
    tight = ImageLimits(max_bytes=LIMITS.max_bytes, max_pixels=15, max_images=1)
    assert decode_image(encode(pattern(5, 3), "PNG"), tight, P).width == 5
    with pytest.raises(BadRequest) as e:
        decode_image(encode(pattern(4, 4), "PNG"), tight, P)
    assert "4x4 = 16 pixels" in e.value.message


@pytest.mark.parametrize("action", ["error", "ignore"])
def test_pillows_bomb_check_is_a_bad_request_whatever_the_warning_filter(action: str) -> None:
    # 10000 x 10000: past Image.MAX_IMAGE_PIXELS (a warning), under twice it; 20000 x 20000: past twice it (an error).
    big = ImageLimits(max_bytes=LIMITS.max_bytes, max_pixels=1 << 40, max_images=1)
    assert 10000 * 10000 > (Image.MAX_IMAGE_PIXELS or 0)
    with warnings.catch_warnings():
        warnings.simplefilter(action)  # type: ignore[arg-type]
        for side in (10000, 20000):
            with pytest.raises(BadRequest) as e:
                decode_image(png_header(side, side), LIMITS, P)
            assert e.value.param == P and "pixel" in e.value.message
        with pytest.raises(BadRequest) as e:
            decode_image(png_header(20000, 20000), big, P)  # our limit is loose: Pillow's ceiling still holds
        assert "decompression-bomb" in e.value.message


def test_a_truncated_png_is_a_bad_request() -> None:
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    png = encode(noise, "PNG")
    assert decode_image(png, LIMITS, P).rgb == noise.tobytes()
    with pytest.raises(BadRequest) as e:
        decode_image(png[: len(png) // 2], LIMITS, P)
    assert e.value.param == P and "not an image this server can read" in e.value.message


@pytest.mark.parametrize("data", [os.urandom(300), b"", b"GIF89a", b"\x89PNG\r\n\x1a\n" + b"\0" * 40,
                                  b"<svg xmlns='http://www.w3.org/2000/svg'/>"])
def test_bytes_that_are_no_image_are_a_bad_request(data: bytes) -> None:
    with pytest.raises(BadRequest) as e:
        decode_image(data, LIMITS, P)
    assert e.value.param == P and "not an image this server can read" in e.value.message


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "TGA"])
def test_formats_pillow_reads_but_this_server_does_not_are_refused(fmt: str) -> None:
    data = encode(pattern(), fmt)
    assert Image.open(io.BytesIO(data)).format is not None  # Pillow itself would read it
    with pytest.raises(BadRequest) as e:
        decode_image(data, LIMITS, P)
    assert "not a format it knows" in e.value.message


# -- the budget and the settings -------------------------------------------------------------------------------

def test_the_budget_counts_images_across_a_request() -> None:
    budget = LIMITS.budget()
    budget.take("messages[0].content[0]")
    budget.take("messages[1].content[2]")
    with pytest.raises(BadRequest) as e:
        budget.take("messages[2].content[0]")
    assert e.value.param == "messages[2].content[0]" and "more than 2 images" in e.value.message
    assert budget.count == 2
    with pytest.raises(BadRequest) as e:
        ImageBudget(0).take("images[0]")
    assert "takes no images" in e.value.message


def test_limits_of_the_settings() -> None:
    s = Settings(image_max_bytes=4096, image_max_pixels=100, images_per_request=3,
                 image_url_hosts=" cdn.example.com, 10.0.0.0/8 ,", remote_timeout_s=2.5)
    assert ImageLimits.of(s) == ImageLimits(4096, 100, 3, ("cdn.example.com", "10.0.0.0/8"), 2.5)
    assert ImageLimits.of(Settings()).url_hosts == ()


# -- URLs ------------------------------------------------------------------------------------------------------

def test_a_data_url_goes_through_image_from_url() -> None:
    assert image_from_url(data_url(encode(pattern(), "PNG")), LIMITS, P).rgb == pattern().tobytes()


@pytest.mark.parametrize("url", ["http://example.com/a.png", "https://127.0.0.1/a.png"])
def test_http_urls_are_refused_when_no_hosts_are_set(url: str) -> None:
    with pytest.raises(BadRequest) as e:
        image_from_url(url, LIMITS, P)
    assert e.value.param == P and "GGUF_IMAGE_URL_HOSTS" in e.value.message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "example.com/a.png", "/a.png"])
def test_other_schemes_are_refused(url: str) -> None:
    hosts = ImageLimits(LIMITS.max_bytes, LIMITS.max_pixels, 1, url_hosts=("example.com",))
    with pytest.raises(BadRequest) as e:
        image_from_url(url, hosts, P)
    assert e.value.param == P and "not a data: or http(s) URL" in e.value.message


@pytest.mark.parametrize("url", ["http://[v1.x]/a.png", "http://exa mple.com/", "http://example.com:99999/",
                                 "http://-bad-.example.com/", "http://1.2.3.999/a.png"])
def test_malformed_urls_are_bad_requests(url: str) -> None:
    hosts = ImageLimits(LIMITS.max_bytes, LIMITS.max_pixels, 1, url_hosts=("example.com", "0.0.0.0/0"))
    with pytest.raises(BadRequest) as e:
        image_from_url(url, hosts, P)
    assert e.value.param == P


def test_host_listing_names_exactly_and_addresses_by_network() -> None:
    hosts = ("cdn.example.com", "10.0.0.0/8", "192.0.2.7", "[2001:db8::1]")
    assert host_listed("CDN.example.com".lower(), hosts)
    assert not host_listed("img.cdn.example.com", hosts)
    assert not host_listed("example.com", hosts)
    assert host_listed("10.1.2.3", hosts) and not host_listed("11.1.2.3", hosts)
    assert host_listed("192.0.2.7", hosts) and not host_listed("192.0.2.8", hosts)
    assert host_listed("2001:db8::1", hosts) and host_listed("2001:db8:0::1", hosts)
    assert host_listed("::ffff:10.0.0.1", hosts)  # IPv4-mapped: judged as the IPv4 address it reaches
    assert not host_listed("8.8.8.8", hosts)  # public, but not named: still refused


class _Server:
    """A real HTTP server on an OS-assigned port of 127.0.0.1, recording every request path it is sent."""

    def __init__(self, png: bytes, big: bytes) -> None:
        self.paths: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.paths.append(self.path)
                if self.path == "/a.png":
                    self._send(200, png)
                elif self.path == "/big":
                    self._send(200, big)
                elif self.path == "/big-unsized":  # no Content-Length: the body is counted as it arrives
                    self.send_response(200)
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(big)
                    self.close_connection = True
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/a.png")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif self.path == "/slow":
                    time.sleep(1.5)
                    self._send(200, png)
                else:
                    self._send(404, b"no")

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    s = _Server(encode(pattern(), "PNG"), os.urandom(LIMITS.max_bytes + 1))
    yield s
    s.close()


LOCAL = ImageLimits(LIMITS.max_bytes, LIMITS.max_pixels, 2, url_hosts=("127.0.0.1",), timeout_s=5.0)


def test_a_listed_host_is_fetched_and_decoded(server: _Server) -> None:
    out = image_from_url(server.url("/a.png"), LOCAL, P)
    assert out.rgb == pattern().tobytes() and server.paths[-1] == "/a.png"
    by_network = ImageLimits(LIMITS.max_bytes, LIMITS.max_pixels, 1, url_hosts=("127.0.0.0/8",), timeout_s=5.0)
    assert image_from_url(server.url("/a.png"), by_network, P).digest == out.digest


@pytest.mark.parametrize("hosts", [("localhost",), ("10.0.0.0/8",), ("127.0.0.2",), ("example.com",)])
def test_a_host_not_listed_is_refused_before_any_request(server: _Server, hosts: tuple[str, ...]) -> None:
    before = len(server.paths)
    limits = ImageLimits(LIMITS.max_bytes, LIMITS.max_pixels, 1, url_hosts=hosts, timeout_s=5.0)
    with pytest.raises(BadRequest) as e:
        image_from_url(server.url("/a.png"), limits, P)
    assert e.value.param == P and "GGUF_IMAGE_URL_HOSTS" in e.value.message
    time.sleep(0.05)  # a request, had one been made, would have been recorded by now
    assert len(server.paths) == before


def test_a_404_is_a_bad_request_with_its_status(server: _Server) -> None:
    with pytest.raises(BadRequest) as e:
        image_from_url(server.url("/missing.png"), LOCAL, P)
    assert e.value.param == P and "HTTP 404" in e.value.message


@pytest.mark.parametrize("path", ["/big", "/big-unsized"])
def test_a_body_beyond_the_byte_limit_is_refused(server: _Server, path: str) -> None:
    with pytest.raises(PayloadTooLarge) as e:
        image_from_url(server.url(path), LOCAL, P)
    assert e.value.param == P
    assert ("Content-Length" in e.value.message) == (path == "/big")


def test_a_redirect_is_not_followed(server: _Server) -> None:
    before = len(server.paths)
    with pytest.raises(BadRequest) as e:
        image_from_url(server.url("/redirect"), LOCAL, P)
    assert e.value.param == P and "redirect" in e.value.message and "302" in e.value.message
    assert server.paths[before:] == ["/redirect"]


def test_a_server_slower_than_the_limit_is_a_bad_request(server: _Server) -> None:
    quick = ImageLimits(LIMITS.max_bytes, LIMITS.max_pixels, 1, url_hosts=("127.0.0.1",), timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(BadRequest) as e:
        image_from_url(server.url("/slow"), quick, P)
    assert time.monotonic() - t0 < 1.4
    assert e.value.param == P and "0.3 s" in e.value.message


def test_a_closed_port_is_a_bad_request() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(BadRequest) as e:
        image_from_url(f"http://127.0.0.1:{port}/a.png", LOCAL, P)
    assert e.value.param == P and "could not connect" in e.value.message
