"""Which model a request goes to: its ``model`` (a name or an alias), or the default or only loaded model."""

from __future__ import annotations

from ..catalog.models import Registry
from ..errors import BadRequest, NotReady
from ..settings import Settings
from .state import ModelState


def not_ready_state(models: dict[str, ModelState], last_failed: ModelState | None) -> tuple[str, str | None]:
    """Why nothing serves: ``loading``, ``failed`` (with the error) or ``no model``."""
    if any(s.state == "loading" for s in models.values()):
        return "loading", None
    if last_failed is not None and last_failed.state == "failed":
        return "failed", last_failed.error
    return "no model", None


def route(settings: Settings, registry: Registry, models: dict[str, ModelState], reloads: set[str],
          last_failed: ModelState | None, requested: str | None) -> str:
    """The model a request's ``model`` names: an alias's model, a name; None goes to the default model
    (``GGUF_DEFAULT_MODEL``, as docs/configuration.md says: loaded again if it was unloaded, unless it failed), and
    with no default to the only loaded model. A model that is reloading counts as loaded (its requests wait for the
    reload). Raises 404 for an unknown name."""
    if requested is None:
        loaded = [s.name for s in models.values() if s.serving or s.name in reloads]
        default = registry.canonical(settings.default_model) if settings.default_model else None
        if default is not None:
            st = models.get(default)
            if default in loaded or st is None or st.state != "failed":
                return default
        elif len(loaded) == 1:
            return loaded[0]
        elif loaded:
            raise BadRequest(f"model is required: {len(loaded)} models are loaded "
                             f"({', '.join(loaded)[:300]})", param="model")
        state, error = not_ready_state(models, last_failed)
        raise NotReady("the model is not loaded yet" if state in ("loading", "no model") else
                       f"the model is {state}", state=state)
    name = registry.canonical(requested)
    st = models.get(name)
    if st is not None and st.serving:
        return name
    return registry.resolve(requested).name  # 404 for an unknown name
