"""Call `layer_stack.c`: every decoder layer of a step in one C call. `Stack` holds a model's
layer structs (built once at kernel pick) and the tensors they point into; the chained kernels
(the plans' matmul, `cpu_kernels.c`'s norm, rope, KV store and attention) are function pointers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from treeserve.kernels import cpu as cpu_kernels
from treeserve.kernels.cpu import build, quant

SOURCE = Path(__file__).parent / "layer_stack.c"
_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class Matrix(ctypes.Structure):
    _fields_ = [
        ("parts", _int),
        ("types", _ptr),
        ("ws", _ptr),
        ("row_bytes", _ptr),
        ("row_scales", _ptr),
        ("part_rows", _ptr),
        ("k", _i64),
        ("n", _i64),
        ("bias", _ptr),
    ]


NORMS = 6  # input, q, k, post-attention, pre-MLP, post-MLP


class Layer(ctypes.Structure):
    _fields_ = [(name, Matrix) for name in ("qkv", "o", "gate_up", "down")] + [
        ("gain", _ptr * NORMS),
        ("weight", _ptr * NORMS),
        ("window", _i64),
        ("rope", _int),
    ]


class StackArgs(ctypes.Structure):
    _fields_ = [
        ("hidden", _int),
        ("q_heads", _int),
        ("kv_heads", _int),
        ("head_dim", _int),
        ("intermediate", _int),
        ("eps", _float),
        ("act", _ptr),
        ("matmul", _ptr),
        ("norm", _ptr),
        ("rope", _ptr),
        ("store", _ptr),
        ("attend", _ptr),
        ("prefill", _ptr),
        ("gated", _ptr),
        ("final_gain", _ptr),
        ("final_weight", _ptr),
        ("embed", _ptr),
        ("embed_table", _ptr),
        ("embed_rows", _i64),
        ("embed_scale", _float),
    ]


class Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _i64),
        ("positions", _ptr),
        ("cos", _ptr * 2),
        ("sin", _ptr * 2),
        ("slot_pages", _ptr),
        ("slot_offsets", _ptr),
        ("decode_batch", _int),
        ("decode_rows", _ptr),
        ("tables", _ptr),
        ("context_lens", _ptr),
        ("table_stride", _i64),
        ("prefill_batch", _int),
        ("prefill_tables", _ptr),
        ("q_starts", _ptr),
        ("q_lens", _ptr),
        ("prefill_context_lens", _ptr),
        ("prefill_table_stride", _i64),
        ("k_cache", _ptr),
        ("layer_stride", _i64),
        ("page_stride", _i64),
        ("v_offset", _i64),
        ("page_size", _int),
        ("scale", _float),
        ("threads", _int),
    ]


@dataclass
class DecodeGroup:
    """A step's decodes, one query a sequence (int64, contiguous)."""

    tables: torch.Tensor
    context_lens: torch.Tensor  # cached + itself
    rows: torch.Tensor | None  # None: the step's first B rows


@dataclass
class PrefillGroup:
    """Prefill chunks: sequence b's rows starts[b] .. + lens[b] - 1, the last at context_lens[b] - 1."""

    tables: torch.Tensor
    starts: torch.Tensor  # [C]
    lens: torch.Tensor  # [C]
    context_lens: torch.Tensor  # [C]


@dataclass
class StackPages:
    """A step's KV pages and attention groups."""

    k_cache: torch.Tensor  # layer 0's K [pages, page_size, kv_heads, head_dim]
    layer_stride: int  # elements
    v_offset: int  # elements
    slot_pages: torch.Tensor  # where each row's K/V go
    slot_offsets: torch.Tensor  # [T] int64
    decodes: DecodeGroup | None
    chunks: PrefillGroup | None
    scale: float | None  # None: head_dim ** -0.5


@cache
def load() -> ctypes.CDLL | None:
    """The library, where the kernels it chains were built."""
    if cpu_kernels.load() is None:
        return None
    lib = build(SOURCE, quant.QUANT_FLAGS)
    if lib is None:
        return None
    lib.layer_stack_bf16.argtypes = [
        ctypes.POINTER(StackArgs),
        ctypes.POINTER(Layer),
        _int,
        ctypes.POINTER(Step),
        _ptr,
        _ptr,
    ]
    lib.layer_stack_from_ids.argtypes = [
        ctypes.POINTER(StackArgs),
        ctypes.POINTER(Layer),
        _int,
        ctypes.POINTER(Step),
        _ptr,
        _ptr,
        _ptr,
    ]
    lib.layer_stack_from_ids.restype = _int
    return lib


def available() -> bool:
    return load() is not None


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def matrix(plan: quant.Plan, bias: torch.Tensor | None) -> Matrix:
    count, types, ws, row_bytes, scales, rows, k = plan.args
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (plan.n,))
    return Matrix(
        count,
        ctypes.cast(types, _ptr),
        ctypes.cast(ws, _ptr),
        ctypes.cast(row_bytes, _ptr),
        ctypes.cast(scales, _ptr),
        ctypes.cast(rows, _ptr),
        k,
        plan.n,
        None if bias is None else bias.data_ptr(),
    )


@dataclass
class EmbeddingTable:
    """A table the stack looks rows up in (Q8_0 or bf16 panels), times `scale` in bf16 (Gemma's)."""

    panels: torch.Tensor
    rows: int
    scale: float | None
    dense: bool = False  # else Q8_0


@dataclass
class LayerWeights:
    """One layer's struct: plans, norms (Gemma's fp32 gain or Llama's bf16 weight; None: absent)."""

    qkv: quant.Plan
    o: quant.Plan
    gate_up: quant.Plan
    down: quant.Plan
    norms: tuple[torch.Tensor | None, ...]
    biases: tuple[torch.Tensor | None, ...]  # fp32, of qkv, o, gate_up, down
    window: int | None
    local_rope: bool


class Stack:
    def __init__(
        self,
        shapes: dict[str, int],
        eps: float,
        act: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        ropes: tuple[torch.Tensor, ...],
        embedding: EmbeddingTable | None,
    ):
        """`final_norm` a gain or weight as the layers' norms; `ropes` fp32 cos/sin of the global
        layers, then the local ones'; `embedding`: the table `run_ids` reads (None: `run` only)."""
        assert act.dtype == torch.bfloat16 and act.shape == ((1 << 16) + 2,) and act.is_contiguous()
        assert final_norm.is_contiguous() and final_norm.dtype in (torch.float32, torch.bfloat16)
        assert all(t.dtype == torch.float32 and t.is_contiguous() and t.shape[1] == shapes["head_dim"] for t in ropes)
        cpu = cpu_kernels.load()
        prefill = cpu_kernels.prefill_path(torch.bfloat16, shapes["head_dim"])
        functions = {_address(plan.function) for w in layers for plan in (w.qkv, w.o, w.gate_up, w.down)}
        assert len(functions) == 1, "every matrix of the stack on one matmul (8-bit, tiles or dense panels)"
        self.shapes = shapes
        self.keep = [act, layers, final_norm, ropes, embedding]  # the tensors the structs point into
        gain = final_norm.data_ptr() if final_norm.dtype == torch.float32 else None
        weight = final_norm.data_ptr() if final_norm.dtype == torch.bfloat16 else None
        self.embeds = embedding is not None
        lookup = (
            None
            if embedding is None
            else (quant.load_bf16().bf16_panel_rows if embedding.dense else quant.load_q8().q8_panel_rows)
        )
        table = (
            (_address(lookup), embedding.panels.data_ptr(), embedding.rows, embedding.scale or 0.0)
            if embedding
            else (None, None, 0, 0.0)
        )
        self.args = StackArgs(
            shapes["hidden"],
            shapes["q_heads"],
            shapes["kv_heads"],
            shapes["head_dim"],
            shapes["intermediate"],
            eps,
            act.data_ptr(),
            functions.pop(),
            _address(cpu.rms_norm_bf16),
            _address(cpu.rope_bf16),
            _address(cpu.store_kv),
            _address(cpu.paged_decode_bf16),
            _address(cpu_kernels.prefill_function(prefill)) if prefill else None,
            _address(cpu.gated_act_bf16),
            gain,
            weight,
            *table,
        )
        global_cos, global_sin, local_cos, local_sin = ropes
        self.cos = (_ptr * 2)(global_cos.data_ptr(), local_cos.data_ptr())
        self.sin = (_ptr * 2)(global_sin.data_ptr(), local_sin.data_ptr())
        self.layers = (Layer * len(layers))()
        for i, w in enumerate(layers):
            assert len(w.norms) == NORMS and all(n is None or n.is_contiguous() for n in w.norms)
            gains = [n.data_ptr() if n is not None and n.dtype == torch.float32 else None for n in w.norms]
            weights = [n.data_ptr() if n is not None and n.dtype == torch.bfloat16 else None for n in w.norms]
            plans = (w.qkv, w.o, w.gate_up, w.down)
            matrices = [matrix(plan, bias) for plan, bias in zip(plans, w.biases, strict=True)]
            norms = ((_ptr * NORMS)(*gains), (_ptr * NORMS)(*weights))
            self.layers[i] = Layer(*matrices, *norms, w.window or 0, int(w.local_rope))

    def run(self, x: torch.Tensor, positions: torch.Tensor, pages: StackPages, scale: float) -> torch.Tensor:
        """Every layer over x [T, hidden] (bf16, updated in place), then the final norm (a new tensor)."""
        out = torch.empty_like(x)
        step = self._step(x.shape[0], positions, pages, scale)
        load().layer_stack_bf16(self.args, self.layers, len(self.layers), step, x.data_ptr(), out.data_ptr())
        return out

    def run_ids(self, ids: torch.Tensor, positions: torch.Tensor, pages: StackPages, scale: float) -> torch.Tensor:
        assert self.embeds and ids.dtype == torch.int64 and ids.is_contiguous()
        rows = ids.shape[0]
        x = torch.empty(rows, self.shapes["hidden"], dtype=torch.bfloat16)
        out = torch.empty_like(x)
        step = self._step(rows, positions, pages, scale)
        if load().layer_stack_from_ids(
            self.args, self.layers, len(self.layers), step, ids.data_ptr(), x.data_ptr(), out.data_ptr()
        ):
            raise IndexError(f"row ids out of range for a matrix of {self.args.embed_rows} rows")
        return out

    def _step(self, rows: int, positions: torch.Tensor, pages: StackPages, scale: float) -> Step:
        assert positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape[0] == rows
        assert pages.chunks is None or self.args.prefill, "prefill chunks need a prefill kernel (prefill_path)"
        k_cache, decodes, chunks = pages.k_cache, pages.decodes, pages.chunks
        decode = (
            (0, None, None, None, 0)
            if decodes is None
            else (
                decodes.tables.shape[0],
                _address_of(decodes.rows),
                decodes.tables.data_ptr(),
                decodes.context_lens.data_ptr(),
                decodes.tables.stride(0),
            )
        )
        prefill = (
            (0, None, None, None, None, 0)
            if chunks is None
            else (
                chunks.tables.shape[0],
                chunks.tables.data_ptr(),
                chunks.starts.data_ptr(),
                chunks.lens.data_ptr(),
                chunks.context_lens.data_ptr(),
                chunks.tables.stride(0),
            )
        )
        return Step(
            rows,
            positions.data_ptr(),
            self.cos,
            self.sin,
            pages.slot_pages.data_ptr(),
            pages.slot_offsets.data_ptr(),
            *decode,
            *prefill,
            k_cache.data_ptr(),
            pages.layer_stride,
            k_cache.stride(0),
            pages.v_offset,
            k_cache.shape[1],
            scale,
            torch.get_num_threads(),
        )


def _address_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
