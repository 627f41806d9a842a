"""Batched generation with `transformers` for evaluation and on-policy PRM data.

Prompts are rendered with the shipped chat template, left-padded, and decoded with
`model.generate` (greedy, or sampling with plain temperature: top-k and top-p off).
Training-side only; treeserve's engine never imports this.
"""

from __future__ import annotations

import torch

from tools.arith.common import EOS_ID, PAD_ID, build_tokenizer, prompt_ids


def max_new_tokens_for(level: int) -> int:
    """Room for a level's longest reference solution plus slack for wrong detours."""
    return {1: 56, 2: 96, 3: 144, 4: 192, 5: 240}.get(level, 256)


@torch.no_grad()
def generate(
    model,
    problems: list[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    n: int = 1,
    seed: int = 0,
    batch_size: int = 64,
) -> list[list[str]]:
    """`n` completions per problem (texts without the EOS), in problem order."""
    tokenizer = build_tokenizer()
    items = [(i, problem) for i, problem in enumerate(problems) for _ in range(n)]
    outputs: list[list[str]] = [[] for _ in problems]
    torch.manual_seed(seed)
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        encoded = [prompt_ids(problem) for _, problem in chunk]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        sampling = temperature > 0
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_k=0 if sampling else None,
            top_p=1.0 if sampling else None,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
        for row, (index, _) in enumerate(chunk):
            ids = out[row, width:].tolist()
            if EOS_ID in ids:
                ids = ids[: ids.index(EOS_ID)]
            outputs[index].append(tokenizer.decode(ids, skip_special_tokens=True))
    return outputs
