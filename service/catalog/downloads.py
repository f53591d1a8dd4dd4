"""Models from Hugging Face: downloads into the models directory, and a repo's files planned before any download.

``huggingface_hub`` does the transfers (HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE honoured); a repo's files are
read by their headers alone (``sizing.probe.remote``) and planned on these devices beside the loaded models.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Sequence

from sizing.errors import ProbeError, SizingError, UnsupportedModelError
from sizing.memory import MemoryEstimate
from sizing.model import ModelSpec
from sizing.plan import Device, Plan, PlanRequest, plan_json
from sizing.probe import probe_projector
from sizing.units import MIB

from ..errors import BadRequest, ModelNotFound, ServiceError, Upstream
from ..options import LoadOptions
from ..settings import Settings
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


@dataclass
class Download:
    """A GGUF file being fetched from Hugging Face into the models directory."""

    repo_id: str
    filename: str
    revision: str | None
    state: Literal["downloading", "done", "failed"] = "downloading"
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str | None = None
    started: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        """The model name it is served under once downloaded."""
        return self.filename.rsplit("/", 1)[-1].removesuffix(".gguf")

    def to_json(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "filename": self.filename, "revision": self.revision, "name": self.name,
                "state": self.state, "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "progress": round(self.bytes_done / self.bytes_total, 4) if self.bytes_total else None,
                "error": self.error}


def _progress_class(dl: Download) -> type:
    """A tqdm class for huggingface_hub that records progress on ``dl`` and logs every 10%."""
    from tqdm.std import tqdm

    class Progress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            total = kwargs.get("total")
            if isinstance(total, (int, float)) and total:
                dl.bytes_total = int(total)
            dl.bytes_done = int(kwargs.get("initial") or 0)
            self._logged = -1

        def update(self, n: float | None = 1) -> bool | None:
            dl.bytes_done += int(n or 0)
            if dl.bytes_total:
                tenth = int(10 * dl.bytes_done / dl.bytes_total)
                if tenth != self._logged:
                    self._logged = tenth
                    log.info("downloading %s/%s: %d%% of %.1f MiB", dl.repo_id, dl.filename, 10 * tenth,
                             dl.bytes_total / MIB)
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
        the files already there. Progress shows in the log and in ``GET /api/models``.
        """
        if "/" in filename or "\\" in filename or not filename.endswith(".gguf") or filename.startswith("."):
            raise BadRequest("filename must be a .gguf file at the top of the repo", param="filename")
        key = f"{repo_id}/{filename}@{revision or 'main'}"
        running = self.downloads.get(key)
        if running is not None and running.state == "downloading":
            return running
        dl = Download(repo_id, filename, revision)
        self.downloads[key] = dl
        models_dir = self.settings.models_dir

        def fetch() -> None:
            from huggingface_hub import hf_hub_download

            try:
                os.makedirs(models_dir, exist_ok=True)
                path = hf_hub_download(repo_id, filename, revision=revision, local_dir=models_dir,
                                       endpoint=os.environ.get("HF_ENDPOINT") or None, tqdm_class=_progress_class(dl))
                if is_projector_file(filename):  # a vision projector: the models beside it find it (mmproj auto)
                    try:
                        probe_projector(str(path))
                    except (UnsupportedModelError, ProbeError) as exc:
                        raise BadRequest(str(exc)) from exc
                else:
                    self.registry.resolve(dl.name)  # the file is a GGUF the registry will serve
                dl.bytes_done = dl.bytes_total = os.path.getsize(str(path))
                dl.state = "done"
                log.info("downloaded %s/%s as %s '%s'", repo_id, filename,
                         "the vision projector" if is_projector_file(filename) else "model", dl.name)
            except ServiceError as exc:
                dl.state, dl.error = "failed", f"the downloaded file is not a servable GGUF: {exc.message}"
                try:  # leave nothing behind that looks like a model
                    os.remove(os.path.join(models_dir, filename))
                except OSError:
                    pass
            except Exception as exc:  # the hub's and the network's errors end here, reported in the status
                dl.state, dl.error = "failed", f"{type(exc).__name__}: {exc}"
                log.warning("download of %s/%s failed: %s", repo_id, filename, dl.error)

        threading.Thread(target=fetch, name=f"download-{filename}", daemon=True).start()
        return dl

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
