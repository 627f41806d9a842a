"""The API process's side of the engine core: start it, supervise it, talk to it.

`CoreClient` stands where the in-process server has its `Runtime`: the routes call
`engine(name)` (a `Frontend`: tokenizer, `max_model_len`, request checks, all in this
process) and `generate_stream(...)` (outputs rebuilt from the core's deltas), and
`/v1/search` and `/v1/prm/score` are forwarded whole (`search`, `prm_score`). The core
process (`core.py`) is started with the server's settings unchanged. Supervision: when the
core dies (killed, a crash in a kernel), every in-flight request fails with `CoreDown` (HTTP
503), `up` is False (so `/health` answers 503 and new requests 503) and the core is started
again, up to `max_restarts` failed starts in a row, each logged; `restarts` counts the
successful ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable

import zmq

from treeserve.outputs import merged
from treeserve.runtime.frontend import Frontend, ModelInfo
from treeserve.sampling_params import RequestOutputKind, SamplingParams
from treeserve.server.core import core_main
from treeserve.server.settings import ServerSettings
from treeserve.server.wire import DECODER, ENCODER, CoreDown, CoreError, decode_output, receive, socket

SUPERVISE_POLL_S = 0.1
STATS_TIMEOUT_S = 2.0
log = logging.getLogger("treeserve.server")


class CoreClient:
    def __init__(self, settings: ServerSettings, max_restarts: int = 5, start_timeout_s: float = 900.0):
        self.settings = settings
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.frontends: dict[str, Frontend] = {}
        self.queues: dict[str, asyncio.Queue] = {}
        self.last_stats: dict[str, dict[str, float]] = {}
        self.up = False
        self.restarts = 0
        self.on_restart: Callable[[], None] = lambda: None
        self.process: multiprocessing.Process | None = None
        self._stats: dict[int, asyncio.Future] = {}
        self._hello: asyncio.Future | None = None
        self._ids = itertools.count()
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the sockets, start the core and wait until its models are loaded."""
        self._dir = tempfile.mkdtemp(prefix="treeserve-core-")
        self.to_core, self.from_core = f"ipc://{self._dir}/to_core", f"ipc://{self._dir}/from_core"
        self.push = socket(zmq.PUSH, self.to_core, bind=True)
        self.pull = socket(zmq.PULL, self.from_core, bind=True)
        self._reader = asyncio.create_task(self._read())
        await self._spawn()
        self._monitor = asyncio.create_task(self._supervise())

    async def _spawn(self) -> None:
        self._hello = asyncio.get_running_loop().create_future()
        process = multiprocessing.get_context("spawn").Process(
            target=core_main, args=(self.settings, self.to_core, self.from_core), name="treeserve-core", daemon=True
        )
        process.start()
        self.process = process
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s
        while not self._hello.done():
            if not process.is_alive():
                raise CoreDown(f"the engine core exited (code {process.exitcode}) before its models were loaded")
            if asyncio.get_running_loop().time() > deadline:
                process.kill()
                raise CoreDown(f"the engine core did not load its models within {self.start_timeout_s:.0f} s")
            await asyncio.wait({self._hello}, timeout=SUPERVISE_POLL_S)
        if not self.frontends:  # the same models on every restart
            info = self._hello.result()
            self.frontends = await asyncio.to_thread(lambda: {n: Frontend(ModelInfo(**i)) for n, i in info.items()})
        self.up = True

    async def _supervise(self) -> None:
        failures = 0
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_POLL_S)
            if self._stopping or self.process.is_alive():
                continue
            self.up = False
            code = self.process.exitcode
            log.error(
                "the engine core died (exit code %s); failing %d in-flight requests, restarting it",
                code,
                len(self.queues),
            )
            error = CoreDown(f"the engine core process died (exit code {code}); it is being restarted")
            for queue in self.queues.values():
                queue.put_nowait(error)
            self.queues.clear()
            while not self._stopping and not self.up:
                if failures >= self.max_restarts:
                    log.error("the engine core failed to start %d times in a row; not trying again", failures)
                    return
                failures += 1
                try:
                    await self._spawn()
                except CoreDown as e:
                    log.error("engine core restart %d of %d failed: %s", failures, self.max_restarts, e)
                    await asyncio.sleep(0.5 * failures)
                    continue
                failures = 0
                self.restarts += 1
                self.on_restart()
                log.warning("the engine core is back (restart %d)", self.restarts)

    async def close(self) -> None:
        """Stop the core (it aborts what is left) and release the sockets."""
        self._stopping = True
        process = self.process
        if process is not None and process.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self.push.send(ENCODER.encode(["stop"]), flags=zmq.NOBLOCK)
            await asyncio.to_thread(process.join, 10)
            if process.is_alive():
                process.kill()
        for task in (getattr(self, "_monitor", None), getattr(self, "_reader", None)):
            if task is not None:
                task.cancel()
        self.push.close()
        self.pull.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- what the routes call ----------------------------------------------------------
    def engine(self, model: str) -> Frontend:
        if model not in self.frontends:
            raise ValueError(f"unknown model {model!r}; this server hosts {sorted(self.frontends)}")
        return self.frontends[model]

    async def generate_stream(
        self, model: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> AsyncIterator:
        """As `Runtime.generate_stream`: outputs of the kind `params.output_kind` asks after the
        steps that touched the request; closing early aborts it in the core."""
        _, ids = self.engine(model).tokenize_prompt(prompt)
        rid, queue = self._open(["gen", None, model, ids, pickle.dumps(params)])
        delta, finished = params.output_kind is RequestOutputKind.DELTA, False
        try:
            while not finished:
                out = decode_output(rid, ids, self._checked(await queue.get())[2])
                while not out.finished and not queue.empty():  # a consumer that lags: deltas merged, or the newest
                    newer = decode_output(rid, ids, self._checked(queue.get_nowait())[2])
                    out = merged(out, newer) if delta else newer
                finished = out.finished
                yield out
        finally:
            self._close(rid, finished)

    async def search(self, body: bytes) -> AsyncIterator[list]:
        """A `/v1/search` request run in the core: yields ["ok"] once its checks pass, then
        ["event", text]s (streaming) and ["done", result]."""
        rid, queue = self._open(["search", None, body])
        done = False
        try:
            while not done:
                message = self._checked(await queue.get())
                done = message[0] == "done"
                yield [message[0], *message[2:]]
        finally:
            self._close(rid, done)

    async def prm_score(self, body: bytes) -> dict:
        """A `/v1/prm/score` request run in the core: its result, or its error raised."""
        rid, queue = self._open(["prm", None, body])
        done = False
        try:
            message = await queue.get()
            done = True
            return self._checked(message)[2]
        finally:
            self._close(rid, done)

    async def stats(self) -> dict[str, dict[str, float]]:
        """The core's engine state now (the last report when the core does not answer)."""
        if self.up:
            nonce = next(self._ids)
            self._stats[nonce] = future = asyncio.get_running_loop().create_future()
            self._send(["stats", nonce])
            with contextlib.suppress(TimeoutError):
                self.last_stats = await asyncio.wait_for(future, STATS_TIMEOUT_S)
            self._stats.pop(nonce, None)
        return self.last_stats

    def inject_failure(self, model: str) -> None:
        """Test hook: the core's next batch of `model` raises (`LLMEngine.inject_failure`)."""
        self._send(["fail", model])

    # ---- plumbing ----------------------------------------------------------------------
    def _open(self, message: list) -> tuple[str, asyncio.Queue]:
        if not self.up:
            raise CoreDown("the engine core is not running (it is being restarted); retry shortly")
        rid = str(next(self._ids))
        message[1] = rid
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = queue
        self._send(message)
        return rid, queue

    def _close(self, rid: str, done: bool) -> None:
        if self.queues.pop(rid, None) is not None and not done and self.up:
            with contextlib.suppress(CoreDown):  # a core that just died aborted everything anyway
                self._send(["abort", rid])  # the client went away: the core aborts it, its pages go back

    def _send(self, message: list) -> None:
        try:
            self.push.send(ENCODER.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again as e:
            raise CoreDown("the engine core is not reachable") from e

    @staticmethod
    def _checked(message: list | Exception) -> list:
        """`message`, unless it says the request failed: then its error is raised (a 400 as
        ValueError, as the in-process server raises it)."""
        if isinstance(message, Exception):
            raise message
        if message[0] == "err":
            _, _, status, text = message
            raise ValueError(text) if status == 400 else CoreError(status, text)
        return message

    async def _read(self) -> None:
        async for raw in receive(self.pull):
            for message in DECODER.decode(raw):
                kind = message[0]
                if kind == "hello":
                    if self._hello is not None and not self._hello.done():
                        self._hello.set_result(message[1])
                elif kind == "stats":
                    if (future := self._stats.get(message[1])) is not None and not future.done():
                        future.set_result(message[2])
                elif (queue := self.queues.get(message[1])) is not None:
                    queue.put_nowait(message)
