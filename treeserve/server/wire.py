"""Messages between the API process and the engine-core process: msgpack lists, kind first.

    API -> core   ["gen", rid, model, prompt ids, pickled SamplingParams]  ["abort", rid]
                  ["search" | "prm", rid, raw JSON body]  ["stats", nonce]  ["fail", model]  ["stop"]
    core -> API   a list of messages per flush: ["hello", {model: ModelInfo}]  ["out", rid, delta]
                  ["err", rid, status, message]  ["ok", rid]  ["event", rid, SSE text]
                  ["done", rid, JSON or None]  ["stats", nonce, {model: {...}}]
Outputs travel as deltas (`RequestOutputKind.DELTA`).
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
    """A plain ZeroMQ socket: sends never block (no high-water mark), reads through `receive`."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address) if bind else sock.connect(address)
    return sock


async def receive(sock: zmq.Socket) -> AsyncIterator[bytes]:
    """Every message of `sock`, read in the event loop; each wake-up drains the edge-triggered
    descriptor until EVENTS says nothing is left."""
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
    """`out` as lists (its request id and prompt travel apart)."""
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
