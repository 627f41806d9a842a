"""`/v1/completions` and `/v1/chat/completions`: OpenAI requests in, engine streams out. Every
prompt is checked before any is submitted; each runs as one streamed runtime request of DELTA
outputs. Streams are SSE ending in `data: [DONE]`; closing one aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import asdict, dataclass, field, replace

from treeserve.outputs import CompletionOutput, Logprob, RequestOutput, merged
from treeserve.runtime.runtime import Runtime, StepFailed
from treeserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from treeserve.search.prm import PRM
from treeserve.server.metrics import ServerMetrics
from treeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    SamplingFields,
    error_body,
    new_id,
    now,
)
from treeserve.server.reasoning import ReasoningParser, ReasoningStream
from treeserve.server.traces import TraceRing
from treeserve.server.wire import CoreError

VALIDATION_ID = "(validation)"  # a request id the runtime never uses (its ids are numbers)


class ModelNotFound(ValueError):
    pass


@dataclass
class Served:
    """What the routes serve: the runtime, the generator's engine name and its public name."""

    runtime: Runtime
    model_name: str
    metrics: ServerMetrics
    generator: str = "generator"
    prm: PRM | None = None  # loaded once, at startup
    verifier: PRM | None = None  # re-ranks /v1/search's completions
    # public names of the PRM and verifier (None: not hosted), known in the API process too
    prm_name: str | None = None
    verifier_name: str | None = None
    traces: TraceRing = field(default_factory=TraceRing)  # GET /ui
    reasoning: ReasoningParser | None = None

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves `{self.model_name}`.")

    @property
    def max_model_len(self) -> int:
        return self.runtime.engine(self.generator).max_model_len


@dataclass
class Job:
    prompts: list[list[int]]
    params: SamplingParams
    start: float = field(default_factory=time.perf_counter)
    echo: list[str] | None = None  # each prompt's text, prepended to its choices
    echo_only: bool = False  # max_tokens=0: the one token generated is not returned


def sampling_params(
    served: Served,
    req: SamplingFields,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    limit = served.max_model_len
    if prompt_len >= limit:
        raise ValueError(f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len}.")
    if max_tokens is None:
        max_tokens = limit - prompt_len
    elif prompt_len + max_tokens > limit:
        raise ValueError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or the completion."
        )
    return SamplingParams(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias,
        min_tokens=req.min_tokens,
        prompt_logprobs=prompt_logprobs,
        structured_outputs=structured_outputs(req),
        max_thinking_tokens=req.max_thinking_tokens,
        output_kind=RequestOutputKind.DELTA,
    )


GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's older `guided_<name>` fields


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from `response_format`, `structured_outputs` or `guided_*`;
    ValueError when more than one is given or it is malformed."""
    fmt = req.response_format
    guided = {name: value for name in GUIDED if (value := getattr(req, f"guided_{name}")) is not None}
    given = [f"response_format ({fmt.type})"] if isinstance(fmt, JsonObjectFormat | JsonSchemaFormat) else []
    if req.structured_outputs is not None:
        given.append("structured_outputs")
    given += [f"guided_{name}" for name in guided]
    if len(given) > 1:
        raise ValueError(f"two constraints at once: {' and '.join(given)}; give at most one")
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    if isinstance(fmt, JsonSchemaFormat):
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    if (so := req.structured_outputs) is not None:
        return StructuredOutputsParams(
            json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=so.json_object
        )
    return StructuredOutputsParams(**guided) if guided else None


def completion_job(served: Served, req: CompletionRequest) -> Job:
    served.check_model(req.model)
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    if not raw:
        raise ValueError("prompt must not be empty")
    if req.max_tokens == 0 and not req.echo:
        raise ValueError("max_tokens=0 needs echo=true (it returns the prompt and its logprobs only)")
    engine = served.runtime.engine(served.generator)
    for p in raw:
        if isinstance(p, str):
            engine.check_text_length(p)  # before tokenising megabytes
    prompts = [engine.tokenize_prompt(p)[1] for p in raw]
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
    max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # echo_only: one token, not returned
    job = _checked(served, req, prompts, max_tokens, req.logprobs, prompt_logprobs)
    if req.echo:
        decode = engine.tokenizer.decode
        job.echo = [p if isinstance(p, str) else decode(ids, False) for p, ids in zip(raw, prompts, strict=True)]
        job.echo_only = req.max_tokens == 0
    return job


def chat_job(served: Served, req: ChatCompletionRequest) -> Job:
    served.check_model(req.model)
    engine = served.runtime.engine(served.generator)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    text = engine.tokenizer.apply_chat_template(messages, req.add_generation_prompt, req.continue_final_message)
    engine.check_text_length(text)  # before tokenising megabytes
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)  # the template placed special tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise ValueError("top_logprobs needs logprobs=true")
    max_tokens = req.max_completion_tokens or req.max_tokens
    return _checked(served, req, [prompt], max_tokens, logprobs, req.prompt_logprobs)


def _checked(
    served: Served,
    req: SamplingFields,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> Job:
    engine = served.runtime.engine(served.generator)
    longest = max(prompts, key=len)
    params = sampling_params(served, req, len(longest), max_tokens, logprobs, prompt_logprobs)
    for prompt in prompts:
        engine.check_request(VALIDATION_ID, prompt, params)  # raises ValueError; changes nothing
    return Job(prompts, params)


async def run_job(served: Served, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, DELTA output) after every engine step that added to a prompt's completions."""
    streams = [
        served.runtime.generate_stream(served.generator, {"prompt_token_ids": p}, job.params) for p in job.prompts
    ]
    m, model = served.metrics, served.model_name
    ttft, itl = m.ttft.labels(model), m.itl.labels(model)
    generated, prompt_tokens = m.generation_tokens.labels(model), m.prompt_tokens.labels(model)
    started = [False] * len(streams)
    last = [job.start] * len(streams)
    async with aclosing(_interleaved(streams)) as outputs:
        async for i, out in outputs:
            if tokens := sum(len(c.token_ids) for c in out.outputs):
                t = time.perf_counter()
                (itl if started[i] else ttft).observe(t - last[i])
                generated.inc(tokens)
                started[i], last[i] = True, t
            if out.finished:
                prompt_tokens.inc(len(out.prompt_token_ids))
            yield i, out


async def _interleaved(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream) as s:
                async for out in s:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:  # a consumer that stops early cancels the rest, which aborts their requests
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(
        ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k), key=lambda item: item[1].rank
    )[:k]


def completion_logprobs(c: CompletionOutput, k: int, first: int = 0, offset: int = 0) -> dict:
    """OpenAI's legacy completions `logprobs` object for tokens first.. of the completion."""
    return _logprobs_object(zip(c.token_ids[first:], (c.logprobs or [])[first:], strict=False), k, offset)


def echo_logprobs(out: RequestOutput, k: int, decode: Callable[[list[int], bool], str]) -> dict:
    return _logprobs_object(zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False), k, 0, decode)


def _logprobs_object(
    pairs: Iterable[tuple[int, dict[int, Logprob] | None]],
    k: int,
    offset: int,
    decode: Callable[[list[int], bool], str] | None = None,
) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset} of (token, entry) pairs; an entry of
    None (a prompt's first token) gives null log-probabilities and text from `decode`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token, entry in pairs:
        text = decode([token], False) if entry is None else entry[token].decoded_token or ""
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry[token].logprob)
        top = {lp.decoded_token or "": lp.logprob for _, lp in _top(entry, k)} if entry is not None and k else None
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_json(out: RequestOutput) -> list | None:
    """vLLM's `prompt_logprobs`: null for the first token, then {token id: {logprob, rank, decoded_token}}."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): asdict(lp) for t, lp in e.items()} for e in out.prompt_logprobs]


def visible(job: Job, c: CompletionOutput) -> CompletionOutput:
    if not job.echo_only:
        return c
    finish = "length" if c.finish_reason is not None else None
    return replace(c, text="", token_ids=[], logprobs=[], finish_reason=finish, stop_reason=None)


def chat_logprobs(c: CompletionOutput, k: int, first: int = 0) -> dict:
    """OpenAI's chat `logprobs` object (`content`: one entry per token) for tokens first.."""

    def item(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for token, entry in zip(c.token_ids[first:], (c.logprobs or [])[first:], strict=False):
        content.append({**item(entry[token]), "top_logprobs": [item(lp) for _, lp in _top(entry, k)]})
    return {"content": content}


def _usage(job: Job, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in job.prompts)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def full_response(served: Served, job: Job, chat: bool) -> dict:
    deltas: dict[int, list[RequestOutput]] = {}
    async with aclosing(run_job(served, job)) as outputs:
        async for i, out in outputs:
            deltas.setdefault(i, []).append(out)
    final = {i: merged(*outs) for i, outs in deltas.items()}  # joined once, not copied every step
    n, k = job.params.n, job.params.logprobs
    decode = served.runtime.engine(served.generator).tokenizer.decode
    choices, tokens = [], 0
    for i in range(len(job.prompts)):
        for c in [visible(job, c) for c in final[i].outputs]:
            tokens += len(c.token_ids)
            choice: dict = {"index": i * n + c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
                if served.reasoning is not None:
                    parsed = served.reasoning.parse(c.text)
                    choice["message"].update(content=parsed.content, reasoning_content=parsed.reasoning)
                choice["logprobs"] = chat_logprobs(c, k) if k is not None else None
            else:
                echo = job.echo[i] if job.echo else ""
                choice["text"] = echo + c.text
                choice["logprobs"] = completion_logprobs(c, k, offset=len(echo)) if k is not None else None
                if job.echo and k is not None:
                    choice["logprobs"] = _joined(echo_logprobs(final[i], k, decode), choice["logprobs"])
                if final[i].prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(final[i])
            choices.append(choice)
    body = {
        "id": new_id("chatcmpl" if chat else "cmpl"),
        "object": "chat.completion" if chat else "text_completion",
        "created": now(),
        "model": served.model_name,
        "choices": choices,
        "usage": _usage(job, tokens),
    }
    if chat and final[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(final[0])  # vLLM's place for chat
    return body


@dataclass
class StreamState:
    """What a stream has sent per choice: the text offset of its next token's logprobs (ahead of the
    text while a stop string may still cut it) and which choices ended."""

    job: Job
    chat: bool
    decode: Callable[[list[int], bool], str]
    reasoning: ReasoningParser | None = None
    offsets: dict[int, int] = field(default_factory=dict)
    thinking: dict[int, ReasoningStream] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    heads: dict[int, RequestOutput] = field(default_factory=dict)
    completion_tokens: int = 0

    @property
    def k(self) -> int | None:
        return self.job.params.logprobs

    def choices(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """The choice deltas this DELTA output adds (new text, new tokens' logprobs, finish reasons)."""
        choices = []
        job = self.job
        if out.prompt_logprobs is not None:
            self.heads[prompt_index] = out
        head = self.heads.get(prompt_index, out)
        for c in [visible(job, c) for c in out.outputs]:
            index = prompt_index * job.params.n + c.index
            if index in self.ended:
                continue
            self.completion_tokens += len(c.token_ids)
            first = index not in self.offsets
            text, done = c.text, c.finish_reason is not None
            echo = job.echo[prompt_index] if job.echo else ""
            offset = self.offsets.get(index, len(echo))
            delta = self._delta(index, text, done) if self.chat else {}
            if self.chat:
                text = "".join(delta.values())
            if not text and not done and not (first and echo) and not (self.k is not None and c.token_ids):
                continue
            choice: dict = {"index": index, "finish_reason": c.finish_reason if done else None}
            if self.chat:
                choice["delta"] = delta if delta or done else {"content": ""}
                choice["logprobs"] = chat_logprobs(c, self.k) if self.k is not None else None
            else:
                choice["text"] = (echo if first else "") + text
                lp = completion_logprobs(c, self.k, 0, offset) if self.k is not None else None
                if lp is not None and lp["tokens"]:
                    offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if first and echo and lp is not None:
                    lp = _joined(echo_logprobs(head, self.k, self.decode), lp)
                choice["logprobs"] = lp
            if first and head.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(head)
            choices.append(choice)
            self.offsets[index] = offset
            if done:
                self.ended.add(index)
        return choices

    def _delta(self, index: int, text: str, done: bool) -> dict:
        """A chat choice's delta as content, or with a reasoning parser split (partial tags held)."""
        if self.reasoning is None:
            return {"content": text} if text else {}
        stream = self.thinking.get(index)
        if stream is None:
            stream = self.thinking[index] = self.reasoning.stream()
        reasoning, content = stream.feed(text, final=done)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        return {**delta, "content": content} if content else delta


async def stream_events(served: Served, job: Job, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """Server-Sent Events: one chunk per step that produced text, then usage if asked, then [DONE]."""
    rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
    kind = "chat.completion.chunk" if chat else "text_completion"
    decode = served.runtime.engine(served.generator).tokenizer.decode
    state = StreamState(job, chat, decode, served.reasoning)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": rid, "object": kind, "created": created, "model": served.model_name, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        roles = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(len(job.prompts) * job.params.n)
        ]
        yield chunk(roles)
    try:
        async with aclosing(run_job(served, job)) as outputs:
            async for i, out in outputs:
                if choices := state.choices(i, out):
                    yield chunk(choices)
    except (StepFailed, CoreError) as e:  # the status (200) is sent: the error goes in the stream, as vLLM does
        yield f"data: {json.dumps(error_body(getattr(e, 'status', 500), str(e)))}\n\n"
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        yield chunk([], _usage(job, state.completion_tokens))
    yield "data: [DONE]\n\n"
