"""The messages between the API process and the engine-core process, and outputs as deltas.

Every message is a msgpack list (msgspec), its first item the kind:

    API -> core   ["gen", rid, model, prompt token ids, pickled SamplingParams]
                  ["search", rid, raw /v1/search JSON body]    ["abort", rid]
                  ["prm", rid, raw /v1/prm/score JSON body] (answered "done" or "err")
                  ["stats", nonce]    ["fail", model] (the test hook)    ["stop"]
    core -> API   one msgpack list of such messages per flush (outputs of one engine step
                  travel together): ["hello", {model: ModelInfo fields}]
                  ["out", rid, delta]    ["err", rid, HTTP status, message]
                  ["ok", rid] (a search passed its checks)    ["event", rid, SSE text]
                  ["done", rid, JSON result or None]    ["stats", nonce, {model: {...}}]

An output travels as lists (`encode_output` / `decode_output`), of the kind its request's
`output_kind` asks: the server's routes ask for deltas (`RequestOutputKind.DELTA`), so a step
sends what it added to each stream, not the whole of it again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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


def _entry(entry: dict[int, Logprob] | None) -> dict | None:
    return None if entry is None else {t: [lp.logprob, lp.rank, lp.decoded_token] for t, lp in entry.items()}


def _logprob_entry(entry: dict | None) -> dict[int, Logprob] | None:
    return None if entry is None else {t: Logprob(*values) for t, values in entry.items()}


def encode_output(out: RequestOutput) -> list:
    """`out` as lists (its request id and prompt travel apart: the API process has them)."""
    completions = [
        [
            c.index,
            c.text,
            c.token_ids,
            None if c.logprobs is None else [_entry(e) for e in c.logprobs],
            c.cumulative_logprob,
            c.finish_reason,
            c.stop_reason,
            c.stop_offsets,
        ]
        for c in out.outputs
    ]
    prompt_logprobs = None if out.prompt_logprobs is None else [_entry(e) for e in out.prompt_logprobs]
    return [out.finished, out.num_cached_tokens, completions, prompt_logprobs]


def decode_output(request_id: str, prompt_token_ids: list[int], message: list) -> RequestOutput:
    """The `RequestOutput` that `encode_output` gave `message` of."""
    finished, cached, completions, prompt_logprobs = message
    outputs = [
        CompletionOutput(
            index,
            text,
            tokens,
            cumulative,
            None if logprobs is None else [_logprob_entry(e) for e in logprobs],
            finish,
            stop,
            [tuple(o) for o in offsets],
        )
        for index, text, tokens, logprobs, cumulative, finish, stop, offsets in completions
    ]
    if prompt_logprobs is not None:
        prompt_logprobs = [_logprob_entry(e) for e in prompt_logprobs]
    return RequestOutput(request_id, None, prompt_token_ids, outputs, finished, cached, prompt_logprobs)
