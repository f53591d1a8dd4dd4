"""``python -m service``: serve with uvicorn on the configured host and port."""

from __future__ import annotations

import logging
import sys

import uvicorn

from .api.app import create_app
from .settings import Settings


def main() -> int:
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
