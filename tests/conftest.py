"""Shared fixtures: tiny checkpoints (built once per session) and engines checked for page leaks."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter, which must be
# chosen before triton is first imported (kernels are wrapped when their module loads).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs with overlapped steps (`async_scheduling`), which a CPU leaves off by default:
# every engine, runtime and server the tests build steps overlapped unless a test says otherwise
# (tests/engine/test_steps_not_overlapped.py runs the core engine tests without it).
os.environ.setdefault("TREESERVE_ASYNC_SCHEDULING", "1")

from tests.tiny_models import build_checkpoint  # noqa: E402
from treeserve import LLM  # noqa: E402

# Tiny models gain nothing from a second thread, and when another process keeps a core busy,
# OpenMP spin-waiting makes two threads an order of magnitude slower than one.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return build_checkpoint(str(tmp_path_factory.mktemp("qwen2")), "qwen2", tie_word_embeddings=True)


@pytest.fixture
def make_llm():
    """Build LLMs; after the test, every page of each must be free or held by the prefix cache."""
    made: list[LLM] = []

    def make(model: str, **kwargs) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_memory", 8 << 20)
        llm = LLM(model, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.check_pages_idle()
