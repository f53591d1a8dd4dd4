"""Where a named model would go: the registry's file probed, its options merged over the models file's, and planned
beside the residents (``Planner.place``); several models together (``Planner.plan_set``); a model that is not here,
read by its header. Blocking (probes, llama.cpp's dry runs where a plan is calibrated): the manager calls these off
the event loop, with the residents' holdings as they were when the request came.
"""

from __future__ import annotations

from typing import Sequence

from sizing.errors import ProbeError, UnsupportedModelError, without_credentials
from sizing.memory import DraftModel
from sizing.model import ModelSpec
from sizing.plan import Holding
from sizing.probe import probe_path

from ..catalog.downloads import remote_limits
from ..catalog.models import ModelEntry, Registry
from ..errors import BadRequest, ModelNotFound, Upstream
from ..options import LoadOptions, merged
from ..planning.planner import Placed, Planner, SetPlan
from ..settings import Settings


class Placing:
    """Plans for the models of the registry (and for files elsewhere), for the manager that owns it."""

    def __init__(self, settings: Settings, registry: Registry, planner: Planner, max_models: int | None) -> None:
        self.settings = settings
        self.registry = registry
        self.planner = planner
        self.max_models = max_models

    def probe(self, entry: ModelEntry) -> ModelSpec:
        try:
            return probe_path(entry.path)
        except (ProbeError, UnsupportedModelError) as exc:
            raise BadRequest(f"model '{entry.name}' cannot be read: {exc}", param="model") from exc

    def draft_model(self, name: str) -> DraftModel:
        """The draft model a load names: a model of the registry (its name or alias), probed."""
        try:
            entry = self.registry.resolve(name)
        except ModelNotFound as exc:
            raise BadRequest(f"draft model '{name}' is not a model here: {exc}", param="draft_model") from exc
        try:
            spec = probe_path(entry.path)
        except (ProbeError, UnsupportedModelError) as exc:
            raise BadRequest(f"draft model '{entry.name}' cannot be read: {exc}", param="draft_model") from exc
        return DraftModel(spec, path=entry.path, name=entry.name)

    def options_for(self, entry: ModelEntry, opts: LoadOptions) -> LoadOptions:
        """A request's options over the model's own (models file) over the settings'."""
        return merged(None, entry.config.options, opts)  # the settings' come in where the plan is made

    def place(self, name: str, opts: LoadOptions, holdings: Sequence[Holding], force: bool
              ) -> tuple[ModelEntry, Placed]:
        """Where a load of ``name`` would go beside ``holdings``, and whom it would evict (``Planner.place``)."""
        entry = self.registry.resolve(name)
        spec = self.probe(entry)
        replacing = entry.name if any(h.name == entry.name for h in holdings) else None
        placed = self.planner.place(spec, self.options_for(entry, opts), path=entry.path, residents=holdings,
                                    replacing=replacing, max_models=self.max_models, force=force)
        return entry, placed

    def place_remote(self, location: str, opts: LoadOptions, holdings: Sequence[Holding]) -> Placed:
        """Where a model that is not here would go (an http(s) URL or ``hf://owner/repo/file.gguf``)."""
        from sizing.errors import RemoteError
        from sizing.probe import probe_location

        try:
            spec = probe_location(location, remote_limits(self.settings))
        except RemoteError as exc:
            raise Upstream(f"{without_credentials(location)[:300]}: {exc.reason}") from exc
        except (ProbeError, UnsupportedModelError) as exc:
            why = exc.reason if isinstance(exc, ProbeError) else str(exc)  # its source is the location again
            raise BadRequest(f"{without_credentials(location)[:300]} cannot be read: {why}", param="url") from exc
        return self.planner.place(spec, opts, residents=holdings, max_models=self.max_models)

    def place_set(self, items: Sequence[tuple[str, LoadOptions]], opts: LoadOptions, holdings: Sequence[Holding],
                  beside_residents: bool) -> SetPlan:
        """Whether these models fit together: without the residents, or beside them all (``beside_residents``)."""
        resolved = []
        for name, o in items:
            entry = self.registry.resolve(name)
            resolved.append((entry.name, self.probe(entry), self.options_for(entry, o), entry.path))
        names = [r[0] for r in resolved]
        if len(set(names)) != len(names):
            raise BadRequest("a set dry-run names each model once", param="models")
        kept, freed = (holdings, []) if beside_residents else ([], holdings)
        return self.planner.plan_set(resolved, opts, kept=kept, freed=freed)
