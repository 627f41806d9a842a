"""The FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`): every kernel family against PyTorch's conversion.

The reference stores K/V through `.to(torch.float8_e4m3fn)` (of x * (1 / scale) in fp32:
`engine.attention.to_fp8`) and reads them back as e4m3 * scale (`from_fp8`). Writes are
bit-exact (every bf16 value, and fp32 edge cases: ties, subnormals, saturation, infinities);
attention over the rounded K/V is within fp32 tolerance of SDPA over the same dequantised K/V,
in the C kernels (decode and prefill chunks, fp32 and bf16 queries) and the Triton kernels (in
the interpreter without a GPU). Engine level: greedy generation runs on every backend with
its pages accounted for, the same bytes hold twice the pages of bf16, and a wrong setting is
refused naming the allowed values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treeserve import SamplingParams
from treeserve.engine.attention import from_fp8, to_fp8
from treeserve.kernels import cpu as cpu_kernels
from treeserve.kv.arena import FP8, KVArena

needs_c = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels are not built here")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALES = [(1.0, 1.0), (0.5, 2.0), (0.37, 1.7)]  # (k_scale, v_scale): vLLM's default, powers of two, others
EDGES = [
    0.0,
    -0.0,
    448.0,
    -448.0,
    449.0,
    464.0,
    465.0,
    479.0,
    480.0,
    1e30,
    -1e30,
    float("inf"),
    float("-inf"),
    2**-6,
    2**-7,
    2**-9,
    2**-10,
    3 * 2**-10,
    5 * 2**-10,
    2**-9 * 0.5000001,
    1e-45,
    15 * 2**-7,
    0.0625 * 17 / 16,
]


def every_bf16(width: int) -> torch.Tensor:
    """Every bf16 bit pattern but NaN's, as rows [n, 1, width] (padded with zeros)."""
    x = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[~x.isnan()]
    x = torch.cat([x, torch.zeros(-x.numel() % width, dtype=torch.bfloat16)])
    return x.reshape(-1, 1, width).contiguous()


def fp8_arena(num_pages: int, layers: int, block: int, heads: int, dim: int, device: str = "cpu") -> KVArena:
    return KVArena(num_pages, layers, block, heads, dim, FP8, device)


def store_all(store, k: torch.Tensor, v: torch.Tensor, scales: tuple[float, float], device: str = "cpu"):
    """Rows of k/v into slot (page t, offset 0) of a one-layer arena through `store`; -> the
    caches' bytes and the reference's."""
    rows = k.shape[0]
    arena = fp8_arena(rows, 1, 1, k.shape[1], k.shape[2], device)
    k_cache, v_cache = arena.layer(0)
    kv_scales = torch.tensor(scales, device=device)
    pages, offsets = torch.arange(rows, device=device), torch.zeros(rows, dtype=torch.int64, device=device)
    store(k.to(device), v.to(device), k_cache, v_cache, pages, offsets, kv_scales)
    want_k, want_v = to_fp8(k, torch.tensor(scales[0])), to_fp8(v, torch.tensor(scales[1]))
    got = k_cache.reshape(k.shape).cpu(), v_cache.reshape(v.shape).cpu()
    return [t.view(torch.uint8) for t in got], [t.view(torch.uint8) for t in (want_k, want_v)]


def c_store(k, v, k_cache, v_cache, pages, offsets, kv_scales) -> None:
    assert cpu_kernels.store_kv(k, v, k_cache, v_cache, pages, offsets, kv_scales)


def test_reference_conversion_saturates_and_rounds_to_even():
    """What the reference relies on: PyTorch's e4m3fn conversion saturates (infinities too) and ties go to even."""
    codes = to_fp8(torch.tensor([1e30, float("inf"), -500.0, 3 * 2**-10, 2**-10]), torch.tensor(1.0))
    assert codes.view(torch.uint8).tolist() == [0x7E, 0x7E, 0xFE, 2, 0]
    assert from_fp8(codes, torch.tensor(2.0), torch.float32).tolist() == [896.0, 896.0, -896.0, 2**-7, 0.0]


@needs_c
@pytest.mark.parametrize("scales", SCALES, ids=str)
def test_c_store_is_bit_exact(scales):
    x = every_bf16(64)
    got, want = store_all(c_store, x, -x, scales)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    edges = torch.tensor(EDGES).reshape(-1, 1, 1)
    got, want = store_all(c_store, edges, edges * 3, scales)  # fp32 rows
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def fp8_pages(contexts: list[int], block: int, heads: int, dim: int, scales: tuple[float, float], device: str):
    """Layer 1 of a 2-layer FP8 arena holding random K/V stored through the reference, shuffled
    page tables, and the layer's scales."""
    g = torch.Generator().manual_seed(0)
    widths = [-(-c // block) for c in contexts]
    num_pages = sum(widths) + 3
    arena = fp8_arena(num_pages, 2, block, heads, dim, device)
    values = torch.randn(arena.buffer.shape, generator=g) * 3
    arena.buffer.copy_(to_fp8(values, torch.tensor(1.0)).to(device))
    arena.scales[1] = torch.tensor(scales)
    order = torch.randperm(num_pages, generator=g)
    tables = torch.zeros(len(contexts), max(widths), dtype=torch.int64)
    used = 0
    for b, width in enumerate(widths):
        tables[b, :width] = order[used : used + width]
        used += width
    return *arena.layer(1), tables.to(device), arena.layer_scales(1)


def reference(q, q_pos, k_cache, v_cache, table, context, scale, window, kv_scales):
    """fp32 SDPA of one sequence's queries q [Q, Hq, D] over its pages, read as e4m3 * scale."""
    kv_heads, dim = k_cache.shape[2:]
    keys = from_fp8(k_cache[table].reshape(-1, kv_heads, dim)[:context].cpu(), kv_scales[0].cpu(), torch.float32)
    values = from_fp8(v_cache[table].reshape(-1, kv_heads, dim)[:context].cpu(), kv_scales[1].cpu(), torch.float32)
    pos = torch.arange(context)
    allowed = pos[None, :] <= q_pos[:, None]
    if window:
        allowed &= pos[None, :] > q_pos[:, None] - window
    queries = q.float().cpu().transpose(0, 1)
    out = F.scaled_dot_product_attention(
        queries, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=allowed, scale=scale, enable_gqa=True
    )
    return out.transpose(0, 1)


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # bf16: the output's rounding (on a GPU q and p's too)
CASES = [  # (page_size, q_heads, kv_heads, head_dim, window)
    (4, 4, 4, 16, None),
    (16, 8, 2, 64, 7),
    (1, 4, 1, 32, None),
    (16, 2, 2, 128, 20),
]


def check_decode(decode, case, dtype, scales, device="cpu"):
    block, q_heads, kv_heads, dim, window = case
    contexts = [1, 5, 33, 70]
    k_cache, v_cache, tables, kv_scales = fp8_pages(contexts, block, kv_heads, dim, scales, device)
    q = torch.randn(len(contexts), q_heads, dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    lens = torch.tensor(contexts, device=device)
    got = decode(q, k_cache, v_cache, tables, lens, dim**-0.5, window, kv_scales)
    assert got.dtype == dtype and got.shape == q.shape
    for b, context in enumerate(contexts):
        position = torch.tensor([context - 1])
        want = reference(q[b : b + 1], position, k_cache, v_cache, tables[b], context, dim**-0.5, window, kv_scales)
        torch.testing.assert_close(got[b].float().cpu(), want[0], atol=TOL[dtype], rtol=TOL[dtype])


def check_prefill(prefill, case, dtype, scales, device="cpu"):
    """Chunks after cached prefixes ((cached, chunk) per sequence), a row of another group before each."""
    block, q_heads, kv_heads, dim, window = case
    chunks = [(0, 9), (9, 1), (12, 17), (30, 5)]
    contexts = [cached + n for cached, n in chunks]
    k_cache, v_cache, tables, kv_scales = fp8_pages(contexts, block, kv_heads, dim, scales, device)
    lens = torch.tensor([n for _, n in chunks])
    starts = torch.cumsum(lens + 1, 0) - lens
    rows = int(starts[-1] + lens[-1])
    q = torch.randn(rows, q_heads, dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    out = torch.full_like(q, float("nan"))
    chunk_args = starts.to(device), lens.to(device), torch.tensor(contexts, device=device)
    prefill(q, k_cache, v_cache, tables, *chunk_args, dim**-0.5, window, out, kv_scales)
    assert out[starts - 1].isnan().all()
    for b, (cached, n) in enumerate(chunks):
        mine = slice(int(starts[b]), int(starts[b]) + n)
        positions = torch.arange(cached, cached + n)
        want = reference(q[mine], positions, k_cache, v_cache, tables[b], cached + n, dim**-0.5, window, kv_scales)
        torch.testing.assert_close(out[mine].float().cpu(), want, atol=TOL[dtype], rtol=TOL[dtype])


def c_decode(q, k_cache, v_cache, tables, lens, scale, window, kv_scales):
    return cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, scale, window, kv_scales=kv_scales)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_c_decode_matches_the_reference(case, dtype):
    check_decode(c_decode, case, dtype, SCALES[2])


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_c_prefill_matches_the_reference(case, dtype):
    assert cpu_kernels.prefill_supports(torch.zeros(2, 2, 16, dtype=dtype), FP8)
    check_prefill(cpu_kernels.paged_prefill, case, dtype, SCALES[2])


# ---- Triton (a GPU, or CPU tensors in the interpreter) ----------------------------------------


def triton_modules():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it)")
    from treeserve.kernels.triton import decode_attention, kv_store, prefill_attention, rope_kv

    return decode_attention, kv_store, prefill_attention, rope_kv


@pytest.mark.parametrize("scales", SCALES[1:], ids=str)
def test_triton_store_is_bit_exact(scales):
    _, kv_store, _, _ = triton_modules()
    x = every_bf16(64 * 256).reshape(-1, 64, 256)  # 4 programs: one a token
    got, want = store_all(kv_store.store_kv, x, -x, scales, DEVICE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    edges = torch.tensor(EDGES + [0.0] * (32 - len(EDGES))).reshape(1, 2, 16)
    got, want = store_all(kv_store.store_kv, edges, edges * 3, scales, DEVICE)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_triton_decode_matches_the_reference(case, dtype):
    decode_attention, _, _, _ = triton_modules()

    def decode(q, k_cache, v_cache, tables, lens, scale, window, kv_scales):
        return decode_attention.paged_decode(q, k_cache, v_cache, tables, lens, scale, window, 16, kv_scales=kv_scales)

    check_decode(decode, case, dtype, SCALES[2], DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES[:2], ids=str)
def test_triton_prefill_matches_the_reference(case, dtype):
    _, _, prefill_attention, _ = triton_modules()

    def prefill(q, k_cache, v_cache, tables, starts, lens, contexts, scale, window, out, kv_scales):
        args = (q, k_cache, v_cache, tables, starts, lens, contexts, scale, window, out)
        prefill_attention.paged_prefill(*args, kv_scales=kv_scales)

    check_prefill(prefill, case, dtype, SCALES[2], DEVICE)


def test_triton_rope_store_writes_the_unfused_paths_bytes():
    """Rotated as stored: the bytes the rope then `to_fp8` of the unfused path store."""
    _, _, _, rope_kv = triton_modules()
    from treeserve.layers.rotary import RotaryEmbedding, rope_inv_freq

    g = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, dim = 5, 4, 2, 32
    q, k, v = (
        torch.randn(tokens, h, dim, generator=g).to(DEVICE, torch.bfloat16) for h in (q_heads, kv_heads, kv_heads)
    )
    rope = RotaryEmbedding(rope_inv_freq(dim, 10000.0, None), 64, DEVICE)
    positions = torch.tensor([0, 3, 7, 8, 20], device=DEVICE)
    arena = fp8_arena(4, 1, 4, kv_heads, dim, DEVICE)
    arena.scales[0] = torch.tensor([0.5, 2.0])
    pages, offsets = torch.tensor([1, 1, 0, 3, 2], device=DEVICE), torch.tensor([0, 3, 1, 2, 3], device=DEVICE)
    rope_kv.rope_store_kv(
        q, k, v, rope.cos, rope.sin, positions, *arena.layer(0), pages, offsets, arena.layer_scales(0)
    )
    _, k_rot = rope(q, k, positions)
    k_cache, v_cache = arena.layer(0)
    want_k, want_v = to_fp8(k_rot, arena.scales[0, 0]), to_fp8(v, arena.scales[0, 1])
    assert torch.equal(k_cache[pages, offsets].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache[pages, offsets].view(torch.uint8), want_v.view(torch.uint8))


# ---- the engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "cpu"])
def test_greedy_generation_runs_on_fp8_pages(llama_dir, make_llm, backend):
    """fp32 model: the C kernels and the SDPA reference pick the same tokens over FP8 pages, and
    every page is free or cached afterwards (`make_llm`); prefix-cache hits read the FP8 pages back."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox jumps over", "Once upon a time, in a land far away"]
    llm = make_llm(llama_dir, attention_backend=backend, kv_cache_dtype="fp8_e4m3", page_size=4)
    assert llm.engine.arena.buffer.dtype == FP8
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    again = llm.generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in again) and [o.outputs[0].token_ids for o in again] == first
    reference = make_llm(llama_dir, attention_backend="sdpa", kv_cache_dtype="fp8_e4m3")
    assert [o.outputs[0].token_ids for o in reference.generate(prompts, params)] == first


def test_greedy_generation_on_the_triton_backend(llama_dir, make_llm):
    triton_modules()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    small = {"page_size": 4, "max_num_batched_tokens": 16, "kv_cache_memory": 1 << 20, "kv_cache_dtype": "fp8_e4m3"}
    want = make_llm(llama_dir, attention_backend="sdpa", **small).generate(["The quick brown fox"], params)
    got = make_llm(llama_dir, attention_backend="triton", device=DEVICE, **small).generate(
        ["The quick brown fox"], params
    )
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_the_same_bytes_hold_twice_the_pages(llama_dir, make_llm):
    bf16 = make_llm(llama_dir, dtype="bfloat16", kv_cache_memory=4 << 20)
    fp8 = make_llm(llama_dir, dtype="bfloat16", kv_cache_memory=4 << 20, kv_cache_dtype="fp8_e4m3")
    assert fp8.engine.kv_layout.token_bytes * 2 == bf16.engine.kv_layout.token_bytes
    assert fp8.engine.pages.num_pages == 2 * bf16.engine.pages.num_pages
    assert fp8.engine.arena.pages.page_bytes == bf16.engine.arena.pages.page_bytes // 2


@pytest.mark.parametrize("value", ["fp8", "float8_e4m3fn", "bfloat16", None])
def test_an_unknown_kv_cache_dtype_is_refused(llama_dir, value):
    from treeserve import LLM
    from treeserve.runtime.model_settings import ModelSettings

    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8_e4m3'\]"):
        LLM(llama_dir, kv_cache_dtype=value)
    if value is not None:  # None is a ModelSettings' "the engine's default"
        with pytest.raises(ValueError, match=r"prm: kv_cache_dtype must be one of"):
            ModelSettings.from_flat(llama_dir, "prm", kv_cache_dtype=value)
