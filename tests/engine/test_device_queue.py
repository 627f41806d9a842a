"""The device queue's fences (engine/device_queue.py): an engine's step that writes pages another
engine released starts only after that engine's steps that may still use them.

On a CPU the marker is the future of the other queue's latest step on the device's worker: a
step `run` on the calling thread (steps not overlapped) waits for it, a step submitted to the
same worker runs after it in any case. With a shared arena, each engine fences on the engines
it took pages from (`PagePool.take_handovers`) before it launches.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from treeserve import SamplingParams
from treeserve.engine.device_queue import DeviceQueue
from treeserve.engine.inference_mode import inference_mode
from treeserve.engine.llm_engine import share_kv

CPU = torch.device("cpu")


def slow_step(done: threading.Event) -> None:
    time.sleep(0.3)
    done.set()


def test_a_step_run_here_waits_for_the_fenced_work_of_another_queue():
    overlapped, plain = DeviceQueue(CPU), DeviceQueue(CPU)
    done = threading.Event()
    overlapped.submit(slow_step, done)
    plain.wait(overlapped.fence())
    assert plain.run(done.is_set).result()  # it ran after the other queue's step

    unfenced = threading.Event()
    overlapped.submit(slow_step, unfenced)
    assert not plain.run(unfenced.is_set).result()  # without the fence it would not have waited
    overlapped.fence()  # (and a fence nobody waits on changes nothing)


def test_work_run_here_gives_its_result_or_raises_its_error_when_read():
    queue = DeviceQueue(CPU)
    ran = queue.run(lambda x: x + 1, 41)
    assert ran.done() and ran.result() == 42
    failed = queue.run(lambda: 1 // 0)  # the error is kept, not raised, until the step is read
    assert failed.done()
    with pytest.raises(ZeroDivisionError):
        failed.result()


@pytest.mark.parametrize("caller_in_inference_mode", [True, False])
def test_step_functions_run_in_inference_mode_whatever_the_caller(caller_in_inference_mode):
    """`engine/inference_mode.py`: the step runs in inference mode, entered only when the caller
    is not in it, and the caller's own mode is as it was afterwards."""
    seen = []

    @inference_mode
    def step(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_inference_mode_enabled())
        return x * 2

    with torch.inference_mode(caller_in_inference_mode):
        out = step(torch.ones(2))
        assert torch.is_inference_mode_enabled() == caller_in_inference_mode
    assert seen == [True] and out.is_inference()


def test_nothing_in_flight_is_no_fence():
    queue = DeviceQueue(CPU)
    assert queue.fence() is None
    queue.submit(lambda: None).result()
    assert queue.fence() is None  # its work is done


def test_engines_fence_on_the_engines_they_took_pages_from(llama_dir, make_llm):
    """Two engines on one arena, one with overlapped steps and one without, pages flowing between
    them: each launch that uses pages the other released waits on the other's latest step, and
    both give the outputs they give alone."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["one two three four five", "six seven eight", "nine ten eleven twelve thirteen"]
    alone = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate(prompts, params)]
    engines = [make_llm(llama_dir, async_scheduling=overlap, max_model_len=48).engine for overlap in (True, False)]
    share_kv(engines, 10 * engines[0].kv_layout.page_bytes(16))  # 10 pages for 6 sequences: pages change hands
    fences = []
    for engine in engines:
        inner = engine.queue.wait
        engine.queue.wait = lambda fence, inner=inner: (fences.append(fence), inner(fence))
    outputs: dict[str, list[int]] = {}
    for round_ in range(4):
        for e, engine in enumerate(engines):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{round_}-{e}-{i}", prompt, params)
            if e == 0:  # the first takes its pages before the other asks (each takes back its own pages first)
                engine.step()
        while any(engine.has_unfinished_requests() for engine in engines):
            for engine in engines:
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.outputs[0].token_ids
    assert fences  # pages were handed over, and launches fenced on them
    for request_id, tokens in outputs.items():
        assert tokens == alone[int(request_id.rsplit("-", 1)[1])], request_id
    for engine in engines:
        engine.check_pages_idle()
