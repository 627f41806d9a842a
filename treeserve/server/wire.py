"""The messages between the API process and the engine-core process, and outputs as deltas.

Every message is a msgpack list (msgspec), its first item the kind:

    API -> core   ["gen", rid, model, prompt token ids, pickled SamplingParams]
                  ["search", rid, raw /v1/search JSON body]    ["abort", rid]
                  ["stats", nonce]    ["fail", model] (the test hook)    ["stop"]
    core -> API   one msgpack list of such messages per flush (outputs of one engine step
                  travel together): ["hello", {model: ModelInfo fields}]
                  ["out", rid, delta]    ["err", rid, HTTP status, message]
                  ["ok", rid] (a search passed its checks)    ["event", rid, SSE text]
                  ["done", rid, JSON result or None]    ["stats", nonce, {model: {...}}]

An output travels as a delta (`encode_delta` / `Assembler`): per completion, the text and
token ids past what the API already has (text may also shrink, when a stop string is cut),
the new log-probabilities and the finish state; the prompt's fields come once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq

from treeserve.outputs import CompletionOutput, Logprob, RequestOutput

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder()


class CoreError(RuntimeError):
    """A request the core could not serve: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class CoreDown(CoreError):
    def __init__(self, message: str):
        super().__init__(503, message)


def socket(kind: int, address: str, bind: bool) -> zmq.Socket:
    """A plain (non-asyncio) ZeroMQ socket: sends never block (no high-water mark), reads go
    through `receive`."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address) if bind else sock.connect(address)
    return sock


async def receive(sock: zmq.Socket) -> AsyncIterator[bytes]:
    """Every message of `sock`, read in the running event loop. ZeroMQ's descriptor is edge-
    triggered: each wake-up drains the socket until EVENTS says nothing is left, so no message
    waits for the next one (zmq.asyncio was measured leaving first outputs ~0.12 s behind)."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(sock.getsockopt(zmq.FD), ready.set)
    try:
        while True:
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                yield sock.recv(zmq.NOBLOCK)
            ready.clear()
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # checked after clear: no wake-up is lost
                await ready.wait()
    finally:
        loop.remove_reader(sock.getsockopt(zmq.FD))


def _common_prefix(a: str | list, b: str | list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _entry(entry: dict[int, Logprob] | None) -> dict | None:
    return None if entry is None else {t: [lp.logprob, lp.rank, lp.decoded_token] for t, lp in entry.items()}


def _logprob_entry(entry: dict | None) -> dict[int, Logprob] | None:
    return None if entry is None else {t: Logprob(*values) for t, values in entry.items()}


@dataclass
class Sent:
    """What the API has of one completion."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)


def encode_delta(out: RequestOutput, sent: dict[int, Sent]) -> list:
    """The delta of `out` against `sent` (updated); the first delta of a request carries its prompt."""
    first = not sent
    completions = []
    for c in out.outputs:
        s = sent.setdefault(c.index, Sent())
        text_keep = _common_prefix(s.text, c.text)
        token_keep = _common_prefix(s.token_ids, c.token_ids)
        logprobs = None if c.logprobs is None else [_entry(e) for e in c.logprobs[token_keep:]]  # one per token
        completions.append([
            c.index, text_keep, c.text[text_keep:], token_keep, c.token_ids[token_keep:], logprobs,
            c.cumulative_logprob, c.finish_reason, c.stop_reason, [list(o) for o in c.stop_offsets],
        ])  # fmt: skip
        s.text, s.token_ids = c.text, list(c.token_ids)
    prompt = None
    if first:
        prompt_logprobs = None if out.prompt_logprobs is None else [_entry(e) for e in out.prompt_logprobs]
        prompt = [out.prompt, out.prompt_token_ids, prompt_logprobs]
    return [out.finished, out.num_cached_tokens, completions, prompt]


class Assembler:
    """Rebuilds one request's cumulative `RequestOutput`s from its deltas."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list | None = None
        self.completions: dict[int, CompletionOutput] = {}

    def apply(self, delta: list) -> RequestOutput:
        finished, cached, completions, prompt = delta
        if prompt is not None:
            self.prompt, self.prompt_token_ids, prompt_logprobs = prompt
            if prompt_logprobs is not None:
                self.prompt_logprobs = [_logprob_entry(e) for e in prompt_logprobs]
        for index, text_keep, text, token_keep, tokens, logprobs, cumulative, finish, stop, offsets in completions:
            old = self.completions.get(index) or CompletionOutput(index, "", [], None, None)
            entries = None
            if logprobs is not None:
                entries = (old.logprobs or [])[:token_keep] + [_logprob_entry(e) for e in logprobs]
            self.completions[index] = CompletionOutput(
                index, old.text[:text_keep] + text, old.token_ids[:token_keep] + tokens, cumulative, entries,
                finish, stop, [tuple(o) for o in offsets],
            )  # fmt: skip
        outputs = [self.completions[i] for i in sorted(self.completions)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished, cached,
                             self.prompt_logprobs)  # fmt: skip
