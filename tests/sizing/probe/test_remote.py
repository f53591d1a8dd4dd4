"""Remote probes through a local HTTP server (127.0.0.1) with Range support: header bytes only."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from sizing.__main__ import main
from sizing.errors import ProbeError, RemoteError
from sizing.probe import probe_hf, probe_path, probe_url
from sizing.probe.remote import shard_urls
from tests.sizing.probe.conftest import RangeServer, link_into, write_model


def _same(a: object, b: object) -> None:
    from sizing.model.spec import ModelSpec

    assert isinstance(a, ModelSpec) and isinstance(b, ModelSpec)
    assert a.tensors == b.tensors
    assert a.layers == b.layers
    assert (a.n_vocab, a.n_layer, a.data_offset, a.file_size_bytes) == (b.n_vocab, b.n_layer, b.data_offset, b.file_size_bytes)
    assert dict(a.metadata) == dict(b.metadata)


def test_probe_url_equals_local(range_server: RangeServer, small_model: Path) -> None:
    link_into(range_server, small_model)
    spec = probe_url(range_server.url(small_model.name))
    _same(spec, probe_path(str(small_model)))
    assert spec.source.url == range_server.url(small_model.name)
    assert all(r.split(" ", 1)[1].startswith("bytes=") for r in range_server.requests)


def test_remote_transfers_little_more_than_the_header(range_server: RangeServer, big_vocab_model: Path) -> None:
    link_into(range_server, big_vocab_model)
    spec = probe_url(range_server.url(big_vocab_model.name))
    header = spec.data_offset
    assert header > 900_000  # the first window is a small part of it
    assert spec.file_size_bytes > 10 * header
    assert header <= range_server.bytes_sent < 1.1 * header
    assert len(range_server.requests) < 40
    _same(spec, probe_path(str(big_vocab_model)))


def test_remote_embedded_model(range_server: RangeServer, embedded_model: str) -> None:
    path = Path(embedded_model)
    link_into(range_server, path)
    spec = probe_url(range_server.url(path.name))
    assert spec.n_vocab == 262_144
    assert range_server.bytes_sent < 1.1 * spec.data_offset
    assert range_server.bytes_sent < spec.file_size_bytes / 30  # 6.5 MB of 253 MB
    _same(spec, probe_path(embedded_model))


def test_remote_split(range_server: RangeServer, tmp_path: Path) -> None:
    files = write_model(tmp_path / "m.gguf", n_layer=3, split_max_tensors=4)
    link_into(range_server, *files)
    spec = probe_url(range_server.url(files[2].name))
    assert spec.source.shards == tuple(range_server.url(f.name) for f in files)
    assert len(spec.tensors) == 1 + 3 * 3 + 2
    assert spec.file_size_bytes == sum(f.stat().st_size for f in files)
    assert {r.split(" ")[0] for r in range_server.requests} == {f.name for f in files}


def test_shard_urls_keep_the_query() -> None:
    assert shard_urls("https://h/a/m-00002-of-00002.gguf?download=1") == [
        "https://h/a/m-00001-of-00002.gguf?download=1", "https://h/a/m-00002-of-00002.gguf?download=1",
    ]


def test_http_404_is_a_remote_error(range_server: RangeServer) -> None:
    with pytest.raises(RemoteError) as ei:
        probe_url(range_server.url("nope.gguf"))
    assert ei.value.status == 404


def test_connection_refused_is_a_remote_error() -> None:
    with pytest.raises(RemoteError):
        probe_url("http://127.0.0.1:9/x.gguf", timeout_s=2)


def test_not_http() -> None:
    with pytest.raises(ProbeError):
        probe_url("ftp://127.0.0.1/x.gguf")


def test_server_ignoring_range_is_refused(range_server: RangeServer, big_vocab_model: Path) -> None:
    link_into(range_server, big_vocab_model)
    range_server.ignore_range = True
    with pytest.raises(RemoteError, match="ignores Range"):
        probe_url(range_server.url(big_vocab_model.name))


def test_small_file_without_range_support_is_read(range_server: RangeServer, tmp_path: Path) -> None:
    from sizing.testing.raw_gguf import minimal_llama

    f = tmp_path / "tiny.gguf"
    f.write_bytes(bytes(minimal_llama(2)))
    link_into(range_server, f)
    range_server.ignore_range = True
    assert probe_url(range_server.url("tiny.gguf")).n_layer == 2


def test_truncated_remote_file(range_server: RangeServer, big_vocab_model: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(big_vocab_model.read_bytes()[:500_000])
    link_into(range_server, cut)
    with pytest.raises(ProbeError) as ei:
        probe_url(range_server.url("cut.gguf"))
    assert ei.value.offset is not None and ei.value.offset < 500_000
    assert range_server.bytes_sent <= 500_000


def test_probe_hf_honours_endpoint_and_token(
    range_server: RangeServer, small_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link_into(range_server, small_model, under="acme/tiny/resolve/v1")
    monkeypatch.setenv("HF_ENDPOINT", range_server.base_url)
    spec = probe_hf("acme/tiny", small_model.name, revision="v1", token="hf_secret")
    _same(spec, probe_path(str(small_model)))
    assert spec.source.url == f"{range_server.base_url}/acme/tiny/resolve/v1/{small_model.name}"
    assert set(range_server.authorizations) == {"Bearer hf_secret"}, range_server.requests


def test_cli_probe_hf_and_url(
    range_server: RangeServer, small_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    link_into(range_server, small_model, under="acme/tiny/resolve/main")
    link_into(range_server, small_model)
    monkeypatch.setenv("HF_ENDPOINT", range_server.base_url)
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert main(["probe", f"hf://acme/tiny/{small_model.name}", "--json"]) == 0
    via_hf = json.loads(capsys.readouterr().out)
    assert main(["probe", range_server.url(small_model.name), "--json"]) == 0
    via_url = json.loads(capsys.readouterr().out)
    assert via_hf["n_tensors"] == via_url["n_tensors"] == 9
    assert via_hf["source"].endswith(f"/acme/tiny/resolve/main/{small_model.name}")
    assert "Bearer hf_env" in range_server.authorizations
    assert main(["probe", range_server.url("missing.gguf")]) == 2
    assert "404" in capsys.readouterr().err


def test_shared_client_is_used(range_server: RangeServer, small_model: Path) -> None:
    link_into(range_server, small_model)
    seen: list[str] = []
    with httpx.Client(event_hooks={"request": [lambda r: seen.append(r.headers["range"])]}) as c:
        probe_url(range_server.url(small_model.name), client=c)
    assert seen and all(s.startswith("bytes=") for s in seen)


# -- malformed URLs: the caller's InvalidURLError before any request (issue 28) ------------------------------

MALFORMED_URLS = [
    "http://xn--a.com/x.gguf",  # an A-label that is not punycode of anything valid
    "http://xn--zz-zzzz.com/x.gguf",  # invalid punycode
    "http://a..b/x.gguf",  # an empty label
    "http://.a.com/x.gguf",
    "http://" + "a" * 70 + ".com/x.gguf",  # a label over 63 characters
    "http://" + "a." * 130 + "com/x.gguf",  # a name over 253 characters
    "http://ex\u200bample.com/x.gguf",  # not valid IDNA
    "http://-a.com/x.gguf",
    "http://%41.com/x.gguf",
    "http://127.0.0.1:8109:80/x",  # two ports
    "http://[v1.x]/x",  # an IPvFuture literal
    "http://[::1/x",  # an unclosed bracket
    "http://[1.2.3.4]/x",  # brackets around IPv4
    "http://a.com:99999/x",  # a port out of range
    "http://a.com:0/x",
    "http://a.com:abc/x",  # a port that is not a number
    "http:///x",  # no host
    "http://:80/x",
    "http://user@/x",
    "http://999.1.1.1/x",  # a number last: an IPv4 address, and not a valid one
    "http://exa mple.com/x",  # whitespace
    "ftp://example.com/x.gguf",
]


@pytest.mark.parametrize("url", MALFORMED_URLS)
def test_malformed_urls_are_the_callers_error_before_any_request(url: str) -> None:
    from sizing.errors import InvalidURLError
    from sizing.probe.remote import ProbeLimits

    sent: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(500)

    client = httpx.Client(transport=httpx.MockTransport(record))
    for limits in (ProbeLimits(), ProbeLimits(public_only=True)):
        with pytest.raises(InvalidURLError) as ei:
            probe_url(url, client=client, limits=limits)
        assert not isinstance(ei.value, RemoteError), url  # the service answers 400, not 502
    with pytest.raises(InvalidURLError):
        probe_url(url)  # the guarded client of its own: refused before it is built
    assert sent == [], url


@pytest.mark.parametrize("url", [
    "http://example.com/x.gguf", "https://EXAMPLE.com./x.gguf", "http://b\u00fccher.de/x.gguf",
    "http://xn--bcher-kva.de/x.gguf", "http://a_b.example.com/x.gguf", "http://[2001:db8::1]:8080/x.gguf",
    "http://1.2.3.4:65535/x.gguf", "http://user:pw@example.com/x.gguf", "http://example.com:/x.gguf",
    "http://" + "a" * 63 + ".com/x?q=1#f",
])
def test_well_formed_urls_pass_the_check(url: str) -> None:
    from sizing.probe.remote import check_url

    check_url(url)


@pytest.mark.parametrize("location", ["hf://a--b/c/x.gguf", "hf://acme/" + "r" * 100 + "/x.gguf",
                                      "hf://acme/tiny/x.gguf@", "hf://acme/x.gguf", "hf://acme//x.gguf"])
def test_malformed_hf_locations_are_the_callers_error(location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from sizing.errors import InvalidURLError
    from sizing.probe.remote import probe_location

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: a request would be a RemoteError
    with pytest.raises(InvalidURLError):
        probe_location(location)


def test_a_malformed_hf_endpoint_is_refused_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    from sizing.errors import InvalidURLError

    monkeypatch.setenv("HF_ENDPOINT", "http://[v1.x]")
    with pytest.raises(InvalidURLError):
        probe_hf("acme/tiny", "x.gguf", token="")


@pytest.mark.parametrize("location", ["http://xn--a.example/x.gguf", "http://a..b/x.gguf", "http://[v1.x]/x.gguf",
                                      "http://[::1/x.gguf", "http://example.com:99999/x.gguf", "//a..b/x.gguf"])
def test_a_redirect_to_a_malformed_url_is_the_upstreams_error(location: str) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(302, headers={"Location": location})

    with pytest.raises(RemoteError) as ei:  # 502 in the service: the server's Location, not the caller's URL
        probe_url("http://example.com/x.gguf", client=httpx.Client(transport=httpx.MockTransport(answer)))
    assert location not in str(ei.value)  # what a server sent is never quoted
