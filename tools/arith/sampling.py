"""Batched generation with treeserve's own engine, for evaluation and on-policy PRM data.

Prompts go through the checkpoint's chat template (`LLM.chat`); greedy or plain
temperature sampling (top-k and top-p off), seeded per request so that every sample is
reproducible. The weights are evaluated in fp32, as the model card reports them.
"""

from __future__ import annotations

from pathlib import Path

from treeserve import LLM, SamplingParams


def max_new_tokens_for(level: int) -> int:
    """Room for a level's longest reference solution plus slack for wrong detours."""
    return {1: 56, 2: 96, 3: 144, 4: 192, 5: 240}.get(level, 256)


def load_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=256 << 20)


def generate(
    llm: LLM,
    problems: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    n: int = 1,
    seed: int = 0,
) -> list[list[str]]:
    """`n` completions per problem (texts without the EOS), in problem order."""
    params = [
        SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=seed * 1_000_003 + i)
        for i in range(len(problems))
    ]
    outputs = llm.chat([[{"role": "user", "content": p}] for p in problems], params)
    return [[c.text for c in out.outputs] for out in outputs]
