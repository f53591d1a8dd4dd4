"""Dependencies as Annotated aliases: the app's state, read per request, typed."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..catalog.downloads import Downloads
from ..residency import ModelManager
from .metrics import Metrics


def get_manager(request: Request) -> ModelManager:
    manager: ModelManager = request.app.state.manager
    return manager


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def get_downloads(request: Request) -> Downloads:
    downloads: Downloads = request.app.state.manager.downloads
    return downloads


ManagerDep = Annotated[ModelManager, Depends(get_manager)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
DownloadsDep = Annotated[Downloads, Depends(get_downloads)]
