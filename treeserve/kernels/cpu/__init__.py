"""Build once, cache, and call the C kernels of `cpu_kernels.c` beside this file (CPU fast paths).

Kernels: paged decode and prefill attention (over bf16/fp32 pages, or FP8 pages with per-layer
scales: `KV_FP8`), softmax sampling, a bf16 GEMV for linear
layers at small batch, RMSNorm and rotary embeddings; `amx_linear.c` (bf16 linear layers on
AMX tiles: dense panels, or quantised weights dequantised per call) and `quant.py` beside
this file (the matmuls of quantised weights, `quant_kernels.c`) and `layer_stack.py` (every
layer of a step in one call, chaining these) are built the same way. Nothing here knows about models:
`layers/` picks these for a model's layers at load, the engine's `cpu` attention backend
and the sampler call the others.

The library is compiled with the system C compiler at first use (about a second) into
`$TREESERVE_CACHE` (default `~/.cache/treeserve`), keyed by the source, the compiler and the
CPU, and called through ctypes on tensor data pointers. Without a compiler, or with
`TREESERVE_CPU_KERNELS=0`, `load()` returns None and callers use their PyTorch path,
which is also the reference the kernels are tested against.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]  # inputs are finite
# Linked without -ffast-math: with it, GCC < 13 links crtfastmath.o into the shared library,
# whose constructor turns on flush-to-zero for the whole process when the library loads.
LINK_FLAGS = ["-shared", "-fopenmp", "-lmvec", "-lm"]
_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
KV_FP8 = torch.float8_e4m3fn  # the FP8 KV cache's dtype (kv/arena.py's FP8)


def _cpu_signature() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


@cache
def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 itself (AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags).
    Without, PyTorch emulates bf16 products (3-7x slower than fp32 on an AVX2 AMD EPYC); True where
    the flags cannot be read."""
    flags = _cpu_signature().split()
    return not flags or b"avx512_bf16" in flags or b"amx_bf16" in flags


def build(source: Path, flags: list[str] = FLAGS) -> ctypes.CDLL | None:
    """Compile `source` into a shared library (once per source, compiler and CPU) and load it;
    None when kernels are switched off or cannot be built (callers use their PyTorch path)."""
    if os.environ.get("TREESERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        warnings.warn(f"no C compiler found: {source.name} not built, using PyTorch paths", stacklevel=2)
        return None
    if os.environ.get("TREESERVE_AMX_EMULATED") == "1":  # the AMX kernels on tiles in plain C (amx_emulated.h)
        warnings.warn("TREESERVE_AMX_EMULATED=1: AMX tiles emulated in C, for tests; any time measured is meaningless",
                      stacklevel=2)  # fmt: skip
        flags = [*flags, "-DTREESERVE_AMX_EMULATED"]
    signature = " ".join(flags + LINK_FLAGS).encode() + compiler.encode() + _cpu_signature()
    headers = b"".join(path.read_bytes() for path in sorted(source.parent.glob("*.h")))  # what sources include
    key = hashlib.sha256(source.read_bytes() + headers + signature)
    cache_dir = Path(os.environ.get("TREESERVE_CACHE", Path.home() / ".cache" / "treeserve")) / "kernels"
    lib_path = cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if not lib_path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".so", delete=False) as tmp:
            pass
        obj = tmp.name + ".o"
        for command in ([compiler, *flags, "-c", str(source), "-o", obj], [compiler, obj, "-o", tmp.name, *LINK_FLAGS]):
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                for path in (tmp.name, obj):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                message = f"building {source.name} failed, using PyTorch paths:\n{result.stderr[-2000:]}"
                warnings.warn(message, stacklevel=2)
                return None
        os.unlink(obj)
        os.replace(tmp.name, lib_path)  # atomic: concurrent builders never see a partial file
    return ctypes.CDLL(str(lib_path))


def prebuild(sources: Sequence[tuple[Path, list[str]]]) -> None:
    """Compile `sources` ((file, flags) pairs) at once, each from a thread: the compilers are
    processes, so a cold start waits for the longest build instead of their sum (on 2 cores,
    ~1.2 s instead of ~1.9 s for a dense bf16 model's three libraries). The loaders then find
    each library built; a source already built costs a hash."""
    threads = [threading.Thread(target=build, args=(source, flags)) for source, flags in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@cache
def load() -> ctypes.CDLL | None:
    lib = build(SOURCE)
    if lib is None:
        return None
    for suffix in _SUFFIX.values():
        getattr(lib, f"paged_decode_{suffix}").argtypes = [
            _ptr,
            _ptr,
            _i64,
            _i64,
            _ptr,
            _i64,
            _ptr,
            _int,
            _int,
            _int,
            _int,
            _int,
            _float,
            _i64,
            _int,
            _ptr,
        ]
        getattr(lib, f"sample_rows_{suffix}").argtypes = [_ptr, _i64, _int, _int, _ptr, _ptr, _int]
        getattr(lib, f"argmax_rows_{suffix}").argtypes = [_ptr, _i64, _int, _int, _ptr, _int]
        getattr(lib, f"sample_rows_masked_{suffix}").argtypes = [_ptr, _i64, _int, _int, _ptr, _i64, _int, _ptr,
                                                                 _ptr, _int]  # fmt: skip
        getattr(lib, f"paged_decode_fp8_{suffix}").argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _int,
                                                                _int, _int, _int, _float, _i64, _ptr, _int, _ptr]
        getattr(lib, f"paged_prefill_fp8_{suffix}").argtypes = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr,
                                                                 _int, _int, _int, _int, _int, _float, _i64, _ptr,
                                                                 _int, _ptr]
    lib.store_kv_fp8.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr]
    lib.rms_norm_bf16.argtypes = [_ptr, _i64, _int, _ptr, _ptr, _float, _ptr, _int]
    lib.gated_act_bf16.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _int]
    lib.store_kv.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _i64, _ptr, _ptr]
    lib.rope_bf16.argtypes = [_ptr, _i64, _i64, _int, _int, _ptr, _ptr, _ptr, _int]
    lib.copy_slots.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64]
    lib.avx512_bf16_built.restype = _int
    if lib.avx512_bf16_built():
        prefill_args = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int, _int, _int, _int, _int]
        lib.paged_prefill_bf16.argtypes = [*prefill_args, _float, _i64, _int, _ptr]
        lib.linear_bf16.argtypes = [_ptr, _i64, _int, _ptr, _ptr, _i64, _int, _ptr, _i64, _int]
    return lib


def supports(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _SUFFIX and load() is not None


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             pages: torch.Tensor, offsets: torch.Tensor, kv_scales: torch.Tensor | None = None) -> bool:  # fmt: skip
    """`k_cache[pages, offsets] = k` and the same for v, in one C call: k/v [T, Hkv, D] with
    contiguous heads, k/v_cache [pages, block, Hkv, D] views of one arena, pages/offsets int64
    slots the engine allocated. An FP8 cache (`KV_FP8`) stores e4m3(k / k_scale) and e4m3(v / v_scale),
    `kv_scales` the layer's fp32 (k_scale, v_scale). False (nothing written) where the layouts do not fit."""
    kv_heads, head_dim = k_cache.shape[2:]
    width = kv_heads * head_dim
    fp8 = k_cache.dtype == KV_FP8
    fits = (
        supports(k) and v.dtype == k.dtype and (k_cache.dtype == k.dtype or fp8 and _scales_fit(kv_scales))
        and k.shape == v.shape and k.shape[1:] == (kv_heads, head_dim)
        and k.stride()[1:] == (head_dim, 1) and v.stride()[1:] == (head_dim, 1)
        and k_cache.stride()[1:] == (width, head_dim, 1) and v_cache.stride() == k_cache.stride()
        and pages.dtype == offsets.dtype == torch.int64 and pages.is_contiguous() and offsets.is_contiguous()
    )  # fmt: skip
    if not fits:
        return False
    if fp8:
        rows = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], width, int(k.dtype == torch.bfloat16))
        cache = (k_cache.data_ptr(), k_cache.stride(0), width, v_cache.data_ptr() - k_cache.data_ptr())
        load().store_kv_fp8(*rows, *cache, pages.data_ptr(), offsets.data_ptr(), kv_scales.data_ptr())
        return True
    load().store_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], width, k.element_size(),
        k_cache.data_ptr(), k_cache.stride(0), width, (v_cache.data_ptr() - k_cache.data_ptr()) // k.element_size(),
        pages.data_ptr(), offsets.data_ptr(),
    )  # fmt: skip
    return True


def _scales_fit(kv_scales: torch.Tensor | None) -> bool:
    """A layer's (k_scale, v_scale): fp32 [2], contiguous, on the CPU."""
    if kv_scales is None:
        return False
    return kv_scales.device.type == "cpu" and kv_scales.dtype == torch.float32 and kv_scales.stride() == (1,)


def copy_slots(buffer: torch.Tensor, src_pages: torch.Tensor, src_offsets: torch.Tensor, dst_pages: torch.Tensor,
               dst_offsets: torch.Tensor) -> bool:  # fmt: skip
    """`buffer[dst_pages, :, :, dst_offsets] = buffer[src_pages, :, :, src_offsets]` in one C call:
    buffer a KV arena's view [pages, layers, 2, block, kv_heads, head_dim] with contiguous pages'
    contents, slots int64 and contiguous, no slot both a source and a destination. False (nothing
    copied) where the layouts do not fit."""
    pages, layers, _, block, kv_heads, head_dim = buffer.shape
    token = kv_heads * head_dim
    fits = (
        buffer.device.type == "cpu" and load() is not None
        and buffer.stride()[1:] == (2 * block * token, block * token, token, head_dim, 1)
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in (src_pages, src_offsets, dst_pages, dst_offsets))
    )  # fmt: skip
    if not fits:
        return False
    size = buffer.element_size()
    load().copy_slots(
        buffer.data_ptr(), buffer.stride(0) * size, layers, block, token * size,
        src_pages.data_ptr(), src_offsets.data_ptr(), dst_pages.data_ptr(), dst_offsets.data_ptr(), src_pages.numel(),
    )  # fmt: skip
    return True


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [pages, block, Hkv, D] views of one arena; -> [B, Hq, D] (into
    `out`, contiguous and like q, where given). FP8 caches need `kv_scales` (`store_kv`'s)."""
    q = q.contiguous()
    tables = tables.contiguous()
    context_lens = context_lens.contiguous()
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and v_cache.stride() == k_cache.stride()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    v_offset = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()
    if k_cache.dtype == KV_FP8:
        assert _scales_fit(kv_scales), "an FP8 cache is read with its layer's fp32 (k_scale, v_scale)"
        pages = (q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), v_offset, tables.data_ptr(), tables.stride(0))
        shape = (context_lens.data_ptr(), batch, q_heads, kv_heads, head_dim, block_size, scale, window or 0)
        kernel = getattr(load(), f"paged_decode_fp8_{_SUFFIX[q.dtype]}")
        kernel(*pages, *shape, kv_scales.data_ptr(), torch.get_num_threads(), out.data_ptr())
        return out
    getattr(load(), f"paged_decode_{_SUFFIX[q.dtype]}")(
        q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), v_offset,
        tables.data_ptr(), tables.stride(0), context_lens.data_ptr(),
        batch, q_heads, kv_heads, head_dim, block_size,
        scale, window or 0, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip
    return out


@cache
def bf16_built() -> bool:
    """True when the AVX512-BF16 kernels (the GEMV, the prefill attention) were compiled in."""
    lib = load()
    return lib is not None and lib.avx512_bf16_built() == 1


def prefill_supports(q: torch.Tensor, kv_dtype: torch.dtype | None = None) -> bool:
    """True when `paged_prefill` runs attention for q [T, Hq, D] over a cache of `kv_dtype` (None:
    q's): contiguous on a CPU, `prefill_fits`; over an FP8 cache, q fp32 or bf16 (portable C)."""
    if q.device.type != "cpu" or not q.is_contiguous():
        return False
    if kv_dtype == KV_FP8:
        return supports(q)
    return prefill_fits(q.dtype, q.shape[-1])


def prefill_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """True when `paged_prefill` takes heads of `dtype` and `head_dim` in bf16 pages: bf16 on a CPU with
    AVX512-BF16, D % 32 == 0."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and bf16_built()


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Causal attention of each sequence's chunk of queries, written into `out` in place.

    q and out [T, Hq, D] are the step's flat batch; sequence b's queries are rows
    q_starts[b] .. q_starts[b] + q_lens[b] - 1, the last of them at position context_lens[b] - 1.
    FP8 caches need `kv_scales` (`store_kv`'s).
    """
    assert q.is_contiguous() and out.is_contiguous() and q.shape == out.shape
    tables, q_starts, q_lens, context_lens = (t.contiguous() for t in (tables, q_starts, q_lens, context_lens))
    assert tables.dtype == q_starts.dtype == q_lens.dtype == context_lens.dtype == torch.int64
    _, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and v_cache.stride() == k_cache.stride()
    v_offset = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()
    if k_cache.dtype == KV_FP8:
        assert _scales_fit(kv_scales), "an FP8 cache is read with its layer's fp32 (k_scale, v_scale)"
        pages = (q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), v_offset, tables.data_ptr(), tables.stride(0))
        chunks = (q_starts.data_ptr(), q_lens.data_ptr(), context_lens.data_ptr(), tables.shape[0])
        shape = (q_heads, kv_heads, head_dim, block_size, scale, window or 0)
        kernel = getattr(load(), f"paged_prefill_fp8_{_SUFFIX[q.dtype]}")
        kernel(*pages, *chunks, *shape, kv_scales.data_ptr(), torch.get_num_threads(), out.data_ptr())
        return
    load().paged_prefill_bf16(
        q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), v_offset,
        tables.data_ptr(), tables.stride(0), q_starts.data_ptr(), q_lens.data_ptr(),
        context_lens.data_ptr(), tables.shape[0], q_heads, kv_heads, head_dim, block_size,
        scale, window or 0, torch.get_num_threads(), out.data_ptr(),
    )  # fmt: skip


GEMV_MAX_ROWS = 4  # above this, a matmul reuses each weight enough for oneDNN's GEMM to win


def gemv_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True when `linear_bf16` should run x @ weight.T: a few bf16 rows on a CPU with AVX512-BF16."""
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and x.device.type == "cpu"
        and bf16_built()
    )


ROW_BUCKET = 16  # oneDNN builds a bf16 kernel per row count (~0.6 ms each): pad rows to a multiple of this


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `linear_bf16` where `gemv_supports` says so. Other bf16 inputs on a CPU
    get their rows padded with zeros to a multiple of ROW_BUCKET, so that oneDNN reuses a few
    kernels instead of building one for every batch size a search passes through (a row's
    result does not change: oneDNN's bf16 kernels gave the same bits at every padded size tried)."""
    if gemv_supports(x, weight, bias):
        return linear_bf16(x, weight, bias)
    rows = x.shape[0]
    if x.dim() != 2 or rows % ROW_BUCKET == 0 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, ROW_BUCKET - rows % ROW_BUCKET))
    return F.linear(padded, weight, bias)[:rows]


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a few bf16 rows (x [M, K], weight [N, K] contiguous) at memory bandwidth."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    load().linear_bf16(
        x.data_ptr(), x.stride(0), rows, weight.data_ptr(), None if bias is None else bias.contiguous().data_ptr(),
        n, k, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of `logits` [B, V] (fp32 or bf16, rows with unit stride): the
    first maximum of each row, or its first NaN."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    getattr(load(), f"argmax_rows_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(), logits.stride(0), rows, vocab, out.data_ptr(), torch.get_num_threads()
    )
    return out


def sample_rows(logits: torch.Tensor, uniforms: Sequence[float] | np.ndarray) -> torch.Tensor:
    """Inverse-CDF draw from softmax of each row of `logits` [B, V] (already temperature-scaled)."""
    logits = logits.contiguous()
    rows, vocab = logits.shape
    u = torch.from_numpy(np.ascontiguousarray(uniforms, dtype=np.float64))
    out = torch.empty(rows, dtype=torch.int64)
    getattr(load(), f"sample_rows_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(), logits.stride(0), rows, vocab, u.data_ptr(), out.data_ptr(), torch.get_num_threads()
    )
    return out


def sample_rows_masked(
    logits: torch.Tensor, masks: torch.Tensor, vocab: int, uniforms: Sequence[float] | np.ndarray
) -> torch.Tensor:
    """`sample_rows` over the tokens each row's bitmask allows (`masks` [B, words] int32, bit i of
    a row = token i; tokens >= `vocab` never allowed); a negative uniform picks the first allowed
    maximum (greedy); -1 where a row allows nothing."""
    logits, masks = logits.contiguous(), masks.contiguous()
    rows, width = logits.shape
    u = torch.from_numpy(np.ascontiguousarray(uniforms, dtype=np.float64))
    out = torch.empty(rows, dtype=torch.int64)
    getattr(load(), f"sample_rows_masked_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(), logits.stride(0), rows, width, masks.data_ptr(), masks.stride(0), vocab, u.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


@cache
def act_table(act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(x) in bf16 for every bf16 bit pattern x (index = the pattern), by PyTorch's own kernel
    over a contiguous run (its vectorised path, which a row of a whole number of vectors takes),
    then 2 entries of padding (`gated_act_bf16`'s gathers read 4 bytes an entry)."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat([act(patterns), torch.zeros(2, dtype=torch.bfloat16)]).contiguous()


def gated_act_bf16(gate_up: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of a fused gate|up output [..., 2 * inter] (bf16, rows contiguous), act from
    `act_table`'s table: PyTorch's bits, one pass."""
    inter = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=torch.bfloat16)
    load().gated_act_bf16(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, table.data_ptr(),
                          out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def rms_norm_bf16(x: torch.Tensor, eps: float, gain: torch.Tensor | None, weight: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm over the last dim of bf16 `x`: Gemma's fp32 `gain` (1 + w) or Llama's bf16 `weight`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    load().rms_norm_bf16(
        x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
        None if gain is None else gain.data_ptr(), None if weight is None else weight.data_ptr(),
        eps, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in bf16, as PyTorch rounds it: x [T, H, D] with contiguous
    heads, cos/sin [T, 1, D] contiguous -> contiguous [T, H, D]."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
    load().rope_bf16(
        x.data_ptr(), x.stride(0), tokens, heads, dim, cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


AMX_SOURCE = Path(__file__).parent / "amx_linear.c"


@cache
def load_amx() -> ctypes.CDLL | None:
    """`amx_linear.c` (bf16 and dequantised-quantised linear layers on tiles), where this CPU and
    process may use AMX tiles; else None."""
    lib = build(AMX_SOURCE, [flag for flag in FLAGS if flag != "-ffast-math"])
    if lib is None or not lib.amx_linear_available():
        return None
    # quant_kernels.c's qmatmul's arguments
    for matmul in (lib.amx_quant_matmul, lib.amx_dense_matmul):
        matmul.argtypes = [_int, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _i64, _int, _int,
                           _int]  # fmt: skip
    return lib


AMX_CHUNK = 32  # weights of k a tile product takes


def amx_supports(weight: torch.Tensor) -> bool:
    """True when AMX tiles can multiply by `weight` [n, k] laid out as dense panels (`quant.bf16_panels`):
    bf16 on a CPU with usable AMX, k % 32 == 0."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % AMX_CHUNK == 0
        and load_amx() is not None
    )
