"""One model's engine: requests in, one `step()` at a time: schedule -> run -> sample -> detokenize.

Owns the model, its tokenizer, the live requests and the parts made by `attach_kv` from its KV
arena. A step is launched and read back (`postprocess.py`), with `async_scheduling` step t+1
before step t is read back (docs/engine-loop.md); outputs are the same either way.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import torch

from treeserve.config import EngineConfig
from treeserve.device import available_memory, release_free_heap
from treeserve.distributed.ranks import Ranks
from treeserve.engine import cuda_graphs
from treeserve.engine.attention import BACKENDS
from treeserve.engine.detokenizer import StopChecker
from treeserve.engine.device_queue import DeviceQueue, Ran
from treeserve.engine.guided import Constraints
from treeserve.engine.inference_mode import inference_mode
from treeserve.engine.input_batch import InputBatch
from treeserve.engine.model_runner import ModelRunner
from treeserve.engine.postprocess import Postprocessor
from treeserve.engine.rank_worker import RankWorker
from treeserve.engine.request import TWIN_KEY_TOKENS, Request, Sequence
from treeserve.engine.sampler import fused_draw
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.speculative.draft_model import DraftModel
from treeserve.engine.speculative.speculator import Speculator
from treeserve.engine.step_plan import PreparedStep
from treeserve.engine.step_result import StepFailed
from treeserve.engine.thinking import ThinkTokens
from treeserve.engine.validation import check_request, check_text_length, tokenize_prompt
from treeserve.kv.arena import KVArena, KVLayout, PageArena, shared_page_sizes
from treeserve.kv.page_manager import PageManager
from treeserve.kv.page_pool import PagePool
from treeserve.kv.stats import PageLog
from treeserve.models.loader import load_model
from treeserve.models.tokenizer import Tokenizer
from treeserve.outputs import RequestOutput, ScoreOutput
from treeserve.sampling_params import RequestOutputKind, SamplingParams, ScoreParams

__all__ = ["LLMEngine", "StepFailed", "share_kv"]

# an unset max_model_len is lowered to what the KV holds, but never below this
MIN_AUTO_MODEL_LEN = 2048

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A launched step and its device work's future (`Ran`: it ran on the calling thread)."""

    step: PreparedStep
    result: Future | Ran


class LLMEngine:
    def __init__(self, config: EngineConfig, attach_kv: bool = True):
        """Load the model; with `attach_kv`, also a KV arena of its own (else the runtime attaches one)."""
        self.config = config
        self.device = torch.device(config.device_config.device)
        tp, pp = config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size
        self.ranks = None  # a parallel model's ranks 1..k-1, started before this rank loads its part
        if tp * pp > 1:
            self.ranks = Ranks(config, self.device, RankWorker)
        try:
            loaded = load_model(
                config.model,
                config.device_config.torch_dtype,
                self.device,
                config.load_config.quantization,
                config.load_config.quant_activations,
                tp_size=tp,
                pp_size=pp,
                max_positions=config.load_config.max_model_len,
            )
            if self.ranks is not None:
                if tp > 1:
                    loaded.model.attach(self.ranks.placement.tp)
                self.ranks.wait_ready()
        except BaseException:
            if self.ranks is not None:
                self.ranks.close()
            raise
        self.model = loaded.model
        self.quantization = loaded.quantization
        self.model_config = loaded.config
        self.extra_tensors = loaded.extra_tensors
        self.tokenizer = Tokenizer(config.model, model_eos_ids=loaded.config.eos_token_ids)
        release_free_heap()
        self.constraints = Constraints(self.tokenizer)
        self.think = ThinkTokens.of(self.tokenizer)
        limit = loaded.config.max_position_embeddings
        self.context_len = min(config.load_config.max_model_len or limit, limit)
        self.max_model_len = self.context_len
        cfg = loaded.config
        self.kv_layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.kv_torch_dtype)
        # each layer's (k_scale, v_scale) of an FP8 KV cache, kept across arenas (1.0: none shipped)
        self.kv_scales = torch.ones(cfg.num_layers, 2, dtype=torch.float32, device=self.device)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self.num_computed_tokens = 0  # every token run through the model (prompt, recompute, decode)
        self.num_generated_tokens = 0
        self.stalled = False  # the last step had work but no pages for it
        self._injected: Exception | None = None
        self.async_scheduling = config.scheduler_config.async_scheduling
        self.step = self._step_overlapped if self.async_scheduling else self.step_plain
        self.queue = DeviceQueue(self.device)
        self._in_flight: InFlight | None = None
        self._undelivered: list[RequestOutput | ScoreOutput] = []  # read back by a step that then failed
        self.draw = fused_draw(config.device_config.attention_backend)
        speculative = config.speculative_config
        draft = None
        if speculative is not None and speculative.method == "model":
            draft = DraftModel(speculative.model, config.device_config.torch_dtype, self.device, cfg.vocab_size)
        self.speculator = Speculator(speculative, draft) if speculative is not None else None
        if attach_kv:
            self.attach_own_kv(config.kv_budget(available_memory(self.device)))
            self.capture_graphs()

    def attach_own_kv(self, kv_bytes: int) -> None:
        page_bytes = self.kv_layout.page_bytes(self.config.cache_config.page_size)
        self.attach_kv(
            PageArena(max(kv_bytes // page_bytes, 1), page_bytes, self.device), self.config.cache_config.page_size
        )

    def capture_graphs(self) -> None:
        """Capture the decode steps' CUDA graphs where they apply, after the final `attach_kv`."""
        config = self.config
        if not cuda_graphs.graphs_apply(
            self.device,
            config.device_config.attention_backend,
            config.graph_config.enforce_eager,
            self.ranks is not None,
        ):
            return
        graphs = cuda_graphs.DecodeGraphs(
            self.model,
            self.arena,
            self.runner.backend,
            self.model_config.attn_scale,
            cuda_graphs.capture_sizes(config.scheduler_config.max_num_seqs, config.graph_config.cuda_graph_sizes),
            self.inputs.tables.shape[1],
        )
        graphs.capture()
        self.runner.graphs, self.graph_stats = graphs, graphs.stats

    def attach_kv(self, pages: PageArena, page_size: int, pool: PagePool | None = None) -> None:
        """Make every KV-dependent part for `pages`, their states in `pool` (shared) or a pool of its own."""
        config, layout, ranks = self.config, self.kv_layout, self.ranks
        pages_per_seq = self._fit_context(pages, page_size)
        self.page_size = page_size
        self.arena = KVArena(
            pages.num_pages,
            layout.num_layers,
            page_size,
            layout.num_kv_heads,
            layout.head_dim,
            layout.dtype,
            self.device,
            pages=pages,
            scales=self.kv_scales,
        )
        self.pages = PageManager(
            pages.num_pages, page_size, config.model_id, config.arena_config.enable_prefix_caching, pool=pool
        )
        self.peers: dict[int, DeviceQueue] = {}
        self.inputs = InputBatch(
            page_size, pages_per_seq, list(self.tokenizer.eos_token_ids), self.constraints, self.think
        )
        self.scheduler = Scheduler(
            self.pages,
            self.inputs,
            self.speculator,
            config.scheduler_config.max_num_seqs,
            config.scheduler_config.max_num_batched_tokens,
            self.max_model_len,
        )
        self.postprocessor = Postprocessor(
            self.scheduler, self.pages, self.tokenizer, self.constraints, self.speculator, self.max_model_len
        )
        backend = BACKENDS[config.device_config.attention_backend]()
        stage = None
        if ranks is not None:
            ranks.send(("kv", pages.num_pages, page_size))
            if ranks.placement.pp is not None:
                stage = (
                    ranks.placement.pp,
                    0,
                    config.parallel_config.pipeline_parallel_size,
                    config.device_config.torch_dtype,
                )
        self.runner = ModelRunner(
            self.model,
            self.arena,
            self.device,
            self.model_config.attn_scale,
            backend,
            self.draw,
            self.tokenizer.vocab_size,
            ranks and ranks.send,
            ranks is not None and ranks.placement.tp is not None,
            stage,
        )
        self.graph_stats = None
        self.page_log = PageLog(self.pages)
        if self.speculator is not None and self.speculator.draft_model is not None:
            self.speculator.draft_model.attach(pages, self.pages.pool, backend, config.model_id)

    def _fit_context(self, pages: PageArena, page_size: int) -> int:
        """Set `max_model_len` for `pages`; the pages one sequence may need."""
        config = self.config
        self.max_model_len = self.context_len
        pages_per_seq = -(-self.max_model_len // page_size) + 1
        fits = (pages.num_pages - 1) * page_size
        if pages.num_pages < pages_per_seq and config.load_config.max_model_len is None and fits >= MIN_AUTO_MODEL_LEN:
            log.warning(
                "max_model_len lowered from the model's %d to %d tokens, what a KV budget of %d MiB holds; "
                "give more KV memory (kv_cache_memory / --kv-cache-memory) or set max_model_len to choose",
                self.max_model_len,
                fits,
                pages.nbytes >> 20,
            )
            self.max_model_len, pages_per_seq = fits, pages.num_pages
        if pages.num_pages < pages_per_seq:
            raise ValueError(
                f"the KV budget ({pages.nbytes} bytes = {pages.num_pages} pages of {pages.page_bytes} bytes) "
                f"cannot hold one sequence of max_model_len={self.max_model_len} ({pages_per_seq} pages); "
                "raise kv_cache_memory or lower max_model_len"
                + (
                    f" (without max_model_len it is lowered to what fits, but not below {MIN_AUTO_MODEL_LEN})"
                    if config.load_config.max_model_len is None
                    else ""
                )
            )
        return pages_per_seq

    def share_pages_with(self, others: list[LLMEngine]) -> None:
        """`others` share this page pool: wait for their steps that may still use a page they hand over."""
        self.peers = {other.pages.owner: other.queue for other in others if other is not self}

    def run_on_stream(self, priority: int = 0) -> None:
        """Run this engine's steps on a CUDA stream of their own (`priority`: CUDA's, lower first)."""
        self.queue.stream = torch.cuda.Stream(self.device, priority=priority)

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Steps run inside add nothing to the engine's token counts (the memory planner's probe)."""
        counts = self.num_computed_tokens, self.num_generated_tokens
        try:
            yield
        finally:
            self.num_computed_tokens, self.num_generated_tokens = counts

    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def check_text_length(self, text: str) -> None:
        check_text_length(self.tokenizer, text, self.max_model_len)

    def check_request(self, request_id: str, token_ids: list[int], params: SamplingParams | ScoreParams) -> None:
        """Raise ValueError for anything that cannot run; changes nothing."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        cfg = self.model_config
        check_request(
            token_ids, params, cfg.vocab_size, cfg.has_lm_head, self.max_model_len, self.constraints, self.think
        )

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | ScoreParams,
        stream: bool = False,
        draft_group: str | None = None,
    ) -> None:
        """Queue a request (bad input raises before anything changes); a `stream` has an output every step."""
        text, token_ids = self.tokenize_prompt(prompt)
        self.check_request(request_id, token_ids, params)
        sampling = params if isinstance(params, SamplingParams) else None
        seed = 0  # forward-only: draws no seed, so it never shifts later requests' seeds
        if sampling is not None:
            seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
            stream = stream and sampling.output_kind is not RequestOutputKind.FINAL_ONLY
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=sampling,
            score=params if isinstance(params, ScoreParams) else None,
            seed=seed,
            arrival=next(self._arrivals),
            stream=stream,
            delta=stream and sampling is not None and sampling.output_kind is RequestOutputKind.DELTA,
            draft_group=draft_group,
            plain=sampling is not None
            and sampling.logprobs is None
            and sampling.prompt_logprobs is None
            and sampling.structured_outputs is None
            and not sampling.adjusts_logits
            and sampling.max_thinking_tokens is None,
        )
        request.prompt_key = hash(tuple(token_ids[:TWIN_KEY_TOKENS])) if len(token_ids) >= TWIN_KEY_TOKENS else None
        tokens, detok = list(token_ids), None
        if sampling is not None:
            detok = StopChecker(
                self.tokenizer.hf, token_ids, sampling, self.tokenizer.eos_token_ids, lazy=not stream, tokens=tokens
            )
        seq = Sequence(
            request=request,
            index=0,
            token_ids=tokens,
            detok=detok,
            pending_forks=request.width - 1,
            quiet=request.plain and not stream,
        )
        if detok is not None:
            seq.ending_ids, seq.check_len = detok.quiet_stops(self.max_model_len)
        seq.logprobs = [] if sampling and sampling.logprobs is not None else None
        if sampling and sampling.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        _let_go(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    # `step()` is one of these two loops; each returns the outputs its read-backs produced
    @inference_mode
    def step_plain(self) -> list[RequestOutput | ScoreOutput]:
        """Schedule, run, read back (a step the overlapped loop left in flight first)."""
        outputs, self._undelivered = self._undelivered, []
        if self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            outputs = self._deliver(outputs, done)
        try:
            launched = self._launch(*self._schedule(can_preempt=True), previous=None, queued=False)
        except BaseException:
            self._undelivered = outputs
            raise
        return outputs if launched is None else self._deliver(outputs, launched)

    @inference_mode
    def _step_overlapped(self) -> list[RequestOutput | ScoreOutput]:
        """Launch step t+1, then read back step t (first, if not `overlappable` or it would preempt)."""
        outputs, self._undelivered = self._undelivered, []
        flight, self._in_flight = self._in_flight, None
        try:
            if flight is not None and not flight.step.overlappable:
                done, flight = flight, None
                outputs += self._read_back(done)
            scheduled = self._schedule(can_preempt=flight is None)
            if scheduled is None:
                done, flight = flight, None
                outputs += self._read_back(done)
                scheduled = self._schedule(can_preempt=True)
            self._in_flight = self._launch(*scheduled, previous=flight, queued=True)
        except BaseException:
            self._in_flight, self._undelivered = flight, outputs
            raise
        return outputs if flight is None else self._deliver(outputs, flight)

    def _deliver(self, outputs: list, flight: InFlight) -> list:
        try:
            return outputs + self._read_back(flight)
        except BaseException:
            self._undelivered = outputs
            raise

    def inject_failure(self, error: Exception | None = None) -> None:
        """Test hook: the next step that runs a batch raises `error` right after the forward."""
        self._injected = error or RuntimeError("injected step failure")

    def _schedule(self, can_preempt: bool) -> tuple[list, list[tuple[int, int]]] | None:
        """This step's batch and page copies; None if it would preempt and may not."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        return self.scheduler.schedule(can_preempt=can_preempt)

    def _launch(
        self, batch: list, copies: list[tuple[int, int]], previous: InFlight | None, queued: bool
    ) -> InFlight | None:
        """Build `batch`'s plan and submit it after `previous` (whose samples it may read); None: no work."""
        self.stalled = not batch and previous is None and self.scheduler.has_work()
        if not batch:
            if self.stalled and not self.pages.pool.shared:
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return None  # it waits for pages the other models hold
        try:
            step = self.inputs.prepare(batch, copies)
        except Exception as e:  # atomic: the batch's requests fail, nothing else changes
            raise self._fail(batch, e) from e
        step.plan.fail, self._injected = self._injected, None
        self.postprocessor.launched(step)
        for owner in self.pages.pool.take_handovers(self.pages.owner):
            peer = self.peers.get(owner)
            if peer is not None:
                self.queue.wait(peer.fence())  # this step starts after their steps that may still use them
        run = self.queue.submit if queued else self.queue.run
        return InFlight(step, run(self.runner.execute, step.plan, previous.result if previous else None))

    def _read_back(self, flight: InFlight) -> list[RequestOutput | ScoreOutput]:
        """Tokens, stop rules, outputs; a failed step fails its requests and undoes the one after it."""
        step = flight.step
        try:
            result = flight.result.result()
        except Exception as e:
            error = self._fail(step.batch, e)
            successor, self._in_flight = self._in_flight, None
            if successor is not None:  # it read this step's samples: it did not run
                with suppress(Exception):
                    successor.result.result()
                self.postprocessor.roll_back(successor.step)
            raise error from e
        self.num_computed_tokens += result.num_computed
        try:
            requests, generated = self.postprocessor.read(step, result)
        except Exception as e:
            raise self._fail(step.batch, e) from e
        self.num_generated_tokens += generated
        self.page_log.record()
        return [out for r in requests if (r.stream or r.finished) and (out := self._emit(r)) is not None]

    def _fail(self, batch: list, cause: BaseException) -> StepFailed:
        failed = list(dict.fromkeys(item.seq.request.request_id for item in batch))
        for request_id in failed:
            self.abort(request_id)
        if self.ranks is not None:  # a collective that failed: say which rank, and stop them all
            cause = self.ranks.explain(cause)
        log.error("step failed, aborted %d request(s): %s: %s", len(failed), type(cause).__name__, cause)
        return StepFailed(failed, cause)

    def _emit(self, request: Request) -> RequestOutput | ScoreOutput | None:
        if not request.seqs:  # its final output was given, or it was aborted (`_let_go`)
            return None
        finished = request.finished
        if not finished:
            return request.output(False)
        self.requests.pop(request.request_id, None)
        out = request.output(True)
        _let_go(request)
        return out

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close()

    def check_pages_idle(self) -> None:
        """Assert the page accounting invariant for an engine with no live requests."""
        self.pages.check_idle()
        if self.speculator is not None and self.speculator.draft_model is not None:
            self.speculator.draft_model.pages.check_idle()

    @property
    def status(self) -> dict:
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "pages_total": self.pages.num_pages,
            "pages_used": self.pages.num_used_pages,
            "pages_cached": self.pages.num_cached_pages,
            "preemptions": self.scheduler.num_preemptions,
        }


def share_kv(engines: list[LLMEngine], kv_bytes: int) -> None:
    """Give `engines` one arena of `kv_bytes` and one page pool (`kv.arena.shared_page_sizes`)."""
    layouts = [e.kv_layout for e in engines]
    page_bytes, page_sizes = shared_page_sizes(layouts, [e.config.cache_config.page_size for e in engines])
    pages = PageArena(kv_bytes // page_bytes, page_bytes, engines[0].device)
    pool = PagePool(pages.num_pages)
    for engine, page_size in zip(engines, page_sizes, strict=True):
        engine.attach_kv(pages, page_size, pool)
    for engine in engines:
        engine.share_pages_with(engines)


def _let_go(request: Request) -> None:
    """After a request's last output: it and its sequences refer to each other, as a sequence and
    its next row do. Without the cycles refcounting frees them as the last step holding a
    sequence lets go, not a pass of the cyclic collector; a request with no sequences left gives
    no more outputs (`_emit`)."""
    for seq in request.seqs:
        seq.next_row = None
    request.seqs = []
