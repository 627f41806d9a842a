"""Both models at once (`overlap_models`): on CUDA each engine's steps run on a stream of its
own, the generator's at the higher priority, and a search gives the beams and answers of the
models run in turn; on a CPU the setting is accepted and changes nothing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from treeserve.config import DeviceConfig
from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM
from treeserve.runtime.model_settings import ModelSettings
from treeserve.runtime.runtime import Runtime
from treeserve.runtime.runtime_settings import RuntimeSettings
from treeserve.search.config import SearchConfig
from treeserve.search.context import SearchContext
from treeserve.search.prm import load_prm
from treeserve.search.run import search_problems

PROBLEMS = [("a", "Compute (12 + 7) * 3."), ("b", "Compute 45 - 17 + 8."), ("c", "Compute 6 * 7 - 5.")]


def beams(device: str, overlap: bool) -> tuple[list, Runtime]:
    """Beam search (N=8, sampled) on the shipped arithmetic models: every problem's beams, their
    text and step scores."""
    runtime = Runtime.for_search(
        DEFAULT_GENERATOR,
        DEFAULT_PRM,
        32 << 20,
        device_config=DeviceConfig(device, dtype="float32"),
        overlap_models=overlap,
    )
    config = SearchConfig(n=8, beam_width=2, num_iterations=4, temperature=0.8, seed=3)
    ctx = SearchContext(config, runtime, "generator", load_prm(runtime, "prm", None))
    results = asyncio.run(search_problems(ctx, PROBLEMS))
    asyncio.run(runtime.close())
    runtime.check_pages_idle()
    return [[(b.text, b.scores) for b in r.beams] for r in results], runtime


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="overlap_models must be True, False or None"):
        RuntimeSettings.from_flat(device="cpu", overlap_models="yes").check(ModelSettings(DEFAULT_GENERATOR), None)


def test_the_default_is_on_with_cuda_only():
    settings = RuntimeSettings.from_flat(device="cpu")
    settings.check(ModelSettings(DEFAULT_GENERATOR), None)
    assert settings.overlap_models is False


def test_on_a_cpu_it_is_accepted_and_changes_nothing():
    overlapped, runtime = beams("cpu", True)
    assert all(e.queue.stream is None for e in runtime.engines.values())
    assert overlapped == beams("cpu", False)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_two_streams_give_the_serial_search():
    overlapped, runtime = beams("cuda", True)
    generator, prm = runtime.engine("generator").queue.stream, runtime.engine("prm").queue.stream
    assert generator is not None and prm is not None and generator != prm
    assert generator.priority < prm.priority  # the generator's stream goes first
    assert overlapped == beams("cuda", False)[0]
