"""Residency: the models loaded at once, each with its own engine (a runner process), plan and queue; loads and
unloads, eviction decided before anything is unloaded, routing, fair admission while a model is swapped in,
keep-alive, and the views ``/api/models`` and the metrics show.

    manager.py   ModelManager: load, unload, restore, route, acquire (its parts below)
    state.py     ModelState, Lease
    engines.py   the engine a loaded model gets (``default_engine``)
    swaps.py     the queues of requests waiting for a model, and the scheduler that loads them
    timers.py    keep_alive timers
    refusals.py  a load that cannot go ahead, as its domain error (the plan as a summary)
    views.py     what /api/models and the metrics show
"""

from __future__ import annotations

from .engines import EngineFactory, default_engine
from .manager import ModelManager
from .refusals import PLAN_URL, plan_summary, raise_refusal
from .state import Lease, ModelState, State
from .views import admission, allocation_rows, describe, devices_json

__all__ = ["PLAN_URL", "EngineFactory", "Lease", "ModelManager", "ModelState", "State", "admission", "allocation_rows",
           "default_engine", "describe", "devices_json", "plan_summary", "raise_refusal"]
