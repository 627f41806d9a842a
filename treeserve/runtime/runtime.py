"""One process, several named engines, one async API for search programs.

Search programs `await runtime.generate(...)` and `runtime.score(...)` from many tasks; one
driver task steps every engine that has work in turn, so batches fill across problems. Bad
input raises in the caller before anything is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from treeserve.config import DEFAULT_PAGE_SIZE, ArenaConfig, DeviceConfig, EngineConfig
from treeserve.device import available_memory, process_memory, release_free_heap
from treeserve.engine.guided import grammar_of
from treeserve.engine.llm_engine import LLMEngine, StepFailed, share_kv  # noqa: F401 - StepFailed: for the server
from treeserve.models.tokenizer import Tokenizer
from treeserve.outputs import RequestOutput, ScoreOutput
from treeserve.runtime import planner
from treeserve.runtime.output_slot import OutputSlot
from treeserve.sampling_params import RequestOutputKind, SamplingParams, ScoreParams, StructuredOutputsParams


def check_constraint(constraint: StructuredOutputsParams) -> None:
    """ValueError naming what is wrong if `constraint` does not compile (needs no model)."""
    grammar_of(constraint)


@dataclass
class DecodeAhead:
    """A generation that reports its first step early and keeps decoding past it."""

    runtime: Runtime
    model: str
    request_id: str
    first: asyncio.Future  # RequestOutput at the first stop-string occurrence (or the end)
    final: asyncio.Future  # RequestOutput when the request ends

    def cancel(self) -> None:
        """Stop decoding (the speculative text is not needed); its pages are released."""
        self.runtime._forget(self.model, self.request_id)


@dataclass
class ModelSpec:
    name: str
    path: str
    kv_fraction: float | None = None  # None: the shared arena; else this share of KV (a static split)
    page_size: int = DEFAULT_PAGE_SIZE  # preferred tokens per page (a shared arena may give fewer)
    # EngineConfig.from_kwargs's keywords for this model: flat (max_num_seqs, ...) or its sub-configs
    engine_args: dict = field(default_factory=dict)


# a search's models' preferred page sizes: a PRM request recomputes at most 3 cached tokens
ROLE_PAGE_SIZES = {"generator": DEFAULT_PAGE_SIZE, "prm": 4, "verifier": 4}


# event-loop turns search programs get after each engine step, so their next requests make the
# next engine's step: the beams' tasks finish, the gather completes, the program goes on
REACTION_YIELDS = 3


# allocations between young-generation collections while serving (CPython's default is 700)
SERVING_GC_THRESHOLD = 50_000
_threshold_before: int | None = None


def freeze_heap() -> None:
    """Put every object alive now out of the cyclic collector's reach (vLLM's `freeze_gc_heap`),
    and collect the young generation every SERVING_GC_THRESHOLD allocations: its passes then walk
    only what serving allocates, and seldom. `thaw_heap` undoes both."""
    global _threshold_before
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if _threshold_before is None:
        _threshold_before = young
    gc.set_threshold(max(young, SERVING_GC_THRESHOLD), *older)


def thaw_heap() -> None:
    """The collector as it was before `freeze_heap`: frozen objects back in reach, its threshold."""
    global _threshold_before
    gc.unfreeze()
    if _threshold_before is not None:
        gc.set_threshold(_threshold_before, *gc.get_threshold()[1:])
        _threshold_before = None


class Runtime:
    def __init__(self, engines: dict[str, LLMEngine]):
        if not engines:
            raise ValueError("a runtime needs at least one engine")
        self.engines = engines
        self._futures: dict[tuple[str, str], asyncio.Future] = {}
        self._early: dict[tuple[str, str], asyncio.Future] = {}  # speculations' first steps
        self._streams: dict[tuple[str, str], Callable[[RequestOutput | Exception], None]] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self.steps = {name: 0 for name in engines}
        self.busy_s = {name: 0.0 for name in engines}  # seconds inside each engine's step()
        self.memory_plan: planner.MemoryPlan | None = None  # set by `load`

    @classmethod
    def load(
        cls,
        specs: list[ModelSpec],
        kv_cache_memory: int | None = None,
        device_config: DeviceConfig | None = None,
        enable_prefix_caching: bool = True,
        memory_budget: int | None = None,
        memory_fraction: float | None = None,
        overlap_models: bool = False,
    ) -> Runtime:
        """Load every model, plan memory (planner.py: one of `kv_cache_memory`, `memory_budget`,
        `memory_fraction`, or `planner.default_budget`) and give the models KV pages: one shared
        arena, or a static split when every spec has a `kv_fraction`. `overlap_models` (CUDA):
        each model on a stream of its own, the first spec's at the higher priority."""
        fractions = [s.kv_fraction for s in specs]
        shared = all(f is None for f in fractions)
        if not shared and (None in fractions or abs(sum(fractions) - 1.0) > 1e-6):
            raise ValueError("either no model has a kv_fraction (one shared arena) or all do and they add up to 1")
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("model names must be unique")
        device_config = device_config or DeviceConfig()
        arena = ArenaConfig(enable_prefix_caching=enable_prefix_caching)  # the planner sizes the arena
        configs = {  # every model's settings checked before any model loads
            s.name: EngineConfig.from_kwargs(
                s.path,
                model_id=s.name + ":" + s.path,
                device_config=device_config,
                arena_config=arena,
                **(s.engine_args if "cache_config" in s.engine_args else {"page_size": s.page_size, **s.engine_args}),
            )
            for s in specs
        }
        device = torch.device(device_config.device)
        if kv_cache_memory is None and memory_budget is None and memory_fraction is None:
            kv_cache_memory, memory_fraction = planner.default_budget(device)
        planner.check_budget(kv_cache_memory, memory_budget, memory_fraction)
        free_at_start = available_memory(device)
        gc.freeze()  # what the imports made lives as long as the process: no collection walks it again
        engines: dict[str, LLMEngine] = {}
        loaded: dict[str, int] = {}  # process memory each load added
        for name, config in configs.items():
            release_free_heap()  # the engine trims the heap after its load: what was freed before is not the load's
            before = process_memory(device)
            engines[name] = LLMEngine(config, attach_kv=False)
            loaded[name] = max(0, process_memory(device) - before)
        memory = planner.plan(
            engines,
            None if shared else {s.name: s.kv_fraction for s in specs},
            free_at_start,
            loaded,
            kv_cache_memory,
            memory_budget,
            memory_fraction,
        )
        if shared:
            share_kv(list(engines.values()), memory.kv_bytes)
        else:
            for m in memory.models:
                engines[m.name].attach_own_kv(int(memory.kv_bytes * m.kv_fraction))
        for engine in engines.values():
            engine.capture_graphs()  # once, on the final arena
        if overlap_models and device.type == "cuda":
            torch.cuda.synchronize(device)  # the loads' work on the current stream is done before the others start
            for i, engine in enumerate(engines.values()):
                engine.run_on_stream(priority=-1 if i == 0 else 0)
        planner.record_pages(memory, engines)
        runtime = cls(engines)
        runtime.memory_plan = memory
        freeze_heap()
        return runtime

    @classmethod
    def for_search(
        cls,
        generator: str,
        prm: str | None,
        kv_cache_memory: int | None,
        prm_kv_fraction: float | None = None,
        engine_args: dict[str, dict] | None = None,
        verifier: str | None = None,
        device_config: DeviceConfig | None = None,
        enable_prefix_caching: bool = True,
        memory_budget: int | None = None,
        memory_fraction: float | None = None,
        overlap_models: bool = False,
    ) -> Runtime:
        """Engines "generator", "prm" and "verifier" (an outcome RM; shared arena only): one
        shared arena, or a static split giving the PRM `prm_kv_fraction`. `engine_args`: per
        model. Pages: ROLE_PAGE_SIZES; in a shared arena the smaller page wins."""
        args = engine_args or {}
        if prm and args.get("prm", {}).get("speculative_config") is not None:
            raise ValueError("a PRM only scores (one forward per input): speculative decoding is for the generator")
        split = prm and prm_kv_fraction is not None
        shares = {"generator": 1.0 - prm_kv_fraction if split else None, "prm": prm_kv_fraction if split else None}
        paths = {"generator": generator, "prm": prm, "verifier": verifier}
        specs = [
            ModelSpec(name, path, shares.get(name), ROLE_PAGE_SIZES[name], args.get(name, {}))
            for name, path in paths.items()
            if path
        ]
        return cls.load(
            specs, kv_cache_memory, device_config, enable_prefix_caching, memory_budget, memory_fraction, overlap_models
        )

    def tokenizer(self, model: str) -> Tokenizer:
        return self._engine(model).tokenizer

    def engine(self, model: str) -> LLMEngine:
        return self._engine(model)

    async def generate(
        self, model: str, prompt: str | list[int] | dict, params: SamplingParams, draft_group: str | None = None
    ) -> RequestOutput:
        """One generation request. Requests of one `draft_group` (the beams of one problem) draft
        from each other's text when the model decodes speculatively with the `tree` method."""
        return await self._submit(model, prompt, params, draft_group)

    async def score(self, model: str, token_ids: list[int], params: ScoreParams) -> ScoreOutput:
        return await self._submit(model, {"prompt_token_ids": token_ids}, params)

    def open_stream(
        self,
        model: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        sink: Callable[[RequestOutput | Exception], None],
    ) -> str:
        """Submit a request whose outputs (as `params.output_kind` says), or the error that fails
        it, go to `sink` as the driver reads each step back; returns its id. `sink` runs in the
        driver: it must not block."""
        engine = self._engine(model)
        request_id = str(next(self._ids))
        engine.add_request(request_id, prompt, params, stream=True)
        self._streams[(model, request_id)] = sink
        self._ensure_driver()
        return request_id

    def close_stream(self, model: str, request_id: str) -> None:
        """Abort a stream whose consumer went away (nothing, when it had ended)."""
        if self._streams.pop((model, request_id), None) is not None:
            self.engines[model].abort(request_id)

    async def generate_stream(
        self, model: str, prompt: str | list[int] | dict, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as `params.output_kind` says (cumulative: the newest; delta:
        merged), the last with `finished=True`. Closing the iterator early aborts the request."""
        slot = OutputSlot(delta=params.output_kind is RequestOutputKind.DELTA)
        request_id = self.open_stream(model, prompt, params, slot.put)
        finished = False
        try:
            while not finished:
                out = await slot.take()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.close_stream(model, request_id)

    async def generate_ahead(
        self, model: str, prompt: str | list[int] | dict, params: SamplingParams, draft_group: str | None = None
    ) -> DecodeAhead:
        """Like `generate`, but `first` resolves as soon as the first stop string occurs while
        decoding continues (up to `params.n_stop_occurrences`) until `final`, or `cancel()`."""
        engine = self._engine(model)
        request_id = str(next(self._ids))
        engine.add_request(request_id, prompt, params, stream=True, draft_group=draft_group)
        loop = asyncio.get_running_loop()
        ahead = DecodeAhead(self, model, request_id, loop.create_future(), loop.create_future())
        self._futures[(model, request_id)] = ahead.final
        self._early[(model, request_id)] = ahead.first
        self._ensure_driver()
        return ahead

    def _forget(self, model: str, request_id: str) -> None:
        self.engines[model].abort(request_id)
        for table in (self._futures, self._early):
            future = table.pop((model, request_id), None)
            if future is not None and not future.done():
                future.cancel()

    def _engine(self, model: str) -> LLMEngine:
        if model not in self.engines:
            raise ValueError(f"unknown model {model!r}; this runtime hosts {sorted(self.engines)}")
        return self.engines[model]

    def forget_draft_group(self, model: str, draft_group: str) -> None:
        """A problem's search ended: drop its drafting text."""
        speculator = self._engine(model).speculator
        if speculator is not None:
            speculator.forget_group(draft_group)

    async def _submit(
        self, model: str, prompt: str | list[int] | dict, params: object, draft_group: str | None = None
    ) -> object:
        engine = self._engine(model)
        request_id = str(next(self._ids))
        engine.add_request(request_id, prompt, params, draft_group=draft_group)  # raises on bad input, nothing queued
        future = asyncio.get_running_loop().create_future()
        self._futures[(model, request_id)] = future
        self._ensure_driver()
        try:
            return await future
        except asyncio.CancelledError:
            self._forget(model, request_id)
            raise

    def _ensure_driver(self) -> None:
        loop = asyncio.get_running_loop()
        if self._driver is None or self._driver.done() or self._driver.get_loop() is not loop:
            self._wake = asyncio.Event()  # a new event loop (another asyncio.run) needs its own driver
            self._driver = loop.create_task(self._drive())
        self._wake.set()

    async def _drive(self) -> None:
        stuck: set[str] = set()  # the engines of the last round, when none of them could step
        while True:
            busy = [name for name, e in self.engines.items() if e.has_unfinished_requests()]
            if not busy:
                self._wake.clear()
                await self._wake.wait()
                continue
            if stuck and stuck.issuperset(busy):  # nothing changed since: no engine will ever progress
                error = RuntimeError("no engine can make progress: the KV pages are too few for the work in flight")
                for name in busy:
                    self._fail(name, error)
                stuck = set()
                continue
            stepped = []
            for name, engine in self.engines.items():
                if not engine.has_unfinished_requests():
                    continue
                stepped.append(name)
                start = time.perf_counter()
                try:
                    outputs = engine.step()
                except StepFailed as e:  # the step's own requests fail; the others go on
                    self._fail(name, e, set(e.request_ids))
                    continue
                except Exception as e:  # outside a batch (scheduling): fail every waiter rather than hang them
                    self._fail(name, e)
                    continue
                self.steps[name] += 1
                self.busy_s[name] += time.perf_counter() - start
                for out in outputs:
                    key = (name, out.request_id)
                    if (sink := self._streams.get(key)) is not None:
                        if out.finished:
                            del self._streams[key]
                        sink(out)
                    if key in self._early and (out.finished or out.outputs[0].stop_offsets):
                        self._early.pop(key).set_result(out)
                    if out.finished and (future := self._futures.pop(key, None)) and not future.done():
                        future.set_result(out)
                for _ in range(REACTION_YIELDS):
                    await asyncio.sleep(0)
            stuck = set(stepped) if stepped and all(self.engines[name].stalled for name in stepped) else set()
            await asyncio.sleep(0)

    def _fail(self, name: str, error: Exception, only: set[str] | None = None) -> None:
        """Abort the engine's requests (those in `only`, or all) and hand `error` to their waiters."""
        for (model, request_id), sink in list(self._streams.items()):
            if model == name and (only is None or request_id in only):
                self.engines[name].abort(request_id)
                del self._streams[(model, request_id)]
                sink(error)
        for table in (self._early, self._futures):
            for (model, request_id), future in list(table.items()):
                if model == name and (only is None or request_id in only):
                    self.engines[name].abort(request_id)
                    del table[(model, request_id)]
                    if not future.done():
                        future.set_exception(error)

    async def close(self) -> None:
        """Stop stepping; a parallel model's other ranks stop too (the engines step no more)."""
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        for engine in self.engines.values():
            engine.close()
        thaw_heap()

    def check_pages_idle(self) -> None:
        for engine in self.engines.values():
            engine.check_pages_idle()
