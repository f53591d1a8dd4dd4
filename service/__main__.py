"""``python -m service``: serve with uvicorn on the configured host and port; ``python -m service worker``: serve
this machine's devices to a model planned over several machines (``service.rpc.worker``); ``python -m service
tunnel``: a worker's ports over mutual TLS across a network others reach (``service.rpc.tunnel``).

Refuses to start (exit 2, one clear line) with settings it must not serve with: a non-loopback
address without API keys, an unreadable key file, a malformed CORS origin, a malformed ``GGUF_RPC_WORKERS`` (or
workers without runner processes), KV events beyond loopback without CURVE or ``GGUF_KV_EVENTS_ALLOW_PUBLIC``, a
CURVE key file readable by others.

SIGTERM (or SIGINT) drains: the listening socket closes, requests that arrive on open connections
get 503, requests in flight run to their end for up to ``GGUF_DRAIN_TIMEOUT_S``; past it, queued
requests get 503 with Retry-After and running streams end with an error event and ``[DONE]``; the
model is released, and the process exits 0. A second signal exits at once (status 128 + signal).
"""

from __future__ import annotations

import logging
import os
import sys
from types import FrameType

import uvicorn

from .api.app import create_app
from .api.security import DRAIN_GRACE_S, ConfigurationError, DrainState, check_startup, load_api_keys
from .residency.kv_events import check_settings as check_kv_events
from .rpc.client import parse_workers
from .settings import Settings

log = logging.getLogger("service")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with a drain flag for the app and an immediate exit on the second signal."""

    def __init__(self, config: uvicorn.Config, drain: DrainState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            log.warning("second signal %d while draining: exiting now", sig)
            os._exit(128 + sig)
        log.info("signal %d: draining (up to %.0f s), new requests get 503", sig, self.drain_timeout_s)
        self.drain.begin(self.drain_timeout_s)
        # Not recorded in _captured_signals: uvicorn would re-raise it after the drain, and the
        # process would die of SIGTERM instead of exiting 0 once everything finished.
        self.should_exit = True


def main() -> int:
    if sys.argv[1:2] == ["worker"]:  # this machine's devices for a model planned over several (service.rpc.worker)
        from .rpc.worker import main as worker

        return worker(sys.argv[2:])
    if sys.argv[1:2] == ["tunnel"]:  # a worker's ports over mutual TLS (service.rpc.tunnel)
        from .rpc.tunnel import main as tunnel

        return tunnel(sys.argv[2:])
    try:
        settings = Settings()
        parse_workers(settings.rpc_workers, runner_process=settings.runner_process)
        check_kv_events(settings)
    except ValueError as exc:
        sys.stderr.write(f"gguf-server: invalid settings: {exc}\n")
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        check_startup(settings, load_api_keys(settings))
        app = create_app(settings)
    except ConfigurationError as exc:
        sys.stderr.write(f"gguf-server: {exc}\n")
        return 2
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
        # Past the drain timeout the app ends what still runs (DrainState); uvicorn waits a little longer for it.
        timeout_graceful_shutdown=settings.drain_timeout_s + DRAIN_GRACE_S,  # type: ignore[arg-type]  # a float works
    )
    server = DrainingServer(config, app.state.drain, settings.drain_timeout_s)
    server.run()  # uvicorn exits 1 itself when it cannot bind
    return 0


if __name__ == "__main__":
    sys.exit(main())
