"""Ranks as Ray actors (`distributed_executor_backend="ray"`): one host's Ray cluster stands in
for several hosts (the actors meet rank 0 at its node IP, not at 127.0.0.1). The same outputs
as one rank, a killed actor a clear error, a cluster without room refused, and nothing left
behind (actors dead, placement group removed)."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from tests.engine.test_parallel import PROMPTS, outputs
from tests.tiny_models import build_checkpoint
from treeserve import LLM, SamplingParams

ray = pytest.importorskip("ray")
from ray.util import placement_group_table  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama", num_hidden_layers=3)


def groups_removed() -> bool:
    return all(v["state"] == "REMOVED" for v in placement_group_table().values())


@pytest.mark.parametrize("kind", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_ray_ranks_give_one_ranks_outputs(cluster, checkpoint, make_llm, monkeypatch, kind):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # a bundle of one CPU: the rank's threads
    one = outputs(make_llm(checkpoint))
    llm = make_llm(checkpoint, distributed_executor_backend="ray", **{kind: 2})
    two = outputs(llm)
    assert two[0] == one[0] and two[1] == one[1]
    assert torch.allclose(two[2], one[2], atol=1e-5, rtol=0)
    [part] = llm.engine.ranks.parts
    assert part["weights"] > 0 and part["kv_token_bytes"] > 0
    [rank1] = llm.engine.ranks.handles
    assert "Ray actor" in rank1.state() and "still running" in rank1.state()
    llm.engine.close()
    assert rank1.exited(5.0) and groups_removed()


def test_a_killed_actor_is_a_clear_error(cluster, checkpoint, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    llm = LLM(
        checkpoint,
        dtype="float32",
        kv_cache_memory=8 << 20,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        parallel_timeout_s=10.0,
    )
    engine, [rank1] = llm.engine, llm.engine.ranks.handles
    for i in range(8):
        engine.add_request(str(i), PROMPTS[i % 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    threading.Timer(0.5, ray.kill, (rank1.actor,)).start()
    start = time.monotonic()
    with pytest.raises(Exception, match="rank 1") as failure:
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10.0 + 5.0
    # seen in a collective ("died during a step") or, when Ray reports the death first, as rank 0
    # sends (its check of the ranks, or its send to the dead actor: "exited" either way)
    assert re.search(r"rank 1 (died during a step|exited) \(.*ActorDiedError", str(failure.value))
    engine.add_request("again", PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(Exception, match="ranks were stopped"):
        while engine.has_unfinished_requests():
            engine.step()
    engine.check_pages_idle()
    assert groups_removed()


def test_a_cluster_without_room_is_refused(cluster, checkpoint, monkeypatch):
    """Three one-CPU ranks on a two-CPU cluster: refused after the timeout, nothing reserved."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    with pytest.raises(ValueError, match=r"the Ray cluster has no room for 3 ranks of \{'CPU': 1\}"):
        LLM(
            checkpoint,
            dtype="float32",
            kv_cache_memory=8 << 20,
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
            parallel_timeout_s=2.0,
        )
    assert groups_removed()


def test_the_backend_reaches_each_parallel_model_and_a_bad_one_is_refused():
    from treeserve.eval.runner import DEFAULT_GENERATOR, DEFAULT_PRM, EvalSettings
    from treeserve.runtime.model_settings import ModelSettings

    prm = ModelSettings.from_flat(DEFAULT_PRM, tensor_parallel_size=2, distributed_executor_backend="ray")
    parallel = prm.engine_args()["parallel_config"]
    assert (parallel.tensor_parallel_size, parallel.distributed_executor_backend) == (2, "ray")
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EvalSettings(
            generator=ModelSettings.from_flat(DEFAULT_GENERATOR, distributed_executor_backend="threads")
        ).check()
