"""One model's engine: requests in, one `step()` at a time: schedule -> run -> sample -> detokenize.

Owns the model, its tokenizer, its view of a KV arena and its block manager, the scheduler
and the live requests. The arena is its own (`attach_own_kv`) or one shared with other
engines (`share_kv`: one page pool, pages flow to whichever model needs them).
`add_request` validates everything before it changes any state; `abort` and normal
completion both return every page to the pool (or to the prefix cache). After every step
the engine appends a row of page statistics to its `page_log`.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass

import torch

from treeserve.config import EngineConfig
from treeserve.device import available_memory
from treeserve.engine.attention import BACKENDS
from treeserve.engine.dedup import expand, split_twins
from treeserve.engine.detokenizer import StopChecker
from treeserve.engine.draft_model import DraftModel
from treeserve.engine.guided import Constraints
from treeserve.engine.model_runner import ModelRunner, ScheduledSeq
from treeserve.engine.penalties import RowHistory, adjust_logits
from treeserve.engine.request import Request, Sequence
from treeserve.engine.sampler import (
    SamplingRow,
    TokenLogprobs,
    fused_draw,
    sample,
    sample_masked,
    seeded_uniform,
    temperatures,
    token_logprobs,
)
from treeserve.engine.scheduler import Scheduler
from treeserve.engine.speculative import Speculator
from treeserve.engine.validation import check_request, check_text_length, tokenize_prompt
from treeserve.kv.arena import KVArena, KVLayout, PageArena, shared_block_sizes
from treeserve.kv.block_manager import BlockManager
from treeserve.kv.page_pool import PagePool
from treeserve.kv.stats import PageLog
from treeserve.models.loader import load_model
from treeserve.models.tokenizer import Tokenizer
from treeserve.outputs import Logprob, RequestOutput, ScoreOutput
from treeserve.sampling_params import SamplingParams, ScoreParams

PROMPT_LOGPROBS_ROWS = 256  # prompt positions per [rows, vocab] logits slice
# When max_model_len is not given and the KV budget cannot hold the model's whole context,
# max_model_len is lowered to what fits, but never below this (or the model's own limit).
MIN_AUTO_MODEL_LEN = 2048

log = logging.getLogger(__name__)


class StepFailed(RuntimeError):
    """A step raised while running its batch. Its requests (`request_ids`) were aborted and
    their pages released; every other request is untouched and the next step runs normally."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        what = f"{type(cause).__name__}: {cause}"
        super().__init__(f"the engine step serving {len(request_ids)} request(s) failed: {what}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass
class ToSample:
    """One token to sample: from which hidden row, at which position (its seeded uniform). A
    speculating sequence has one per drafted token and one more; `draft[draft_index]` is the
    drafted token the sample is compared with (none for the last)."""

    seq: Sequence
    row: int
    position: int
    draft: list[int] | None = None
    draft_index: int = 0


@dataclass
class Verification:
    """One speculating sequence's draft, checked position by position against the target's samples."""

    seq: Sequence
    drafted: int
    accepted: int = 0
    going: bool = True  # every position so far matched and the sequence has not ended


class LLMEngine:
    def __init__(self, config: EngineConfig, attach_kv: bool = True):
        """Load the model; with `attach_kv`, also give it a KV arena of its own sized from
        `config` (a runtime that shares one arena between models attaches it later)."""
        self.config = config
        self.device = torch.device(config.device)
        loaded = load_model(
            config.model, config.torch_dtype, self.device, config.quantization, config.quant_activations
        )
        self.model = loaded.model
        self.quantization = loaded.quantization  # e.g. "gguf:Q5_0+Q8_0", "int8", None
        self.model_config = loaded.config
        self.extra_tensors = loaded.extra_tensors
        self.tokenizer = Tokenizer(config.model, model_eos_ids=loaded.config.eos_token_ids)
        self.constraints = Constraints(self.tokenizer)  # structured outputs: compiled at first use, cached
        limit = loaded.config.max_position_embeddings
        self.context_len = min(config.max_model_len or limit, limit)  # max_model_len before the KV budget's say
        self.max_model_len = self.context_len
        cfg = loaded.config
        self.kv_layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.torch_dtype)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0  # every token run through the model (prompt, recompute, decode)
        self.stalled = False  # the last step had work but no pages for it
        self._injected: Exception | None = None  # inject_failure's error, raised by the next batch
        self.draw = fused_draw(config.attention_backend)  # the sampler's batch-invariant plain draw
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "model":
            draft = DraftModel(spec.model, config.torch_dtype, self.device, cfg.vocab_size)
        self.speculator = Speculator(spec, draft) if spec is not None else None
        if attach_kv:
            self.attach_own_kv(config.kv_budget(available_memory(self.device)))

    def attach_own_kv(self, kv_bytes: int) -> None:
        """An arena of its own: as many pages of `config.block_size` tokens as fit `kv_bytes`."""
        page_bytes = self.kv_layout.page_bytes(self.config.block_size)
        self.attach_kv(PageArena(max(kv_bytes // page_bytes, 1), page_bytes, self.device), self.config.block_size)

    def attach_kv(self, pages: PageArena, block_size: int, pool: PagePool | None = None) -> None:
        """Use `pages` (with `block_size` tokens per page of this model) for KV, its page states
        in `pool` (shared with the other models on the same arena), or a pool of its own."""
        config = self.config
        self.max_model_len = self.context_len
        pages_per_seq = -(-self.max_model_len // block_size) + 1
        fits = (pages.num_pages - 1) * block_size  # the longest sequence the arena holds
        if pages.num_pages < pages_per_seq and config.max_model_len is None and fits >= MIN_AUTO_MODEL_LEN:
            log.warning(
                "max_model_len lowered from the model's %d to %d tokens, what a KV budget of %d MiB holds; "
                "give more KV memory (kv_cache_memory / --kv-cache-memory) or set max_model_len to choose",
                self.max_model_len, fits, pages.nbytes >> 20,
            )  # fmt: skip
            self.max_model_len, pages_per_seq = fits, pages.num_pages
        if pages.num_pages < pages_per_seq:
            raise ValueError(
                f"the KV budget ({pages.nbytes} bytes = {pages.num_pages} pages of {pages.page_bytes} bytes) "
                f"cannot hold one sequence of max_model_len={self.max_model_len} ({pages_per_seq} pages); "
                "raise kv_cache_memory or lower max_model_len"
                + (
                    f" (without max_model_len it is lowered to what fits, but not below {MIN_AUTO_MODEL_LEN})"
                    if config.max_model_len is None
                    else ""
                )
            )
        layout = self.kv_layout
        self.block_size = block_size
        self.arena = KVArena(
            pages.num_pages, layout.num_layers, block_size, layout.num_kv_heads, layout.head_dim, layout.dtype,
            self.device, pages=pages,
        )  # fmt: skip
        self.blocks = BlockManager(
            pages.num_pages, block_size, config.model_id, config.enable_prefix_caching, pool=pool
        )
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        backend = BACKENDS[config.attention_backend]()
        self.runner = ModelRunner(self.model, self.arena, self.device, self.model_config.attn_scale, backend)
        self.page_log = PageLog(self.blocks)
        if self.speculator is not None:
            self.scheduler.on_release = self.speculator.release
            if self.speculator.draft_model is not None:
                self.speculator.draft_model.attach(pages, self.blocks.pool, backend, config.model_id)

    # ---- requests ----------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def check_text_length(self, text: str) -> None:
        check_text_length(self.tokenizer, text, self.max_model_len)

    def check_request(self, request_id: str, token_ids: list[int], params: SamplingParams | ScoreParams) -> None:
        """Raise ValueError for anything that cannot run; changes nothing."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        cfg = self.model_config
        check_request(token_ids, params, cfg.vocab_size, cfg.has_lm_head, self.max_model_len, self.constraints)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | ScoreParams,
        stream: bool = False,
        draft_group: str | None = None,
    ) -> None:
        """Queue a request (bad input raises before anything changes). With speculative `tree`
        drafting, requests of one `draft_group` draft from each other's text."""
        text, token_ids = self.tokenize_prompt(prompt)
        self.check_request(request_id, token_ids, params)
        sampling = params if isinstance(params, SamplingParams) else None
        seed = 0  # forward-only requests sample nothing (and draw no seed, so they never shift later ones)
        if sampling is not None:
            seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=sampling,
            score=params if isinstance(params, ScoreParams) else None,
            seed=seed,
            arrival=next(self._arrivals),
            stream=stream,
            draft_group=draft_group,
        )
        detok = None
        if sampling is not None:
            detok = StopChecker(self.tokenizer.hf, token_ids, sampling, self.tokenizer.eos_token_ids)
        seq = Sequence(request=request, index=0, token_ids=list(token_ids), detok=detok)
        seq.pending_forks = request.width - 1
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput | ScoreOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        batch, copies = self.scheduler.schedule()
        self.stalled = not batch and self.scheduler.has_work()
        if not batch:
            if self.stalled and not self.blocks.pool.shared:
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return []  # sharing the arena: it waits for pages the other models hold
        try:
            return self._run_batch(batch, copies)
        except Exception as e:  # atomic: the batch's requests fail, nothing else changes
            failed = list(dict.fromkeys(item.seq.request.request_id for item in batch))
            for request_id in failed:
                self.abort(request_id)
            log.error("step failed, aborted %d request(s): %s: %s", len(failed), type(e).__name__, e)
            raise StepFailed(failed, e) from e

    def inject_failure(self, error: Exception | None = None) -> None:
        """Test hook: the next step that runs a batch raises `error` (default: a RuntimeError)
        right after the model's forward, as a failing kernel or an out-of-memory would."""
        self._injected = error or RuntimeError("injected step failure")

    def _run_batch(self, batch: list[ScheduledSeq], copies: list[tuple[int, int]]) -> list:
        self.arena.copy_pages(copies)
        computed, source = split_twins(batch)
        hidden = self.runner.run(computed)
        if self._injected is not None:
            error, self._injected = self._injected, None
            raise error
        if len(computed) < len(batch):
            hidden = expand(batch, computed, source, hidden, self.arena)
        self.num_computed_tokens += sum(item.num_tokens for item in computed)  # twins' rows are not computed
        touched: dict[str, Request] = {}
        to_sample: list[ToSample] = []
        row = 0
        for item in batch:
            seq = item.seq
            request = seq.request
            seq.num_computed_tokens = item.end - len(item.draft)  # drafted tokens count once accepted
            self.blocks.commit_full_blocks(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
            if request.prompt_logprobs is not None and item.start < seq.num_prompt_tokens - 1:
                self._read_prompt_logprobs(request, item, hidden[row : row + item.num_tokens])
            if request.score is not None:
                self._read_scores(seq, item, hidden[row : row + item.num_tokens])
            elif seq.num_computed_tokens == len(seq.token_ids):
                last = row + item.num_tokens - 1 - len(item.draft)
                draft = item.draft or None
                for member in [seq, *self._fork_siblings(seq)]:
                    to_sample.append(ToSample(member, last, len(member.token_ids), draft if member is seq else None))
                for j in range(1, len(item.draft) + 1):  # the target's token after each drafted one
                    to_sample.append(ToSample(seq, last + j, len(seq.token_ids) + j, draft, j))
            row += item.num_tokens
            touched[request.request_id] = request
        if to_sample:
            self._sample(to_sample, hidden)
        self.page_log.record()
        return [self._emit(r) for r in touched.values() if r.finished or r.stream]

    def _fork_siblings(self, seq: Sequence) -> list[Sequence]:
        siblings = []
        for i in range(1, seq.pending_forks + 1):
            sibling = seq.fork(i, self.blocks.fork(seq.block_table))
            seq.request.seqs.append(sibling)
            self.scheduler.add_running(sibling)
            siblings.append(sibling)
        seq.pending_forks = 0
        return siblings

    def _read_scores(self, seq: Sequence, item: ScheduledSeq, hidden: torch.Tensor) -> None:
        score = seq.request.score
        wanted = [p for p in score.positions if item.start <= p < item.end]
        if wanted:
            rows = hidden[[p - item.start for p in wanted]]
            logprobs = None
            if score.token_ids:
                logits = self.model.compute_logits(rows)
                logprobs = torch.log_softmax(logits, dim=-1)[:, score.token_ids].cpu()
            states = rows.float().cpu() if score.return_hidden_states else None
            for i, p in enumerate(wanted):
                seq.score_rows[p] = (
                    None if logprobs is None else logprobs[i],
                    None if states is None else states[i],
                )
        if item.end == len(seq.token_ids):
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)

    def _read_prompt_logprobs(self, request: Request, item: ScheduledSeq, hidden: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this chunk predicts: the hidden state at
        position p scores prompt token p + 1 (computed in slices, as [rows, vocab] is large)."""
        end = min(item.end, len(request.prompt_token_ids) - 1)
        k = request.params.prompt_logprobs
        for start in range(item.start, end, PROMPT_LOGPROBS_ROWS):
            stop = min(start + PROMPT_LOGPROBS_ROWS, end)
            targets = request.prompt_token_ids[start + 1 : stop + 1]
            (tokens,) = self.runner.staging.to_device(torch.tensor(targets))
            logits = self.model.compute_logits(hidden[start - item.start : stop - item.start])
            lp = token_logprobs(logits, tokens, k)
            for i, token in enumerate(targets):
                request.prompt_logprobs[start + 1 + i] = self._logprob_entry(token, lp, i, k)

    def _sample(self, to_sample: list[ToSample], hidden: torch.Tensor) -> None:
        rows = [
            SamplingRow(
                temperature=s.seq.request.params.temperature,
                top_p=s.seq.request.params.top_p,
                top_k=s.seq.request.params.top_k,
                min_p=s.seq.request.params.min_p,
                uniform=seeded_uniform(s.seq.request.seed, s.seq.index, s.position),
            )
            for s in to_sample
        ]
        # rows with penalties or a bias get raw logits, edited, then divided by the temperature
        edited = [i for i, s in enumerate(to_sample) if s.seq.request.params.adjusts_logits]
        divisors = temperatures(rows)
        for i in edited:
            divisors[i] = 1.0
        (index,) = self.runner.staging.to_device(torch.tensor([s.row for s in to_sample]))
        states = hidden[index]
        (scale,) = self.runner.staging.to_device(torch.tensor(divisors, dtype=states.dtype)[:, None])
        logits = self.model.compute_logits(states / scale, float32=False)
        seqs = [s.seq for s in to_sample]
        for seq in seqs:
            if seq.request.params.structured_outputs is not None and seq.guide is None:
                seq.guide = self.constraints.guide(seq.request.params.structured_outputs)
        if edited:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            plain = sorted(set(range(len(rows))) - set(edited))
            if plain:
                tokens[plain] = self._draw([rows[i] for i in plain], logits[plain], [seqs[i] for i in plain])
            edited_rows, edited_seqs = [rows[i] for i in edited], [seqs[i] for i in edited]
            (scale,) = self.runner.staging.to_device(torch.tensor(temperatures(edited_rows))[:, None])
            tokens[edited] = self._draw(edited_rows, self._edit(logits[edited], edited_seqs) / scale, edited_seqs)
        else:
            tokens = self._draw(rows, logits, seqs)
        wanted = [i for i, s in enumerate(to_sample) if s.seq.logprobs is not None]
        logprobs = None
        if wanted:
            k = max(to_sample[i].seq.request.params.logprobs for i in wanted)
            logprobs = token_logprobs(self.model.compute_logits(states[wanted]), tokens[wanted], k)
        verifying: dict[int, Verification] = {}  # seq_id -> its draft's verification so far
        for i, (s, token) in enumerate(zip(to_sample, tokens.tolist(), strict=True)):  # the step's one D2H
            seq = s.seq
            if s.draft is not None:
                check = verifying.setdefault(seq.seq_id, Verification(seq, len(s.draft)))
                if not check.going:
                    continue  # an earlier position of this draft was rejected: this row is void
            going = self._append(seq, token, logprobs, wanted.index(i) if seq.logprobs is not None else -1)
            if s.draft is not None:
                matched = s.draft_index < len(s.draft) and token == s.draft[s.draft_index]
                check.accepted += matched
                check.going = going and matched
        for check in verifying.values():
            seq = check.seq
            self.speculator.verified(seq, check.drafted, check.accepted)
            if not seq.is_finished:  # the accepted drafted tokens' KV is valid, the rest is dropped
                seq.num_computed_tokens += check.accepted
                self.blocks.commit_full_blocks(
                    seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed_tokens
                )
                self.blocks.truncate(seq.block_table, len(seq.token_ids))

    def _append(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, row: int) -> bool:
        """Add a sampled token to `seq` and apply the stop rules; False when the sequence ended."""
        if seq.guide is not None and not seq.guide.advance(token):
            seq.finish_reason, seq.stop_reason = "abort", None  # the constraint library contradicted itself
            self.scheduler.finish(seq)
            return False
        seq.token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.logprobs is not None:
            self._record_logprobs(seq, token, logprobs, row)
        result = seq.detok.append(token, seq.request.params.max_tokens)
        if result is None and len(seq.token_ids) >= self.max_model_len:
            result = ("length", None)
        if result is not None:
            seq.finish_reason, seq.stop_reason = result
            self.scheduler.finish(seq)
            return False
        return True

    def _draw(self, rows: list[SamplingRow], scaled: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Tokens from temperature-scaled logits; constrained rows over what their constraint allows."""
        guided = [i for i, seq in enumerate(seqs) if seq.guide is not None]
        if not guided:
            return sample(scaled, rows, self.draw)
        masks = self.constraints.bitmask([seqs[i].guide for i in guided])
        vocab = self.tokenizer.vocab_size
        if len(guided) == len(rows):
            return sample_masked(scaled, rows, masks, vocab, self.draw)
        tokens = torch.empty(len(rows), dtype=torch.long, device=scaled.device)
        free = sorted(set(range(len(rows))) - set(guided))
        tokens[free] = sample(scaled[free], [rows[i] for i in free], self.draw)
        tokens[guided] = sample_masked(scaled[guided], [rows[i] for i in guided], masks, vocab, self.draw)
        return tokens

    def _edit(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Raw logits of rows with penalties, a bias or min_tokens, edited (fp32)."""
        eos = list(self.tokenizer.eos_token_ids)
        histories = [
            RowHistory(
                params=seq.request.params,
                prompt_ids=seq.request.prompt_token_ids,
                output_ids=seq.token_ids[seq.num_prompt_tokens :],
                # where a constraint accepts, it decides whether the output ends: min_tokens yields
                stop_ids=[]
                if seq.guide is not None and seq.guide.matcher.is_accepting()
                else ([] if seq.request.params.ignore_eos else eos) + seq.request.params.stop_token_ids,
            )
            for seq in seqs
        ]
        return adjust_logits(logits.float(), histories)

    def _record_logprobs(self, seq: Sequence, token: int, lp: TokenLogprobs, i: int) -> None:
        seq.cumulative_logprob += lp.logprobs[i]
        seq.logprobs.append(self._logprob_entry(token, lp, i, seq.request.params.logprobs))

    def _logprob_entry(self, token: int, lp: TokenLogprobs, i: int, k: int) -> dict[int, Logprob]:
        """vLLM's shape: the actual token first, then the top k (the actual one may be among them)."""
        decode = self.tokenizer.decode
        entry = {token: Logprob(lp.logprobs[i], lp.ranks[i], decode([token], False))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids[i][:k], lp.top_logprobs[i][:k], strict=True), 1):
            entry.setdefault(tid, Logprob(value, rank, decode([tid], False)))
        return entry

    def _emit(self, request: Request) -> RequestOutput | ScoreOutput:
        if request.finished:
            self.requests.pop(request.request_id, None)
        return request.output()

    # ---- introspection -------------------------------------------------------------------
    def check_pages_idle(self) -> None:
        """Assert the page accounting invariant for an engine with no live requests."""
        self.blocks.check_idle()
        if self.speculator is not None and self.speculator.draft_model is not None:
            self.speculator.draft_model.blocks.check_idle()

    @property
    def status(self) -> dict:
        return {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "pages_total": self.blocks.num_blocks,
            "pages_used": self.blocks.num_used_blocks,
            "pages_cached": self.blocks.num_cached_blocks,
            "preemptions": self.scheduler.num_preemptions,
        }


def share_kv(engines: list[LLMEngine], kv_bytes: int) -> None:
    """Give `engines` one arena of `kv_bytes` and one page pool: equal-sized pages (the rule in
    `kv.arena.shared_block_sizes`), each engine with as many tokens per page as fit."""
    layouts = [e.kv_layout for e in engines]
    page_bytes, block_sizes = shared_block_sizes(layouts, [e.config.block_size for e in engines])
    pages = PageArena(kv_bytes // page_bytes, page_bytes, engines[0].device)
    pool = PagePool(pages.num_pages)
    for engine, block_size in zip(engines, block_sizes, strict=True):
        engine.attach_kv(pages, block_size, pool)
