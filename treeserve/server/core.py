"""The engine-core process: the runtime, `/v1/search` programs and `/v1/prm/score` scoring,
driven over ZeroMQ by the API process (`core_client.py`; messages in `wire.py`). A generation is
one `runtime.open_stream` whose sink sends each delta as the driver reads it back; messages are
flushed together, one ZeroMQ message per flush. Exits when told to, or when the API is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import signal
from collections.abc import Coroutine
from dataclasses import asdict

import zmq

from treeserve.outputs import RequestOutput
from treeserve.runtime.frontend import ModelInfo
from treeserve.runtime.runtime import StepFailed, thaw_heap
from treeserve.server.completions import Served
from treeserve.server.metrics import engine_stats
from treeserve.server.prm_api import ServedScores, check_request, score_request
from treeserve.server.protocol import PRMScoreRequest, SearchRequest
from treeserve.server.search_api import run_search, search_context, stream_search
from treeserve.server.settings import ServerSettings, build_served
from treeserve.server.wire import DECODER, ENCODER, encode_output, receive, socket

PARENT_POLL_S = 1.0
RANKS_FAILED = 3  # the exit code of a core whose parallel model lost a rank (the supervisor restarts it)


def core_main(settings: ServerSettings, to_core: str, from_core: str) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the API process decides when the core stops
        signal.signal(sig, signal.SIG_IGN)
    served = build_served(settings)  # its runtime froze the heap it loaded (`runtime.freeze_heap`)
    asyncio.run(Core(served, to_core, from_core).run())
    thaw_heap()  # let interpreter shutdown free them (bindings report frozen objects as leaks)


def error_of(e: BaseException) -> tuple[int, str]:
    if isinstance(e, ValueError):
        return 400, str(e)
    if isinstance(e, StepFailed):
        return 500, str(e)
    return 500, f"{type(e).__name__}: {e}"


class Core:
    def __init__(self, served: Served, to_core: str, from_core: str):
        self.served = served
        self.runtime = served.runtime
        self.inbox = socket(zmq.PULL, to_core, bind=False)
        self.outbox = socket(zmq.PUSH, from_core, bind=False)
        self.pending: list[list] = []
        self.tasks: dict[str, asyncio.Task] = {}
        self.scores = ServedScores(served.prm) if served.prm is not None else None
        self.streams: dict[str, tuple[str, str]] = {}  # generations: (model, runtime request id)

    async def run(self) -> None:
        info = {name: asdict(ModelInfo.of(engine)) for name, engine in self.runtime.engines.items()}
        self.send(["hello", info])
        orphan = asyncio.create_task(self._exit_with_parent())
        try:
            async for raw in receive(self.inbox):
                message = DECODER.decode(raw)
                if message[0] == "stop":
                    break
                self.handle(message)
        finally:
            orphan.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            for model, request_id in self.streams.values():
                self.runtime.close_stream(model, request_id)
            self.flush()
            await self.runtime.close()

    def handle(self, message: list) -> None:
        kind = message[0]
        if kind == "gen":
            _, rid, model, prompt_ids, params = message
            self.generate(rid, model, prompt_ids, pickle.loads(params))
        elif kind == "search":
            _, rid, body = message
            self.start(rid, self.search(rid, body))
        elif kind == "prm":
            _, rid, body = message
            self.start(rid, self.prm_score(rid, body))
        elif kind == "abort":  # the client went away
            if (stream := self.streams.pop(message[1], None)) is not None:
                self.runtime.close_stream(*stream)
            elif (task := self.tasks.get(message[1])) is not None:
                task.cancel()
        elif kind == "stats":
            self.send(["stats", message[1], engine_stats(self.runtime)])
        elif kind == "fail":
            self.runtime.engine(message[1]).inject_failure()

    def start(self, rid: str, work: Coroutine) -> None:
        task = asyncio.create_task(work)
        self.tasks[rid] = task
        task.add_done_callback(lambda _: self.tasks.pop(rid, None))

    def generate(self, rid: str, model: str, prompt_ids: list[int], params: object) -> None:
        def sink(out: RequestOutput | Exception) -> None:  # in the runtime's driver
            if isinstance(out, Exception):
                self.streams.pop(rid, None)
                self.send(["err", rid, *error_of(out)])
                self._exit_if_ranks_failed()
                return
            if out.finished:
                self.streams.pop(rid, None)
            self.send(["out", rid, encode_output(out)])

        try:
            request_id = self.runtime.open_stream(model, {"prompt_token_ids": prompt_ids}, params, sink)
        except Exception as e:  # noqa: BLE001 - bad input goes back to its request
            self.send(["err", rid, *error_of(e)])
            return
        self.streams[rid] = (model, request_id)

    async def search(self, rid: str, body: bytes) -> None:
        try:
            req = SearchRequest.model_validate_json(body)
            ctx, problem = search_context(self.served, req)
            self.send(["ok", rid])
            if req.stream:
                async with contextlib.aclosing(stream_search(self.served, req, ctx, problem)) as events:
                    async for event in events:
                        self.send(["event", rid, event])
                self.send(["done", rid, None])
            else:
                self.send(["done", rid, await run_search(self.served, req, ctx, problem)])
        except Exception as e:  # noqa: BLE001 - every failure goes back to its request
            self.send(["err", rid, *error_of(e)])
            self._exit_if_ranks_failed()

    async def prm_score(self, rid: str, body: bytes) -> None:
        try:
            req = PRMScoreRequest.model_validate_json(body)
            check_request(self.served, req)
            self.send(["done", rid, await score_request(self.served, self.scores, req)])
        except Exception as e:  # noqa: BLE001 - every failure goes back to its request
            self.send(["err", rid, *error_of(e)])
            self._exit_if_ranks_failed()

    def _exit_if_ranks_failed(self) -> None:
        """Ranks failed: exit, and the API's supervisor starts a new core with new ranks."""
        if any(e.ranks is not None and e.ranks.stopped for e in self.runtime.engines.values()):
            self.flush()
            os._exit(RANKS_FAILED)

    def send(self, message: list) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)  # one message per flush
        self.pending.append(message)

    def flush(self) -> None:
        if self.pending:
            self.outbox.send(ENCODER.encode(self.pending), zmq.NOBLOCK, copy=False)
            self.pending = []

    async def _exit_with_parent(self) -> None:
        parent = multiprocessing.parent_process()
        while parent is None or parent.is_alive():
            await asyncio.sleep(PARENT_POLL_S)
        os._exit(0)  # nobody is left to serve
