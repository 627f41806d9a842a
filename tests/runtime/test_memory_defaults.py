"""The memory a runtime takes when not told: GPU-sized on CUDA (a share of free memory, as vLLM),
1 GiB of KV on a CPU. CUDA is substituted: these machines have none."""

from __future__ import annotations

import torch

from treeserve.config import DEFAULT_KV_CAP, GPU_MEMORY_FRACTION, EngineConfig
from treeserve.runtime import planner


def test_a_runtime_on_cuda_takes_a_share_of_free_memory():
    assert planner.default_budget(torch.device("cuda")) == (None, GPU_MEMORY_FRACTION)
    assert planner.default_budget(torch.device("cuda:1")) == (None, 0.9)


def test_a_runtime_on_a_cpu_keeps_its_kv_cap():
    assert planner.default_budget(torch.device("cpu")) == (DEFAULT_KV_CAP, None)


def test_one_engine_on_cuda_is_not_capped_at_one_gib(llama_dir):
    config = EngineConfig.from_kwargs(model=llama_dir, device="cpu")
    free = 70 << 30  # what an 80 GB card has free once an 8B model's weights are in
    assert config.kv_budget(free) == DEFAULT_KV_CAP
    config.device_config.device = "cuda"  # as resolved on a GPU machine
    assert config.kv_budget(free) == int(0.9 * free)
    assert config.kv_budget(free) >= 8 * DEFAULT_KV_CAP
    config.arena_config.kv_cache_memory = 123 << 20  # a size given is kept everywhere
    assert config.kv_budget(free) == 123 << 20
