"""ctypes bindings for `quant_kernels.c` (matmul with float activations, dequantise, int8
quantise), `q8_kernels.c` (8-bit activations) and `bf16_panels.c` (dense bf16 panels).

A quantised matrix is uint8 [n, row_bytes] of llama.cpp blocks (a row an output channel; ggml
type numbers in `QTYPES`), plus an fp32 scale a row for our int8. `lay_out` stores it as the
8-bit kernel's panels (PANELS + format: 16 channels a panel, codes in read order; same bits).
Without a C compiler or with `TREESERVE_CPU_KERNELS=0`, callers dequantise at load.
"""

from __future__ import annotations

import contextlib
import ctypes
from functools import cache, partial
from pathlib import Path

import torch

from treeserve.kernels.cpu import AMX_CHUNK, FLAGS, build, load_amx, native_bf16
from treeserve.kernels.cpu.memory import weight_buffer

SOURCE = Path(__file__).parent / "quant_kernels.c"
Q8_SOURCE = Path(__file__).parent / "q8_kernels.c"
BF16_SOURCE = Path(__file__).parent / "bf16_panels.c"
# No -ffast-math: a row's result may not depend on the batch, so no reassociation.
QUANT_FLAGS = [flag for flag in FLAGS if flag != "-ffast-math"]
I8 = 1000  # per-output-channel symmetric int8 (ours; not a ggml type)
PANELS = 2000  # format + PANELS: that format as q8_kernels.c's panels (ours)
PANEL = 16  # output channels a panel
QTYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "I8": I8}
BLOCKS = {  # (weights, bytes) a block
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    I8: (32, 32),
}
LAYOUTS = {QTYPES[name] for name in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K")}
BYTE_LAYOUTS = {QTYPES["Q8_0"]}  # a byte a code: `panel_rows` and AMX read them; nibble panels stay packed
BF16_PANELS = PANELS + 30  # ggml's bf16 type, laid out by `bf16_panels`
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
MATMUL_ARGS = [_int, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _i64, _int, _int, _int]


@cache
def load() -> ctypes.CDLL | None:
    lib = build(SOURCE, QUANT_FLAGS)
    if lib is None:
        return None
    lib.qmatmul.argtypes = MATMUL_ARGS
    lib.bf16_dot_available.restype = _int
    lib.dequant_rows.argtypes = [_int, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _int]
    lib.quantize_i8.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _int]
    return lib


@cache
def load_q8() -> ctypes.CDLL | None:
    lib = build(Q8_SOURCE, QUANT_FLAGS)
    if lib is None or not lib.q8_available():
        return None
    lib.q8_matmul.argtypes = MATMUL_ARGS
    lib.q8_panels.argtypes = [_int, _ptr, _i64, _i64, _i64, _ptr, _int]
    lib.q8_panel_rows.argtypes = [_ptr, _i64, _ptr, _i64, _ptr]
    return lib


@cache
def load_bf16() -> ctypes.CDLL | None:
    """`bf16_panels.c` where the CPU has AVX512-BF16; built alone so dense models skip the quantised builds."""
    if not native_bf16():
        return None
    lib = build(BF16_SOURCE, QUANT_FLAGS)
    if lib is None or not lib.bf16_panels_available():
        return None
    lib.bf16_matmul.argtypes = MATMUL_ARGS
    lib.bf16_panel_rows.argtypes = [_ptr, _i64, _ptr, _i64, _ptr]
    return lib


def bf16_panels_available() -> bool:
    return load_bf16() is not None


def bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [n, k] as uint8 panels [ceil(n / PANEL), row_bytes(BF16_PANELS, k)]: panel p, pair i,
    lane c holds weights (2i, 2i + 1) of channel p * PANEL + c; channels past n are zero."""
    n, k = weight.shape
    assert weight.dtype == torch.bfloat16 and k % 2 == 0
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight
    panels = padded.view(-1, PANEL, k // 2, 2).transpose(1, 2)
    out = weight_buffer(padded.numel() * 2).view(torch.bfloat16).view(panels.shape)
    out.copy_(panels)
    return out.view(panels.shape[0], -1).view(torch.uint8)


def bf16_panel_rows(data: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 rows `ids` of a matrix laid out by `bf16_panels` (row i: lane i % PANEL of panel i // PANEL)."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    load_bf16().bf16_panel_rows(data.data_ptr(), k, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out


Q8_FORMATS = {QTYPES[name] for name in ("Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "I8")}
Q8_FORMATS |= {PANELS + qtype for qtype in LAYOUTS}
TILE_FORMATS = set(QTYPES.values()) | {PANELS + qtype for qtype in BYTE_LAYOUTS}  # amx_linear.c dequantises
ACTIVATIONS = ("int8", "bf16")


def q8_available() -> bool:
    """AVX512-VNNI: quantised weights times 8-bit activations."""
    return available() and load_q8() is not None


def available() -> bool:
    return load() is not None


@cache
def bf16_dot() -> bool:
    """Whether qmatmul takes bf16 activations (AVX512-BF16)."""
    lib = load()
    return lib is not None and bool(lib.bf16_dot_available())


def row_bytes(qtype: int, k: int) -> int:
    """Bytes a row of k weights (laid out: a panel of PANEL rows)."""
    if qtype == BF16_PANELS:
        return PANEL * 2 * k
    if qtype > PANELS:
        return PANEL * row_bytes(qtype - PANELS, k)
    weights, nbytes = BLOCKS[qtype]
    if k % weights:
        raise ValueError(f"a row of {k} weights is not a whole number of {weights}-weight blocks")
    return k // weights * nbytes


def _ptr_or_none(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


MAX_PARTS = 8  # row-stacked matrices a `Plan` may hold (quant_kernels.c)


class Plan:
    """ctypes arguments for a row-stack of quantised matrices, built once a weight: part j =
    (format, uint8 [rows (or panels), row_bytes], fp32 row scales or None, rows).

    "int8" activations: rows rounded to 8 bits in blocks of 32, integer products (`q8`); "bf16":
    on AMX, weights dequantised into bf16 tiles (`tiles`). Dense bf16 panels take either. `call`
    is the chosen matmul with the arguments bound; None means `qmatmul`."""

    def __init__(
        self, parts: list[tuple[int, torch.Tensor, torch.Tensor | None, int]], k: int, activations: str = "int8"
    ):
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"a quantised matrix has 1..{MAX_PARTS} parts, got {len(parts)}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantised activations must be one of {list(ACTIVATIONS)}, got {activations!r}")
        for qtype, data, _, rows in parts:
            stored = -(-rows // PANEL) if qtype > PANELS else rows
            assert data.dtype == torch.uint8 and data.is_contiguous() and data.shape == (stored, row_bytes(qtype, k))
        count = len(parts)
        types = [qtype for qtype, *_ in parts]
        self.k, self.n = k, sum(rows for *_, rows in parts)
        self.tensors = parts  # keeps the bytes alive for the pointers below
        self.args = (
            count,
            (ctypes.c_int * count)(*types),
            (ctypes.c_void_p * count)(*(data.data_ptr() for _, data, *_ in parts)),
            (ctypes.c_int64 * count)(*(data.stride(0) for _, data, *_ in parts)),
            (ctypes.c_void_p * count)(*(None if s is None else s.data_ptr() for _, _, s, _ in parts)),
            (ctypes.c_int64 * count)(*(rows for *_, rows in parts)),
            k,
        )
        self.q8_formats = k % 64 == 0 and all(qtype in Q8_FORMATS for qtype in types) and q8_available()
        self.q8 = activations == "int8" and self.q8_formats
        self.tiles = activations == "bf16" and all(qtype in TILE_FORMATS for qtype in types) and load_amx() is not None
        self.dense = all(qtype == BF16_PANELS for qtype in types)
        assert not self.dense or bf16_panels_available()
        # dense panels are AMX tiles as they lie, for whole 32-weight chunks
        dense_tiles = self.dense and k % AMX_CHUNK == 0 and load_amx() is not None
        self.function = (
            load_q8().q8_matmul
            if self.q8
            else load_amx().amx_quant_matmul
            if self.tiles
            else load_amx().amx_dense_matmul
            if dense_tiles
            else load_bf16().bf16_matmul
            if self.dense
            else None
        )
        self.call = partial(self.function, *self.args) if self.function is not None else None
        self.laid_out = any(qtype > PANELS for qtype in types)  # only `call` reads panels

    def fast(self, x_dtype: torch.dtype) -> bool:
        return self.q8 or self.dense or (self.tiles and x_dtype == torch.bfloat16)

    def run(self, x: torch.Tensor, m: int, out: torch.Tensor, bias: torch.Tensor | None, fast: bool) -> None:
        """x's m rows @ W^T (+ bias) into out, unchecked (`qmatmul` checks); by `call` where `fast`."""
        (self.call if fast else partial(load().qmatmul, *self.args))(
            x.data_ptr(),
            x.stride(0) if x.dim() == 2 else self.k,
            m,
            _ptr_or_none(bias),
            out.data_ptr(),
            self.n,
            int(out.dtype == torch.bfloat16),
            int(x.dtype == torch.bfloat16),
            torch.get_num_threads(),
        )


def qmatmul(
    plan: Plan,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    fast: bool = False,
) -> torch.Tensor:
    """x [m, k] (unit-stride rows, fp32 or bf16) @ W^T (+ bias) -> out [m, n], fp32 or bf16.
    bf16 rows see W rounded to bf16 as unpacked; `fast` uses the plan's `call` (see `Plan`)."""
    m = x.shape[0]
    assert x.dtype in (torch.float32, torch.bfloat16) and x.stride(-1) == 1 and x.shape[1] == plan.k
    assert not fast or plan.fast(x.dtype)
    assert x.dtype == torch.float32 or bf16_dot() or fast
    assert fast or not (plan.laid_out or plan.dense)
    if out is None:
        out = torch.empty(m, plan.n, dtype=torch.float32)
    assert out.shape == (m, plan.n) and out.is_contiguous() and out.dtype in (torch.float32, torch.bfloat16)
    plan.run(x, m, out, bias, fast)
    return out


def dequant_rows(
    qtype: int, data: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, k: int
) -> torch.Tensor:
    """fp32 rows `ids` [count] of the matrix -> [count, k]."""
    ids = ids.to(torch.int64).contiguous()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < data.shape[0]):
        raise IndexError(f"row ids out of range for a matrix of {data.shape[0]} rows")
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    load().dequant_rows(
        qtype,
        data.data_ptr(),
        data.stride(0),
        _ptr_or_none(scales),
        ids.data_ptr(),
        ids.numel(),
        k,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def lay_out(qtype: int, data: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [n, row_bytes] as the 8-bit kernel's panels [ceil(n / PANEL), row_bytes(PANELS + qtype, k)];
    k a multiple of 64, channels past n zero."""
    assert q8_available() and qtype in LAYOUTS and k % 64 == 0 and data.shape[1] == row_bytes(qtype, k)
    data = data.contiguous()
    shape = (-(-data.shape[0] // PANEL), row_bytes(PANELS + qtype, k))
    out = weight_buffer(shape[0] * shape[1]).view(shape)
    assert out.data_ptr() % 64 == 0  # aligned loads
    n, rb = data.shape
    load_q8().q8_panels(qtype, data.data_ptr(), n, k, rb, out.data_ptr(), torch.get_num_threads())
    _page_out(data)
    return out


def _page_out(t: torch.Tensor) -> None:
    """MADV_PAGEOUT hint: a GGUF map read once for `lay_out` leaves the resident set; data stays valid."""
    page = 4096
    start = t.data_ptr() // page * page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 21)


def panel_rows(qtype: int, data: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 rows `ids` of a PANELS + Q8_0 matrix."""
    assert qtype == PANELS + QTYPES["Q8_0"]
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    load_q8().q8_panel_rows(data.data_ptr(), k, ids.data_ptr(), ids.numel(), out.data_ptr())
    return out


def quantize_i8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8 of [n, k]: (int8 as uint8 [n, k], fp32 scales [n])."""
    w = weight.detach().to(torch.float32).contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, dtype=torch.float32)
    load().quantize_i8(w.data_ptr(), n, k, q.data_ptr(), scales.data_ptr(), torch.get_num_threads())
    return q, scales
