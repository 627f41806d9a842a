"""Build once, cache and call the C kernels of `cpu_kernels.c`: paged decode and prefill
attention (bf16/fp32 pages, or FP8 with per-layer scales), sampling, a bf16 GEMV, RMSNorm, rope,
gated activations; `amx_linear.c` too. `quant.py` and `layer_stack.py` build theirs the same way.

Built with the system C compiler at first use into `$TREESERVE_CACHE` (default
`~/.cache/treeserve`), keyed by source, compiler and CPU, called through ctypes on data pointers.
Without a compiler, or with `TREESERVE_CPU_KERNELS=0`, `load()` is None and callers use their
PyTorch path, the reference the kernels are tested against.
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
PREFILL_AVX2 = Path(__file__).parent / "prefill_avx2.c"
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]  # inputs are finite
# Without -ffast-math: the compiler keeps the order of sums the source states.
ORDERED_FLAGS = [flag for flag in FLAGS if flag != "-ffast-math"]
# Linked without -ffast-math: GCC < 13 would link crtfastmath.o, turning on flush-to-zero process-wide.
LINK_FLAGS = ["-shared", "-fopenmp", "-lmvec", "-lm"]
_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
KV_FP8 = torch.float8_e4m3fn


def _cpu_signature() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


@cache
def native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (else PyTorch emulates bf16); True if unreadable."""
    flags = _cpu_signature().split()
    return not flags or b"avx512_bf16" in flags or b"amx_bf16" in flags


def build(source: Path, flags: list[str] = FLAGS) -> ctypes.CDLL | None:
    """Compile `source` once per source, compiler and CPU, and load it; None when off or unbuildable."""
    if os.environ.get("TREESERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        warnings.warn(f"no C compiler found: {source.name} not built, using PyTorch paths", stacklevel=2)
        return None
    if os.environ.get("TREESERVE_AMX_EMULATED") == "1":  # emulated tiles in plain C (amx_emulated.h)
        warnings.warn(
            "TREESERVE_AMX_EMULATED=1: AMX tiles emulated in C, for tests; any time measured is meaningless",
            stacklevel=2,
        )
        flags = [*flags, "-DTREESERVE_AMX_EMULATED"]
    signature = " ".join(flags + LINK_FLAGS).encode() + compiler.encode() + _cpu_signature()
    headers = b"".join(path.read_bytes() for path in sorted(source.parent.glob("*.h")))
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
        os.replace(tmp.name, lib_path)  # atomic for concurrent builders
    return ctypes.CDLL(str(lib_path))


def prebuild(sources: Sequence[tuple[Path, list[str]]]) -> None:
    """Compile `sources` at once, a thread each: a cold start waits for the longest build, not the sum."""
    threads = [threading.Thread(target=build, args=(source, flags)) for source, flags in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# paged_prefill_bf16's and paged_prefill_avx2's arguments up to the scale
PREFILL_ARGS = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _int, _int, _int, _int, _int]


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
        getattr(lib, f"sample_rows_masked_{suffix}").argtypes = [
            _ptr,
            _i64,
            _int,
            _int,
            _ptr,
            _i64,
            _int,
            _ptr,
            _ptr,
            _int,
        ]
        getattr(lib, f"paged_decode_fp8_{suffix}").argtypes = [
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
            _ptr,
            _int,
            _ptr,
        ]
        getattr(lib, f"paged_prefill_fp8_{suffix}").argtypes = [
            _ptr,
            _ptr,
            _i64,
            _i64,
            _ptr,
            _i64,
            _ptr,
            _ptr,
            _ptr,
            _int,
            _int,
            _int,
            _int,
            _int,
            _float,
            _i64,
            _ptr,
            _int,
            _ptr,
        ]
    lib.store_kv_fp8.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr]
    lib.rms_norm_bf16.argtypes = [_ptr, _i64, _int, _ptr, _ptr, _float, _ptr, _int]
    lib.gated_act_bf16.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _int]
    lib.store_kv.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _i64, _ptr, _ptr]
    lib.rope_bf16.argtypes = [_ptr, _i64, _i64, _int, _int, _ptr, _ptr, _ptr, _int]
    lib.copy_slots.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64]
    lib.avx512_bf16_built.restype = _int
    if lib.avx512_bf16_built():
        lib.paged_prefill_bf16.argtypes = [*PREFILL_ARGS, _float, _i64, _int, _int, _ptr]
        lib.prefill_tiles_available.restype = _int
        lib.linear_bf16.argtypes = [_ptr, _i64, _int, _ptr, _ptr, _i64, _int, _ptr, _i64, _int]
    return lib


def supports(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _SUFFIX and load() is not None


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> bool:
    """`k_cache[pages, offsets] = k`, the same for v, in one C call (FP8: e4m3(k / k_scale) with
    `kv_scales` the layer's (k_scale, v_scale)). False, nothing written, where layouts do not fit."""
    kv_heads, head_dim = k_cache.shape[2:]
    width = kv_heads * head_dim
    fp8 = k_cache.dtype == KV_FP8
    fits = (
        supports(k)
        and v.dtype == k.dtype
        and (k_cache.dtype == k.dtype or fp8 and _scales_fit(kv_scales))
        and k.shape == v.shape
        and k.shape[1:] == (kv_heads, head_dim)
        and k.stride()[1:] == (head_dim, 1)
        and v.stride()[1:] == (head_dim, 1)
        and k_cache.stride()[1:] == (width, head_dim, 1)
        and v_cache.stride() == k_cache.stride()
        and pages.dtype == offsets.dtype == torch.int64
        and pages.is_contiguous()
        and offsets.is_contiguous()
    )
    if not fits:
        return False
    if fp8:
        rows = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0], width, int(k.dtype == torch.bfloat16))
        cache = (k_cache.data_ptr(), k_cache.stride(0), width, v_cache.data_ptr() - k_cache.data_ptr())
        load().store_kv_fp8(*rows, *cache, pages.data_ptr(), offsets.data_ptr(), kv_scales.data_ptr())
        return True
    load().store_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k.shape[0],
        width,
        k.element_size(),
        k_cache.data_ptr(),
        k_cache.stride(0),
        width,
        (v_cache.data_ptr() - k_cache.data_ptr()) // k.element_size(),
        pages.data_ptr(),
        offsets.data_ptr(),
    )
    return True


def _scales_fit(kv_scales: torch.Tensor | None) -> bool:
    if kv_scales is None:
        return False
    return kv_scales.device.type == "cpu" and kv_scales.dtype == torch.float32 and kv_scales.stride() == (1,)


def copy_slots(
    buffer: torch.Tensor,
    src_pages: torch.Tensor,
    src_offsets: torch.Tensor,
    dst_pages: torch.Tensor,
    dst_offsets: torch.Tensor,
) -> bool:
    """`buffer[dst_pages, :, :, dst_offsets] = buffer[src_pages, :, :, src_offsets]` in one C call, no
    slot both source and destination. False, nothing copied, where layouts do not fit."""
    pages, layers, _, block, kv_heads, head_dim = buffer.shape
    token = kv_heads * head_dim
    fits = (
        buffer.device.type == "cpu"
        and load() is not None
        and buffer.stride()[1:] == (2 * block * token, block * token, token, head_dim, 1)
        and all(t.dtype == torch.int64 and t.is_contiguous() for t in (src_pages, src_offsets, dst_pages, dst_offsets))
    )
    if not fits:
        return False
    size = buffer.element_size()
    load().copy_slots(
        buffer.data_ptr(),
        buffer.stride(0) * size,
        layers,
        block,
        token * size,
        src_pages.data_ptr(),
        src_offsets.data_ptr(),
        dst_pages.data_ptr(),
        dst_offsets.data_ptr(),
        src_pages.numel(),
    )
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
    """q [B, Hq, D] over k/v_cache [pages, block, Hkv, D] -> [B, Hq, D] (into `out` where given)."""
    q = q.contiguous()
    tables = tables.contiguous()
    context_lens = context_lens.contiguous()
    batch, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and v_cache.stride() == k_cache.stride()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    v_offset = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()
    if k_cache.dtype == KV_FP8:
        assert _scales_fit(kv_scales), "an FP8 cache is read with its layer's fp32 (k_scale, v_scale)"
        pages = (q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), v_offset, tables.data_ptr(), tables.stride(0))
        shape = (context_lens.data_ptr(), batch, q_heads, kv_heads, head_dim, page_size, scale, window or 0)
        kernel = getattr(load(), f"paged_decode_fp8_{_SUFFIX[q.dtype]}")
        kernel(*pages, *shape, kv_scales.data_ptr(), torch.get_num_threads(), out.data_ptr())
        return out
    getattr(load(), f"paged_decode_{_SUFFIX[q.dtype]}")(
        q.data_ptr(),
        k_cache.data_ptr(),
        k_cache.stride(0),
        v_offset,
        tables.data_ptr(),
        tables.stride(0),
        context_lens.data_ptr(),
        batch,
        q_heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        window or 0,
        torch.get_num_threads(),
        out.data_ptr(),
    )
    return out


@cache
def bf16_built() -> bool:
    lib = load()
    return lib is not None and lib.avx512_bf16_built() == 1


def prefill_supports(q: torch.Tensor, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether `paged_prefill` takes q [T, Hq, D] over a cache of `kv_dtype` (None: q's)."""
    if q.device.type != "cpu" or not q.is_contiguous():
        return False
    if kv_dtype == KV_FP8:
        return supports(q)
    return prefill_fits(q.dtype, q.shape[-1])


def prefill_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether bf16 pages of `head_dim` have a prefill kernel here (`prefill_path`)."""
    return prefill_path(dtype, head_dim) is not None


def prefill_path(dtype: torch.dtype, head_dim: int) -> str | None:
    """The kernel `paged_prefill` runs on bf16 pages: "amx" (AMX-BF16 tiles), "avx512" (AVX512-BF16;
    both D % 32 == 0), "avx2" (AVX2 + FMA in fp32; D % 8 == 0), or None."""
    if dtype != torch.bfloat16:
        return None
    if head_dim % 32 == 0 and bf16_built():
        return "amx" if prefill_tiles_available() else "avx512"
    if head_dim % 8 == 0 and load_prefill_avx2() is not None:
        return "avx2"
    return None


@cache
def load_prefill_avx2() -> ctypes.CDLL | None:
    """`prefill_avx2.c` where the CPU has AVX2 and FMA (every x86 CPU these machines draw)."""
    flags = _cpu_signature().split()
    if b"avx2" not in flags or b"fma" not in flags:
        return None
    lib = build(PREFILL_AVX2, ORDERED_FLAGS)
    if lib is None:
        return None
    lib.paged_prefill_avx2.argtypes = [*PREFILL_ARGS, _float, _i64, _int, _int, _ptr]
    lib.paged_prefill_avx2.restype = None
    return lib


def prefill_function(path: str) -> Callable[..., None]:
    """The C function of a `prefill_path` (its address is what the layer stack calls)."""
    return load_prefill_avx2().paged_prefill_avx2 if path == "avx2" else load().paged_prefill_bf16


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
    path: str | None = None,
) -> None:
    """Causal attention of each sequence's chunk into `out`: sequence b's queries are rows
    q_starts[b] .. + q_lens[b] - 1 of the flat batch, the last at position context_lens[b] - 1.
    bf16 pages take `path` (a `prefill_path` value; None: the one `prefill_path` picks)."""
    assert q.is_contiguous() and out.is_contiguous() and q.shape == out.shape
    tables, q_starts, q_lens, context_lens = (t.contiguous() for t in (tables, q_starts, q_lens, context_lens))
    assert tables.dtype == q_starts.dtype == q_lens.dtype == context_lens.dtype == torch.int64
    _, q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and v_cache.stride() == k_cache.stride()
    v_offset = (v_cache.data_ptr() - k_cache.data_ptr()) // k_cache.element_size()
    if k_cache.dtype == KV_FP8:
        assert _scales_fit(kv_scales), "an FP8 cache is read with its layer's fp32 (k_scale, v_scale)"
        pages = (q.data_ptr(), k_cache.data_ptr(), k_cache.stride(0), v_offset, tables.data_ptr(), tables.stride(0))
        chunks = (q_starts.data_ptr(), q_lens.data_ptr(), context_lens.data_ptr(), tables.shape[0])
        shape = (q_heads, kv_heads, head_dim, page_size, scale, window or 0)
        kernel = getattr(load(), f"paged_prefill_fp8_{_SUFFIX[q.dtype]}")
        kernel(*pages, *chunks, *shape, kv_scales.data_ptr(), torch.get_num_threads(), out.data_ptr())
        return
    path = path or prefill_path(q.dtype, head_dim)
    prefill_function(path)(
        q.data_ptr(),
        k_cache.data_ptr(),
        k_cache.stride(0),
        v_offset,
        tables.data_ptr(),
        tables.stride(0),
        q_starts.data_ptr(),
        q_lens.data_ptr(),
        context_lens.data_ptr(),
        tables.shape[0],
        q_heads,
        kv_heads,
        head_dim,
        page_size,
        scale,
        window or 0,
        int(path == "amx"),
        torch.get_num_threads(),
        out.data_ptr(),
    )


@cache
def prefill_tiles_available() -> bool:
    """bf16 paged prefill attention runs on AMX tiles here (TREESERVE_AMX=0 turns them off)."""
    return bf16_built() and load().prefill_tiles_available() == 1


GEMV_MAX_ROWS = 4  # above this oneDNN's GEMM wins


def gemv_supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and x.device.type == "cpu"
        and bf16_built()
    )


ROW_BUCKET = 16  # oneDNN builds a kernel per row count (~0.6 ms each)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by `linear_bf16` where `gemv_supports`; other bf16 CPU rows are padded to a multiple of
    ROW_BUCKET so oneDNN reuses a few kernels (same bits at every padded size tried)."""
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
        x.data_ptr(),
        x.stride(0),
        rows,
        weight.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        n,
        k,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """argmax of each row of `logits` [B, V]: the first maximum, or the first NaN."""
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
    """`sample_rows` over the tokens each row's bitmask allows (bit i = token i, none >= `vocab`);
    a negative uniform is greedy; -1 where a row allows nothing."""
    logits, masks = logits.contiguous(), masks.contiguous()
    rows, width = logits.shape
    u = torch.from_numpy(np.ascontiguousarray(uniforms, dtype=np.float64))
    out = torch.empty(rows, dtype=torch.int64)
    getattr(load(), f"sample_rows_masked_{_SUFFIX[logits.dtype]}")(
        logits.data_ptr(),
        logits.stride(0),
        rows,
        width,
        masks.data_ptr(),
        masks.stride(0),
        vocab,
        u.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


@cache
def act_table(act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """act(x) for every bf16 bit pattern, by PyTorch's vectorised kernel, plus 2 padding entries
    (the gathers read 4 bytes)."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return torch.cat([act(patterns), torch.zeros(2, dtype=torch.bfloat16)]).contiguous()


def gated_act_bf16(gate_up: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of a fused [..., 2 * inter] bf16 output from `act_table`: PyTorch's bits."""
    inter = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=torch.bfloat16)
    load().gated_act_bf16(
        gate_up.data_ptr(),
        gate_up.numel() // (2 * inter),
        inter,
        table.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rms_norm_bf16(x: torch.Tensor, eps: float, gain: torch.Tensor | None, weight: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm over the last dim of bf16 `x`: Gemma's fp32 `gain` (1 + w) or Llama's bf16 `weight`."""
    x = x.contiguous()
    out = torch.empty_like(x)
    load().rms_norm_bf16(
        x.data_ptr(),
        x.numel() // x.shape[-1],
        x.shape[-1],
        None if gain is None else gain.data_ptr(),
        None if weight is None else weight.data_ptr(),
        eps,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in bf16 as PyTorch rounds it; x [T, H, D], cos/sin [T, 1, D]."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
    load().rope_bf16(
        x.data_ptr(),
        x.stride(0),
        tokens,
        heads,
        dim,
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


AMX_SOURCE = Path(__file__).parent / "amx_linear.c"


@cache
def load_amx() -> ctypes.CDLL | None:
    """`amx_linear.c`, where this CPU and process may use AMX tiles; else None."""
    lib = build(AMX_SOURCE, [flag for flag in FLAGS if flag != "-ffast-math"])
    if lib is None or not lib.amx_linear_available():
        return None
    for matmul in (lib.amx_quant_matmul, lib.amx_dense_matmul):
        matmul.argtypes = [
            _int,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _ptr,
            _i64,
            _ptr,
            _i64,
            _int,
            _ptr,
            _ptr,
            _i64,
            _int,
            _int,
            _int,
        ]
    return lib


AMX_CHUNK = 32  # weights of k a tile product takes


def amx_supports(weight: torch.Tensor) -> bool:
    """bf16 [n, k], k % 32 == 0, on a CPU with usable AMX."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[1] % AMX_CHUNK == 0
        and load_amx() is not None
    )
