"""The Triton sampler's draw against the PyTorch inverse CDF (`sampler._draw`), and its batch invariance.

Exact agreement with `_draw` is asserted for every row whose uniform lies at least 1e-5
from each bucket edge of the exact (float64) CDF; the two fp32 computations sum in
different orders, so within that distance of an edge either neighbour is a correct draw,
and those rows are only checked to land in a bucket whose edges are within 1e-5 of u.
The kernel splits the vocabulary into chunks of `sampling.CHUNK` (Llama 3's 128256 ids
make 63 of 2048); the tests below place targets and probability mass by that constant.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")

from treeserve.engine.sampler import SamplingBatch, _draw, seeded_uniform  # noqa: E402
from treeserve.kernels.triton import sampling  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EDGE = 1e-5
LLAMA3 = 128256


def draw(logits: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    return sampling.sample_rows(logits, torch.tensor(uniforms, dtype=torch.float64, device=DEVICE))


def uniforms(rows: int) -> list[float]:
    return [seeded_uniform(7, i, 3) for i in range(rows)]


def in_bucket(logits: torch.Tensor, u: list[float], got: torch.Tensor) -> bool:
    """Each row's token is a bucket of the exact (float64) CDF whose edges are within EDGE of its u."""
    cdf = torch.softmax(logits.cpu().double(), dim=-1).cumsum(-1)
    lower = torch.cat([torch.zeros(len(u), 1, dtype=torch.float64), cdf[:, :-1]], 1)
    rows, u, got = torch.arange(len(u)), torch.tensor(u, dtype=torch.float64), got.cpu()
    return bool(((lower[rows, got] - EDGE <= u) & (u < cdf[rows, got] + EDGE)).all())


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draw_keeps_to_the_inverse_cdf_over_llama3s_vocabulary(dtype):
    """128256 ids in 63 chunks: buckets are ~1e-5 wide, so most rows lie near an edge; every
    token's bucket must hold u, and nearly all must be `_draw`'s."""
    logits = (torch.randn(8, LLAMA3, generator=torch.Generator().manual_seed(2)) * 3).to(DEVICE, dtype)
    u = uniforms(8)
    got = draw(logits, u)
    want = _draw(logits, SamplingBatch.of(1.0, 1.0, 0, 0.0, u))
    assert (got == want).sum() >= 7
    assert in_bucket(logits, u, got)


def test_a_row_draws_the_same_token_alone_and_in_a_batch_over_llama3s_vocabulary():
    logits = (torch.randn(6, LLAMA3, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE, torch.bfloat16)
    u = uniforms(6)
    batch = draw(logits, u)
    for i in (0, 2, 5):
        assert draw(logits[i : i + 1], u[i : i + 1]).item() == batch[i].item()
    assert torch.equal(draw(logits[3:], u[3:]), batch[3:])


def test_mass_in_a_late_chunk_is_drawn_from_it():
    """Nearly all the probability in a few hundred ids of the second-to-last chunk."""
    logits = torch.randn(4, LLAMA3, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    late = (LLAMA3 // sampling.CHUNK - 1) * sampling.CHUNK + 300
    logits[:, late : late + 200] += 30.0
    u = [0.01, 0.25, 0.5, 0.99]  # (0 and 1 - 2**-53 would draw the first and last token: e**-30 > 0 in fp32)
    got = draw(logits, u)
    assert bool(((got >= late) & (got < late + 200)).all())
    assert torch.equal(got, _draw(logits, SamplingBatch.of(1.0, 1.0, 0, 0.0, u)))
    assert in_bucket(logits, u, got)


def test_a_row_with_one_live_token_draws_it():
    """All but one token masked: the first, one mid-vocabulary, the last; for any u."""
    logits = torch.full((9, LLAMA3), float("-inf"), device=DEVICE)
    live = [0, 0, 0, 77777, 77777, 77777, LLAMA3 - 1, LLAMA3 - 1, LLAMA3 - 1]
    logits[torch.arange(9), live] = 5.0
    assert draw(logits, [0.0, 0.5, 1.0 - 2**-53] * 3).tolist() == live


def test_u_near_one_takes_the_last_live_token_of_a_padded_vocabulary():
    """u * total rounds up to the total: the last token of nonzero probability, never padding."""
    logits = torch.randn(2, LLAMA3, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    logits[:, 128000:] = float("-inf")
    logits[1, sampling.CHUNK :] = float("-inf")  # the last live token alone past a run of masked chunks
    logits[1, 127998] = 0.0
    assert draw(logits, [1.0 - 2**-53] * 2).tolist() == [127999, 127998]


def test_targets_at_chunk_edges():
    """Equal logits make every cdf an integer count (exact in fp32, unlike softmax's 1 / V steps
    that `_draw` sums), so the draw is exact, i.e. the float64 searchsorted's, at each
    chunk edge: the target just under, at and just over the cdf at an edge; and across a chunk
    with no weight at all (every token masked), whose edge cdf equals the one before it."""
    chunk = sampling.CHUNK
    vocab = 3 * chunk + 77
    cases = [(edge, d) for edge in (chunk, 2 * chunk, 3 * chunk) for d in (-1.0, -0.5, 0.0, 0.5, 1.0)]
    u = [(edge + d) / vocab for edge, d in cases]
    logits = torch.zeros(len(cases) + 3, vocab, device=DEVICE)
    logits[-3:, chunk : 2 * chunk] = float("-inf")  # the last three rows: chunk 1 masked
    u += [0.5 * chunk / (vocab - chunk) * k for k in (1.0, 2.0)] + [1.0 - 2**-53]
    target = (torch.tensor(u, dtype=torch.float64) * torch.tensor([vocab] * len(cases) + [vocab - chunk] * 3)).float()
    first_over = target.floor().long()  # the cdf at index i counts i + 1 live tokens
    first_over[-3:] += (first_over[-3:] >= chunk).long() * chunk  # skip the masked chunk
    first_over[-1] = vocab - 1
    assert draw(logits, u).tolist() == first_over.tolist()


def test_targets_near_chunk_edges_of_a_random_row():
    """u within 1e-7 of the exact cdf at each chunk edge of random rows: a token at the edge's
    bucket on either side, as rounding at a bucket edge allows."""
    chunk = sampling.CHUNK
    logits = (torch.randn(1, 4 * chunk + 5, generator=torch.Generator().manual_seed(6)) * 3).to(DEVICE)
    cdf = torch.softmax(logits.cpu().double(), dim=-1).cumsum(-1)[0]
    u = [float(cdf[k * chunk - 1]) + d for k in (1, 2, 3, 4) for d in (-1e-7, 0.0, 1e-7)]
    rows = logits.expand(len(u), -1).contiguous()
    got = draw(rows, u)
    assert in_bucket(rows, u, got)
    assert bool(((got - torch.tensor([k * chunk for k in (1, 2, 3, 4) for _ in range(3)])).abs() <= 3).all())
