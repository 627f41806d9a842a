"""The arithmetic PRM's input format and scoring, as the training scripts use them.

Math-Shepherd style: the input is the chat prompt, then the steps joined by the step
separator with the step tag right after each step,

    <|bos|><|user|>{problem}<|end|><|assistant|>{step 1}<|step|>\\n\\n{step 2}<|step|>...

and the score of step i is P(good) = softmax([logit('+'), logit('-')])[0] at the position
of the i-th tag (the label token is the next-token target at the tag).
"""

from __future__ import annotations

import numpy as np

from tools.arith.common import (
    BAD_ID,
    BAD_TOKEN,
    GOOD_ID,
    GOOD_TOKEN,
    PAD_ID,
    STEP_TAG,
    STEP_TAG_ID,
    encode_text,
    prompt_ids,
)

STEP_SEPARATOR = "\n\n"
PRM_FORMAT = {
    "style": "step_tag",
    "step_tag": STEP_TAG,
    "step_tag_id": STEP_TAG_ID,
    "good_token": GOOD_TOKEN,
    "good_token_id": GOOD_ID,
    "bad_token": BAD_TOKEN,
    "bad_token_id": BAD_ID,
    "step_separator": STEP_SEPARATOR,
    "prompt_format": "<|bos|><|user|>{problem}<|end|><|assistant|>",
    "step_format": "{step}<|step|>",
    "input_format": "prompt_format + step_separator.join(step_format for each step)",
    "score": "softmax over [logit(good_token), logit(bad_token)] at each step tag; P(good)",
    "use_chat_template": False,
}


def prm_input(problem: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """Token ids of the PRM input and the positions of the step tags."""
    ids = prompt_ids(problem)
    tags: list[int] = []
    for i, step in enumerate(steps):
        if i:
            ids.extend(encode_text(STEP_SEPARATOR))
        ids.extend(encode_text(step.strip()))
        tags.append(len(ids))
        ids.append(STEP_TAG_ID)
    return ids, tags


def score_steps(model, items: list[tuple[str, list[str]]], batch_tokens: int = 8192) -> list[list[float]]:
    """P(good) of every step of every (problem, steps) item."""
    import torch

    encoded = [prm_input(problem, steps) for problem, steps in items]
    order = sorted(range(len(items)), key=lambda i: len(encoded[i][0]))
    scores: list[list[float]] = [[] for _ in items]
    start = 0
    with torch.no_grad():
        while start < len(order):
            width = len(encoded[order[start]][0])
            end = start
            while end < len(order) and (end - start + 1) * len(encoded[order[end]][0]) <= batch_tokens:
                end += 1
            end = max(end, start + 1)
            chunk = order[start:end]
            width = max(len(encoded[i][0]) for i in chunk)
            input_ids = torch.full((len(chunk), width), PAD_ID, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids = encoded[i][0]
                input_ids[row, : len(ids)] = torch.tensor(ids)
            logits = model(input_ids=input_ids).logits.float()  # right padding: causal is enough
            pair = logits[..., [GOOD_ID, BAD_ID]].softmax(-1)[..., 0]
            for row, i in enumerate(chunk):
                scores[i] = pair[row, encoded[i][1]].tolist()
            start = end
    return scores


def roc_auc(scores: list[float], labels: list[bool]) -> float:
    """Area under the ROC curve (Mann-Whitney U with average ranks for ties); NaN if one class."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
