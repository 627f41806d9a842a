"""`treeserve serve`: uvicorn over one runtime, on loopback unless told otherwise; the engines
in an engine-core process of their own unless `engine_process=False`.
"""

from __future__ import annotations

import signal
import socket

from treeserve.runtime.runtime import freeze_heap, thaw_heap
from treeserve.server.app import build_app
from treeserve.server.completions import Served
from treeserve.server.core_client import CoreClient
from treeserve.server.metrics import ServerMetrics
from treeserve.server.settings import ServerSettings, build_served
from treeserve.server.traces import TraceRing


def build_core_served(settings: ServerSettings) -> Served:
    settings.check()  # bad settings fail here, before a process is started
    reasoning = settings.reasoning()
    client = CoreClient(settings)
    metrics = ServerMetrics(lambda: client.last_stats)
    names = settings.names()
    served = Served(
        client,
        settings.name,
        metrics,
        prm_name=names.get("prm"),  # type: ignore[arg-type]
        verifier_name=names.get("verifier"),
        traces=TraceRing(settings.trace_ring),
        reasoning=reasoning,
    )
    client.on_restart = served.metrics.core_restarts.inc
    return served


def serve(settings: ServerSettings, sock: socket.socket | None = None) -> None:
    """Run until SIGINT/SIGTERM (open requests get `shutdown_timeout`); `sock` overrides host/port."""
    import uvicorn

    served = build_core_served(settings) if settings.engine_process else build_served(settings)
    app = build_app(served, settings.api_key)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it stopped on: a graceful SIGTERM is then exit status 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    freeze_heap()  # what is loaded now lives as long as the server: collections skip it
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        thaw_heap()
