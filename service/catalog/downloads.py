"""Models from Hugging Face: downloads into the models directory, and a repo's files planned before any download.

``huggingface_hub`` does the transfers (HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE honoured); a repo's files are
read by their headers alone (``sizing.probe.remote``) and planned on these devices beside the loaded models.
A download reports its bytes, rate and time left (``Download.to_json``: what ``POST /api/models/pull`` streams and
``GET /api/models`` lists) and can be cancelled, its partial file removed. ``GGUF_DEFAULT_MODEL`` may name a
Hugging Face GGUF (``hf.co/OWNER/REPO:QUANT``): ``Downloads.fetch_reference`` pulls it on the first start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, Sequence

from sizing.errors import ProbeError, SizingError, UnsupportedModelError
from sizing.memory import MemoryEstimate
from sizing.model import ModelSpec
from sizing.plan import Device, Plan, PlanRequest, plan_json
from sizing.probe import probe_projector
from sizing.units import MIB

from ..errors import BadRequest, ModelNotFound, NotFound, ServiceError, Upstream
from ..options import LoadOptions
from ..settings import EMBEDDED_MODEL_NAME, Settings
from .models import Registry
from .projectors import is_projector_file

log = logging.getLogger(__name__)


PROJECTOR_PREFERENCE = ("f16", "bf16", "f32", "q8_0")
"""Which of a repo's projectors a pull takes, by the type in its name: mmproj files are small beside their model and
their precision shows in the answers, so the most precise half-width one first (llama.cpp's converter's default)."""


def pick_projector(names: Sequence[str]) -> str | None:
    """The projector a pull of a model of this repo takes with it: the one ``*mmproj*.gguf``, or of several the
    first by ``PROJECTOR_PREFERENCE`` (then by name); None without one."""
    found = sorted(n for n in names if is_projector_file(n))
    if len(found) <= 1:
        return found[0] if found else None

    def rank(name: str) -> tuple[int, str]:
        low = name.lower()
        for i, kind in enumerate(PROJECTOR_PREFERENCE):
            if f"-{kind}." in low or f"_{kind}." in low or f"-{kind}-" in low:
                return i, name
        return len(PROJECTOR_PREFERENCE), name

    return min(found, key=rank)


def remote_limits(settings: Settings) -> Any:
    """What a remote probe for a client may do (``sizing.probe.remote.ProbeLimits``): public addresses only,
    unless ``remote_allow_hosts`` names them; one deadline and byte budget."""
    from sizing.probe import ProbeLimits, parse_allow_hosts

    return ProbeLimits(deadline_s=settings.remote_timeout_s, max_bytes=settings.remote_max_bytes, public_only=True,
                       allow_hosts=parse_allow_hosts(settings.remote_allow_hosts))


REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$"
"""A Hugging Face repo id, ``OWNER/REPO``."""
FILENAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$"
"""A GGUF at the top of a repo: what may become a file name in the models directory."""
REVISION_PATTERN = r"^[A-Za-z0-9._/-]+$"
QUANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A quantization in ``hf.co/OWNER/REPO:QUANT`` (``Q4_K_M``, ``IQ2_XXS``, ``bf16``)."""


@dataclass(frozen=True)
class HfReference:
    """A Hugging Face GGUF named as Ollama and llama-server's ``-hf`` name one: ``hf.co/OWNER/REPO:QUANT`` (the one
    model file of the repo whose name holds QUANT, found by listing the repo) or ``hf.co/OWNER/REPO/FILE.gguf``;
    ``@REVISION`` optional."""

    repo_id: str
    filename: str | None
    quant: str | None
    revision: str | None


def parse_hf_reference(text: str, param: str = "model") -> HfReference:
    """``hf.co/OWNER/REPO:QUANT`` or ``hf.co/OWNER/REPO/FILE.gguf`` (``huggingface.co/`` and ``https://`` too,
    ``@REVISION`` optional) into its parts, each checked against the characters a Hugging Face name has; anything
    else is a 400 naming ``param``."""
    bad = BadRequest(f"{param}: a Hugging Face GGUF, hf.co/OWNER/REPO:QUANT or hf.co/OWNER/REPO/FILE.gguf", param=param)
    rest = text.strip().removeprefix("https://").removeprefix("http://")
    if not rest.startswith(("hf.co/", "huggingface.co/")):
        raise bad
    rest, _, revision = rest.split("/", 1)[1].partition("@")
    parts = rest.split("/")
    filename = quant = None
    if len(parts) == 3:
        repo_id, filename = f"{parts[0]}/{parts[1]}", parts[2]
        ok = re.fullmatch(FILENAME_PATTERN, filename) is not None
    elif len(parts) == 2 and ":" in parts[1]:
        repo, _, quant = parts[1].partition(":")
        repo_id = f"{parts[0]}/{repo}"
        ok = re.fullmatch(QUANT_PATTERN, quant) is not None
    else:
        raise bad
    if not ok or not re.fullmatch(REPO_ID_PATTERN, repo_id) or (revision and not re.fullmatch(REVISION_PATTERN, revision)):
        raise bad
    return HfReference(repo_id, filename, quant, revision or None)


RATE_WINDOW_S = 20.0
"""A download's rate is measured over its last 20 s (huggingface_hub reports every 10 MiB: ``DOWNLOAD_CHUNK_SIZE``),
so that a stall shows as a falling rate and a growing time left, not as the average since it started."""
LOG_EVERY_S = 30.0
"""A download's log line comes every 10% and at least this often, so that a slow pull never looks like a hang."""


class PullCancelled(Exception):
    """Raised inside huggingface_hub's transfer loop (from the progress bar's ``update``) when a download is cancelled:
    it unwinds the transfer, and huggingface_hub removes its partial file."""


@dataclass
class Download:
    """A GGUF file being fetched from Hugging Face into the models directory."""

    repo_id: str
    filename: str
    revision: str | None
    state: Literal["downloading", "done", "failed", "cancelled"] = "downloading"
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str | None = None
    started: float = field(default_factory=time.time)
    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256), repr=False)
    """(monotonic seconds, bytes done) at each report of the transfer: the rate's window."""
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def id(self) -> str:
        """The download's key: one download of a file at a revision runs at a time."""
        return download_id(self.repo_id, self.filename, self.revision)

    @property
    def name(self) -> str:
        """The model name it is served under once downloaded."""
        return self.filename.rsplit("/", 1)[-1].removesuffix(".gguf")

    def restart(self, initial_bytes: int, total_bytes: int | None) -> None:
        """A transfer (re)starts at ``initial_bytes`` (a resumed file's)."""
        if total_bytes:
            self.bytes_total = total_bytes
        self.bytes_done = initial_bytes
        self.samples.clear()
        self.samples.append((time.monotonic(), initial_bytes))

    def advance(self, n_bytes: int) -> None:
        self.bytes_done += n_bytes
        self.samples.append((time.monotonic(), self.bytes_done))

    def rate_bytes_per_s(self, now: float | None = None) -> float | None:
        """Bytes a second over the last ``RATE_WINDOW_S`` (from the oldest report in it, or the one before the newest,
        to now); None before two reports."""
        samples = tuple(self.samples)
        if self.state != "downloading" or len(samples) < 2:
            return None
        now = time.monotonic() if now is None else now
        inside = [s for s in samples if now - s[0] <= RATE_WINDOW_S]
        t0, b0 = inside[0] if len(inside) >= 2 else samples[-2]
        return (samples[-1][1] - b0) / (now - t0) if now > t0 else None

    def eta_s(self, rate: float | None) -> float | None:
        if not rate or not self.bytes_total or self.state != "downloading":
            return None
        return max(0.0, self.bytes_total - self.bytes_done) / rate

    def to_json(self) -> dict[str, Any]:
        rate = self.rate_bytes_per_s()
        eta = self.eta_s(rate)
        return {"id": self.id, "repo_id": self.repo_id, "filename": self.filename, "revision": self.revision,
                "name": self.name, "state": self.state, "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "progress": round(self.bytes_done / self.bytes_total, 4) if self.bytes_total else None,
                "rate_bytes_per_s": round(rate) if rate is not None else None,
                "eta_s": round(eta, 1) if eta is not None else None,
                "elapsed_s": round(time.time() - self.started, 1), "error": self.error}


def download_id(repo_id: str, filename: str, revision: str | None) -> str:
    return f"{repo_id}/{filename}@{revision or 'main'}"


def _progress_class(dl: Download) -> type:
    """A tqdm class for huggingface_hub that records progress on ``dl``, logs every 10% (and every ``LOG_EVERY_S``)
    and stops the transfer once ``dl`` is cancelled.

    huggingface_hub makes one bar for a plain HTTP transfer (``file_download.http_get``) and two for a Xet one
    (``file_download.xet_get``: the bytes received, ``...: downloading bytes``, and the bytes written,
    ``...: reconstructing file``): only the first of those counts, or every byte would be counted twice."""
    from tqdm.std import tqdm

    class Progress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._counts = not str(kwargs.get("desc") or "").endswith("reconstructing file")
            total = kwargs.get("total")
            if self._counts:
                dl.restart(int(kwargs.get("initial") or 0), int(total) if isinstance(total, (int, float)) else None)
            self._logged = (-1, time.monotonic())

        def update(self, n: float | None = 1) -> bool | None:
            if dl.cancelled.is_set():
                raise PullCancelled(dl.id)
            if not self._counts:
                return None
            dl.advance(int(n or 0))
            tenth, now = int(10 * dl.bytes_done / dl.bytes_total) if dl.bytes_total else 0, time.monotonic()
            if tenth != self._logged[0] or now - self._logged[1] >= LOG_EVERY_S:
                self._logged = (tenth, now)
                rate = dl.rate_bytes_per_s(now)
                eta = dl.eta_s(rate)
                log.info("downloading %s/%s: %.1f of %s MiB%s%s", dl.repo_id, dl.filename, dl.bytes_done / MIB,
                         f"{dl.bytes_total / MIB:.1f}" if dl.bytes_total else "?",
                         f", {rate / MIB:.1f} MiB/s" if rate else "", f", {eta:.0f} s left" if eta is not None else "")
            return None

    return Progress


class FilePlanner(Protocol):
    """The planner's calls a listing makes (``service.planning.Planner``): this host's devices and a plan on them."""

    def devices(self, opts: LoadOptions, kept: Sequence[MemoryEstimate] = ...) -> tuple[list[Device], Device]: ...

    def request(self, opts: LoadOptions) -> PlanRequest: ...

    def plan_on(self, spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest) -> Plan: ...


class Downloads:
    """The downloads this server started, and Hugging Face listings planned beside the loaded models."""

    def __init__(self, settings: Settings, registry: Registry, planner: FilePlanner,
                 kept: Callable[[], Sequence[MemoryEstimate]] = lambda: ()) -> None:
        self.settings = settings
        self.registry = registry
        self.planner = planner
        self._kept = kept
        self.downloads: dict[str, Download] = {}

    def pull(self, repo_id: str, filename: str, revision: str | None = None) -> Download:
        """Start fetching a GGUF from Hugging Face into the models directory (a background thread): a model, or a
        vision projector (``*mmproj*.gguf``), which the models beside it then load with
        (``service.catalog.projectors``).

        ``huggingface_hub`` honours HF_ENDPOINT, HF_TOKEN and, with HF_HUB_OFFLINE=1, answers from
        the files already there. Progress shows in the log, in ``GET /api/models`` and in ``POST /api/models/pull``'s
        stream; ``cancel`` stops it.
        """
        if "/" in filename or "\\" in filename or not filename.endswith(".gguf") or filename.startswith("."):
            raise BadRequest("filename must be a .gguf file at the top of the repo", param="filename")
        key = download_id(repo_id, filename, revision)
        running = self.downloads.get(key)
        if running is not None and running.state == "downloading":
            return running
        dl = Download(repo_id, filename, revision)
        self.downloads[key] = dl
        threading.Thread(target=self._fetch, args=(dl,), name=f"download-{filename}", daemon=True).start()
        return dl

    def _fetch(self, dl: Download) -> None:
        """The download thread: the transfer, then the file checked (a GGUF the registry serves, or a projector);
        a failed, unservable or cancelled file leaves nothing behind in the models directory."""
        from huggingface_hub import hf_hub_download

        models_dir = self.settings.models_dir
        try:
            os.makedirs(models_dir, exist_ok=True)
            path = hf_hub_download(dl.repo_id, dl.filename, revision=dl.revision, local_dir=models_dir,
                                   endpoint=os.environ.get("HF_ENDPOINT") or None, tqdm_class=_progress_class(dl))
            if dl.cancelled.is_set():  # it ended between the cancel and the transfer's next report
                raise PullCancelled(dl.id)
            if is_projector_file(dl.filename):  # a vision projector: the models beside it find it (mmproj auto)
                try:
                    probe_projector(str(path))
                except (UnsupportedModelError, ProbeError) as exc:
                    raise BadRequest(str(exc)) from exc
            else:
                self.registry.resolve(dl.name)  # the file is a GGUF the registry will serve
            dl.bytes_done = dl.bytes_total = os.path.getsize(str(path))
            dl.state = "done"
            log.info("downloaded %s/%s as %s '%s'", dl.repo_id, dl.filename,
                     "the vision projector" if is_projector_file(dl.filename) else "model", dl.name)
        except PullCancelled:
            dl.state, dl.error = "cancelled", "cancelled"
            self._remove(dl.filename)
            log.info("download of %s/%s cancelled at %.1f MiB; its partial file removed", dl.repo_id, dl.filename,
                     dl.bytes_done / MIB)
        except ServiceError as exc:
            dl.state, dl.error = "failed", f"the downloaded file is not a servable GGUF: {exc.message}"
            self._remove(dl.filename)  # leave nothing behind that looks like a model
        except Exception as exc:  # the hub's and the network's errors end here, reported in the status
            dl.state, dl.error = "failed", f"{type(exc).__name__}: {exc}"
            log.warning("download of %s/%s failed: %s", dl.repo_id, dl.filename, dl.error)

    def _remove(self, filename: str) -> None:
        """The file and huggingface_hub's notes on it in the models directory (``_local_folder``: its metadata and
        lock under ``.cache/huggingface/download/``); its partial ``*.incomplete`` file huggingface_hub removes
        itself (``file_download._download_to_tmp_and_move``)."""
        notes = Path(self.settings.models_dir) / ".cache" / "huggingface" / "download"
        for path in (Path(self.settings.models_dir) / filename, notes / f"{filename}.metadata",
                     notes / f"{filename}.lock"):
            try:
                path.unlink()
            except OSError:
                pass

    def cancel(self, repo_id: str, filename: str, revision: str | None = None) -> Download:
        """Stop a running download: it reads ``cancelled`` at once; its thread stops at the transfer's next report
        and removes the partial file. 404 when no download of that file runs."""
        dl = self.downloads.get(download_id(repo_id, filename, revision))
        if dl is None or dl.state != "downloading":
            raise NotFound(f"no download of {repo_id}/{filename} is running", param="filename")
        dl.cancelled.set()
        dl.state, dl.error = "cancelled", "cancelled"
        return dl

    def resolve_reference(self, ref: HfReference) -> tuple[str, str | None]:
        """The file a reference names, and the projector a ``:QUANT`` reference takes with it (``find_quant``).
        Blocking (network for ``:QUANT``): call from a thread."""
        if ref.filename is not None:
            return ref.filename, None
        assert ref.quant is not None
        return self.find_quant(ref.repo_id, ref.quant, ref.revision)

    # -- GGUF_DEFAULT_MODEL=hf.co/...

    def _references_path(self) -> Path:
        return Path(self.settings.models_dir) / ".cache" / "gguf-fit-server" / "hf-references.json"

    def _recorded(self, reference: str) -> str | None:
        try:
            value = json.loads(self._references_path().read_text()).get(reference)
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and re.fullmatch(FILENAME_PATTERN, value) else None

    def _record(self, reference: str, filename: str) -> None:
        """Which file a reference named when it was pulled: offline, a ``:QUANT`` reference (whose file only a listing
        of the repo names) is served from it."""
        path = self._references_path()
        try:
            known = json.loads(path.read_text()) if path.exists() else {}
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known[reference] = filename
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, path)

    async def fetch_reference(self, reference: str, poll_s: float = 0.5) -> str:
        """``GGUF_DEFAULT_MODEL=hf.co/...``: the model's name once its file is in the models directory, pulled now
        if it is not (with its projector, progress in the log), and the reference made its alias in the registry.
        Without the hub (offline, or it fails) and without the file, the reference becomes the embedded model's alias
        instead and an error names the setting and that fallback; a reference that is malformed or names nothing on
        the hub is an error too, with the same fallback. Cancelled (the server stops), it cancels its download."""
        try:
            ref = parse_hf_reference(reference, param="GGUF_DEFAULT_MODEL")
            name = await self._fetch_reference(reference, ref, poll_s)
        except ServiceError as exc:
            log.error("GGUF_DEFAULT_MODEL=%s cannot be served: %s. Serving the embedded %s instead (the fallback): "
                      "set GGUF_DEFAULT_MODEL=%s, or start once with network to pull it", reference, exc.message,
                      EMBEDDED_MODEL_NAME, EMBEDDED_MODEL_NAME)
            self.registry.set_reference(reference, EMBEDDED_MODEL_NAME)
            return EMBEDDED_MODEL_NAME
        self.registry.set_reference(reference, name)
        return name

    async def _fetch_reference(self, reference: str, ref: HfReference, poll_s: float) -> str:
        known = ref.filename or self._recorded(reference)
        if known is not None and (Path(self.settings.models_dir) / known).is_file():
            log.info("GGUF_DEFAULT_MODEL=%s: %s is in %s already", reference, known, self.settings.models_dir)
            return self.registry.resolve(known.removesuffix(".gguf")).name
        projector = None
        if known is None:
            filename, projector = await asyncio.to_thread(self.resolve_reference, ref)
        else:
            filename = known
        log.info("GGUF_DEFAULT_MODEL=%s: pulling %s/%s%s into %s", reference, ref.repo_id, filename,
                 f" and its projector {projector}" if projector else "", self.settings.models_dir)
        for name in [filename, *([projector] if projector else [])]:
            dl = self.pull(ref.repo_id, name, ref.revision)
            try:
                while dl.state == "downloading":
                    await asyncio.sleep(poll_s)
            except asyncio.CancelledError:
                dl.cancelled.set()
                raise
            if dl.state != "done":
                raise Upstream(f"the pull of {ref.repo_id}/{name} {dl.state}: {dl.error}")
        self._record(reference, filename)
        return self.registry.resolve(filename.removesuffix(".gguf")).name

    def find_quant(self, repo_id: str, quant: str, revision: str | None = None) -> tuple[str, str | None]:
        """The one GGUF model at the top of the repo whose name holds ``quant`` (``Q4_K_M``, any case): Ollama's
        ``hf.co/OWNER/REPO:QUANT`` names a file so; and the repo's vision projector, if it has one
        (``pick_projector``), which Ollama pulls with a vision model. Blocking (network): call from a thread. None
        matches: 404; several (or a split model's shards): 400 naming them."""
        names = self._repo_files(repo_id, revision)
        found = [n for n in names if "/" not in n and n.endswith(".gguf") and quant.lower() in n.lower()
                 and not is_projector_file(n)]
        if not found:
            raise ModelNotFound(f"no GGUF file of '{repo_id}' is named with {quant!r}", param="model")
        if len(found) > 1:
            raise BadRequest(f"several GGUF files of '{repo_id}' are named with {quant!r} ({', '.join(found[:8])}); "
                             "name the file: hf.co/OWNER/REPO/FILE.gguf", param="model")
        return found[0], pick_projector([n for n in names if "/" not in n])

    def _repo_files(self, repo_id: str, revision: str | None) -> list[str]:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

        try:
            names = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None).list_repo_files(repo_id, revision=revision)
        except RepositoryNotFoundError as exc:
            raise ModelNotFound(f"no Hugging Face repo '{repo_id}'", param="model") from exc
        except (OfflineModeIsEnabled, HfHubHTTPError, OSError) as exc:
            raise Upstream(f"the Hugging Face hub did not answer for '{repo_id}': {exc}") from exc
        except Exception as exc:  # the hub client's transport errors are not ours: converted here
            raise Upstream(f"the Hugging Face hub could not be reached for '{repo_id}': {type(exc).__name__}") from exc
        return list(names)

    def hf_files(self, repo_id: str, revision: str | None = None) -> dict[str, Any]:
        """Each GGUF of a Hugging Face repo: its size and what it would get on these devices, before any download;
        its vision projectors (``*mmproj*.gguf``) apart, with their sizes (a model pulled with one beside it takes
        images: ``service.catalog.projectors``).

        Blocking (network): call from a thread. Headers only (``sizing.probe.remote.probe_hf``:
        range requests); a split model is probed and planned once, from its first shard.
        """
        import re as _re

        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

        from sizing.errors import RemoteError
        from sizing.probe import probe_hf

        try:
            info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        except RepositoryNotFoundError as exc:
            raise ModelNotFound(f"no Hugging Face repo '{repo_id}'", param="repo_id") from exc
        except (OfflineModeIsEnabled, HfHubHTTPError, OSError) as exc:
            raise Upstream(f"the Hugging Face hub did not answer for '{repo_id}': {exc}") from exc
        except Exception as exc:  # huggingface_hub's transport errors (httpx2) are not ours: convert them here
            raise Upstream(f"the Hugging Face hub could not be reached for '{repo_id}': {type(exc).__name__}: {exc}") from exc
        groups: dict[str, list[tuple[str, int]]] = {}
        projectors = []
        for sib in info.siblings or []:
            if not sib.rfilename.endswith(".gguf"):
                continue
            if is_projector_file(sib.rfilename.rsplit("/", 1)[-1]):  # a vision projector: not a model to plan
                projectors.append({"file": sib.rfilename, "size_bytes": int(sib.size or 0)})
                continue
            key = _re.sub(r"-\d{5}-of-\d{5}\.gguf$", ".gguf", sib.rfilename)
            groups.setdefault(key, []).append((sib.rfilename, int(sib.size or 0)))
        gpus, host = self.planner.devices(LoadOptions(), self._kept())
        req = self.planner.request(LoadOptions())
        files = []
        for key, parts in sorted(groups.items()):
            parts.sort()
            entry: dict[str, Any] = {"file": parts[0][0], "shards": len(parts), "size_bytes": sum(n for _, n in parts)}
            try:
                spec = probe_hf(repo_id, parts[0][0], revision, limits=remote_limits(self.settings))
                entry["plan"] = plan_json(self.planner.plan_on(spec, gpus, host, req))
            except (RemoteError, ProbeError, UnsupportedModelError, SizingError) as exc:
                entry["error"] = str(exc)
            files.append(entry)
        return {"repo_id": repo_id, "revision": revision, "files": files,
                "projectors": sorted(projectors, key=lambda p: str(p["file"]))}
