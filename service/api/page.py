"""The page: ``GET /`` and its static assets, with security headers that allow them and nothing more.

The page is plain HTML, four scripts and one stylesheet shipped in ``service/static/`` (no build step): the plan
(``page.js``) draws what ``POST /api/dry-run`` answers; the Models view (``models.js``) lists, loads, unloads and
pulls; the Chat view (``chat.js``) streams from ``/v1/chat/completions``, its Markdown drawn as elements and text
nodes only; ``common.js`` is what they share. No inline script or style, so the Content-Security-Policy can be strict;
every asset is public (``service.api.security.PUBLIC_PATHS``), the API behind them is not.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(str(files("service") / "static"))

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)

# Served by name only (no directory walk), each with its media type stated, not guessed.
ASSETS: dict[str, str] = {
    "common.js": "text/javascript; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "models.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
}

router = APIRouter(include_in_schema=False)


def is_page_path(path: str) -> bool:
    return path == "/" or path.startswith("/static/")


class SecurityHeaders:
    """ASGI middleware: the page's headers on the page and its assets; other routes are untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_page_path(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in SECURITY_HEADERS}
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": headers + list(SECURITY_HEADERS)}
            await send(message)

        await self.app(scope, receive, send_with_headers)


@router.api_route("/", methods=["GET", "HEAD"])
async def index() -> FileResponse:
    """The page: the plan, the models, the chat."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})


def _asset_route(name: str, media_type: str) -> None:
    async def asset() -> FileResponse:
        return FileResponse(STATIC_DIR / name, media_type=media_type, headers={"Cache-Control": "no-cache"})

    # One route per file: any other name under /static/ is the router's ordinary 404.
    router.add_api_route(f"/static/{name}", asset, methods=["GET", "HEAD"], name=f"static:{name}")


for _name, _media_type in ASSETS.items():
    _asset_route(_name, _media_type)


def install(app: FastAPI) -> None:
    """Serve the page and its assets, with their security headers."""
    app.include_router(router)
    app.add_middleware(SecurityHeaders)
