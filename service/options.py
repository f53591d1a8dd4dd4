"""A model's load options: one value, one name per knob, one merge.

``ModelOptions`` is every knob a load may set, by the one name it has everywhere: the settings (``GGUF_`` + the
name in upper case, ``service.settings``), a model's table in the models file, the bodies of ``/api/models/load``
and ``/api/dry-run``. The names are the settings' (the server-wide defaults), llama.cpp's where it has one:

=================  ==============================================  =====================================
knob               what it sets                                    also accepted (older, public names)
=================  ==============================================  =====================================
``n_ctx``          the context to load (default: the largest
                   that fits, up to ``context_length``)
``context_length`` the ceiling on ``n_ctx`` (default n_ctx_train)
``cache_type``     the KV cache type loaded (auto: the most
                   precise whose context reaches the ceiling)
``flash_attn``     on, off or auto                                 ``flash_attention`` (GGUF_FLASH_ATTENTION)
``parallel``       decode slots (llama.cpp's n_seq_max)            ``n_seq_max`` (bodies), ``slots`` (file)
``swa_full``       a full-size sliding-window cache
``kv_unified``     one KV cache shared by the slots
``gpu``            a device's position (a card's index), auto or all
``tensor_split``   layer proportions per device
``confirm``        confirm the plan with llama.cpp's dry run       ``confirm_loads`` (GGUF_CONFIRM_LOADS)
``batch_invariant`` outputs independent of the batch
``draft_model``    a draft model for speculative decoding
``draft_squeeze``  keep the draft where it costs context
``mmproj``         a vision projector (path, auto or none)
``mmproj_offload`` the projector on the model's card
=================  ==============================================  =====================================

``merged(settings, model, request)`` is the one merge: each knob the request's if set, else the model's
(models file), else the settings'. What a load or dry run plans with is that value (``service.planning.planner``). A new
load option is one field here (and in ``Settings`` when it has a server-wide default), the docs generated from
them.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Sequence

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from sizing.model import CACHE_TYPES
from sizing.plan import AUTO_CACHE_TYPE

from .errors import BadRequest


class ModelOptions(BaseModel):
    """The knobs of a load, None where not set (the next source's value then applies, ``merged``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    n_ctx: int | None = Field(None, ge=1, le=1 << 24, description="The context to load (default: the largest "
                              "that fits, up to context_length).")
    context_length: int | None = Field(None, ge=256, le=1 << 24, description="Ceiling on n_ctx (default: "
                                       "GGUF_CONTEXT_LENGTH, else the model's n_ctx_train).")
    cache_type: str | None = Field(None, max_length=16, description=f"{AUTO_CACHE_TYPE} (the most precise type whose "
                                   "context reaches the ceiling, sizing.plan.auto_cache) or one of "
                                   f"{', '.join(CACHE_TYPES)} (any case).")
    flash_attn: Literal["on", "off", "auto"] | None = Field(
        None, validation_alias=AliasChoices("flash_attn", "flash_attention"),
        description="Flash attention: on, off or auto (also accepted as flash_attention).")
    parallel: int | None = Field(None, ge=1, le=256, validation_alias=AliasChoices("parallel", "n_seq_max", "slots"),
                                 description="Decode slots, llama.cpp's n_seq_max (also accepted as n_seq_max, and "
                                 "as slots in the models file).")
    swa_full: bool | None = Field(None, description="Full-size sliding-window cache (llama.cpp swa_full).")
    kv_unified: bool | None = Field(None, description="One KV cache shared by the slots (llama.cpp kv_unified): "
                                    "any request may use the whole context; off: n_ctx / parallel cells each.")
    gpu: int | Literal["auto", "all"] | None = Field(
        None, description="A device by its position in the plan's devices (the workers' first, then the cards: a "
        "card's index where no worker is named), auto or all.")
    tensor_split: tuple[float, ...] | None = Field(None, max_length=64,
                                                   description="One proportion (>= 0) per device, in the order of the "
                                                   "plan's devices (the workers' first, then the cards).")
    confirm: bool | None = Field(None, validation_alias=AliasChoices("confirm", "confirm_loads"),
                                 description="Confirm the plan with llama.cpp's dry run before loading (default: "
                                 "GGUF_CONFIRM, on).")
    batch_invariant: bool | None = Field(None, description="Outputs independent of the batch (default: "
                                         "GGUF_BATCH_INVARIANT): loaded without repacked weights.")
    draft_model: str | None = Field(None, max_length=256, description="A draft model for speculative decoding, by "
                                    "its name here (default: GGUF_DRAFT_MODEL); \"\" for none.")
    draft_squeeze: bool | None = Field(None, description="Keep the draft model even where it costs the model "
                                       "context (default: GGUF_DRAFT_SQUEEZE).")
    mmproj: str | None = Field(None, max_length=4096, description="A vision projector (mmproj GGUF) for image "
                               "input: a path, auto (one beside the model: default GGUF_MMPROJ), or \"\" for none.")
    mmproj_offload: bool | None = Field(None, description="The projector on the model's card (default: "
                                        "GGUF_MMPROJ_OFFLOAD); off: host memory.")

    @field_validator("cache_type")
    @classmethod
    def _cache_type(cls, v: str | None) -> str | None:
        if v is not None and v.lower() not in CACHE_TYPES and v.lower() != AUTO_CACHE_TYPE:
            raise ValueError(f"unknown KV cache type {v!r}; {AUTO_CACHE_TYPE} or one of {', '.join(CACHE_TYPES)}")
        return v.lower() if v is not None else v

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and not 0 <= v < 64:
            raise ValueError("a card index is 0..63")
        return v

    @field_validator("tensor_split", mode="before")
    @classmethod
    def _split_list(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v  # a JSON or TOML array (strict bodies take no list for a tuple)

    @field_validator("tensor_split")
    @classmethod
    def _split(cls, v: Sequence[float] | None) -> tuple[float, ...] | None:
        if v is None:
            return v
        if not all(math.isfinite(x) and 0 <= x <= 1e6 for x in v):
            raise ValueError("proportions are finite numbers from 0 to 1e6")
        if not any(x > 0 for x in v):
            raise ValueError("at least one proportion must be above 0")
        return tuple(v)

    def options(self) -> "ModelOptions":
        """The knobs alone, of a body that carries more (a load's ``model``, ``force``...)."""
        return ModelOptions.model_validate({k: getattr(self, k) for k in ModelOptions.model_fields})


class LoadOptions(ModelOptions):
    """A load's or dry run's knobs, and the hypothetical cards a dry run may plan on instead of this machine's."""

    gpus: tuple[dict[str, Any], ...] | None = None
    """Hypothetical cards (dry-run only): [{name, free_mib, total_mib}]."""


def merged(settings: Any, model: ModelOptions | None = None, request: ModelOptions | None = None) -> LoadOptions:
    """Each knob from ``request`` if set, else ``model`` (its models-file table), else ``settings`` (a ``Settings``:
    the attribute of the same name, where the settings have one). ``gpus`` passes through from the request.
    ``BadRequest`` for a ``GGUF_TENSOR_SPLIT`` that is not a list of numbers."""
    values: dict[str, Any] = {}
    for name in ModelOptions.model_fields:
        for source in (request, model):
            v = getattr(source, name, None) if source is not None else None
            if v is not None:
                values[name] = v
                break
        else:
            values[name] = getattr(settings, name, None)
    split = values["tensor_split"]
    if isinstance(split, str):
        try:
            values["tensor_split"] = tuple(float(x) for x in split.split(",")) if split.strip() else None
        except ValueError as exc:
            raise BadRequest(f"GGUF_TENSOR_SPLIT is not a list of numbers: {split}") from exc
    values["gpus"] = getattr(request, "gpus", None)
    return LoadOptions.model_validate(values)


__all__ = ["LoadOptions", "ModelOptions", "merged"]
