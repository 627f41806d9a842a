"""`treeserve serve`: load the generator (and optionally a PRM) into one runtime and run uvicorn.

Binds to loopback unless told otherwise. By default the engines run in an engine-core
process of their own (`core.py`, supervised by `core_client.py`) and this process serves
HTTP; with `engine_process=False` one event loop serves HTTP and drives the engines.
"""

from __future__ import annotations

import gc
import signal
import socket

from treeserve.runtime.runtime import freeze_heap
from treeserve.server.app import build_app
from treeserve.server.completions import Served
from treeserve.server.core_client import CoreClient
from treeserve.server.metrics import ServerMetrics
from treeserve.server.settings import ServerSettings, build_served
from treeserve.server.traces import TraceRing


def build_core_served(settings: ServerSettings) -> Served:
    """The API process's side: the models load in the engine-core process when the app starts."""
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
    """Run until interrupted (SIGINT/SIGTERM: stop accepting, give open requests
    `shutdown_timeout` seconds, abort the rest, stop the core). `sock` (already bound)
    overrides host and port, as tests do."""
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
    # uvicorn re-raises the signal it stopped on once it is done; a SIGTERM handled gracefully
    # is then a normal exit (status 0), as process managers expect
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    freeze_heap()  # what is loaded now lives as long as the server: collections skip it
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        gc.unfreeze()
