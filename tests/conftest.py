"""Shared fixtures: tiny checkpoints (built once per session) and engines checked for page leaks."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import build_checkpoint
from treeserve import LLM

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
