"""The Triton sampler's draw against the PyTorch inverse CDF (`sampler._draw`), and its batch invariance.

Exact agreement with `_draw` is asserted for every row whose uniform lies at least 1e-5
from each bucket edge of the exact (float64) CDF; the two fp32 computations sum in
different orders, so within that distance of an edge either neighbour is a correct draw,
and those rows are only checked to land in a bucket whose edges are within 1e-5 of u.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from treeserve.engine.sampler import SamplingBatch, _draw, seeded_uniform  # noqa: E402
from treeserve.kernels.triton import sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EDGE = 1e-5


def draw(logits: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    return sampling.sample_rows(logits, torch.tensor(uniforms, dtype=torch.float64, device=DEVICE))


def uniforms(rows: int) -> list[float]:
    return [seeded_uniform(7, i, 3) for i in range(rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 700, 3000])  # one entry, under one block, several blocks with a ragged tail
def test_draw_matches_the_inverse_cdf(vocab, dtype):
    logits = (torch.randn(48, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(DEVICE, dtype)
    u = uniforms(48)
    got = draw(logits, u).cpu()
    want = _draw(logits, SamplingBatch.of(1.0, 1.0, 0, 0.0, u)).cpu()
    cdf = torch.softmax(logits.cpu().double(), dim=-1).cumsum(-1)
    lower = torch.cat([torch.zeros(48, 1, dtype=torch.float64), cdf[:, :-1]], 1)
    u = torch.tensor(u, dtype=torch.float64)
    near_edge = ((cdf - u[:, None]).abs() < EDGE).any(1)
    assert torch.equal(got[~near_edge], want[~near_edge])
    assert near_edge.sum() <= 4
    rows = torch.arange(48)
    assert bool(((lower[rows, got] - EDGE <= u) & (u < cdf[rows, got] + EDGE)).all())  # got's bucket holds u


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_draws_the_same_token_alone_and_in_a_batch(dtype):
    logits = (torch.randn(32, 2100, generator=torch.Generator().manual_seed(1)) * 2).to(DEVICE, dtype)
    u = uniforms(32)
    batch = draw(logits, u)
    for i in (0, 13, 31):
        assert draw(logits[i : i + 1], u[i : i + 1]).item() == batch[i].item()
        assert draw(logits[i : i + 5], u[i : i + 5])[0].item() == batch[i].item()


def test_masked_tokens_are_never_drawn():
    """-inf logits (a padded vocabulary) have no bucket, even for u at the very top."""
    logits = torch.full((3, 2500), float("-inf"), device=DEVICE)
    logits[:, [5, 1500]] = torch.tensor([0.0, 1.0], device=DEVICE)
    assert draw(logits, [0.0, 0.2, 1.0 - 2**-53]).tolist() == [5, 5, 1500]
