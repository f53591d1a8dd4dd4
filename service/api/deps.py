"""Dependencies as Annotated aliases: the app's state, read per request."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ..manager import ModelManager
from ..settings import Settings


def get_manager(request: Request) -> ModelManager:
    manager: ModelManager = request.app.state.manager
    return manager


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


ManagerDep = Annotated[ModelManager, Depends(get_manager)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
