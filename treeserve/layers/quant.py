"""Weights kept quantised: the matrix type quantised linear layers, embeddings and LM heads hold.

A `QuantTensor` is an [n, k] weight matrix stored as row-stacked parts, each part a block of
output channels in one format (GGUF's Q4_0 ... Q6_K blocks, or our per-channel int8 with a
scale a row): a fused q/k/v projection of a GGUF file whose v rows are Q8_0 and q/k rows Q5_0
is one `QuantTensor` of three parts. The bytes stay as loaded (a GGUF file's memory map).
`dtype` is the dtype activations and results have (the engine's), so model code that asks
`weight.dtype` works unchanged.

Where the 8-bit kernel multiplies a matrix, `in_panels()` lays its parts out once as that
kernel's panels (at kernel pick time, `Linear`/`Embedding`): a copy of the same size, in the
kernel's order, replaces the file's bytes. Q8_0 parts always; the nibble formats' (Q4_0, Q5_0,
Q4_K, Q6_K) only where nothing else reads them: not an embedding's table (its rows are looked
up), not on a CPU with AMX (whose tiles read the file's layout; docs/decisions.md).

`slice_rows` and `slice_columns` cut a tensor-parallel rank's shard (models/sharding.py) out of
the file's bytes: whole rows, or whole blocks of every row; a rank's blocks are the file's.

`quant_linear` has F.linear's signature; `linear_kernel` returns it for a `QuantTensor`.
`quant_embedding` looks rows up. Both call `kernels/cpu/quant.py` (CPU only: a GPU engine
dequantises at load). `quantize_int8` makes an int8 `QuantTensor` of a dense weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from treeserve.kernels.cpu import load_amx
from treeserve.kernels.cpu import quant as kernels

QTYPE_NAMES = {number: name for name, number in kernels.QTYPES.items()}
QTYPE_NAMES |= {kernels.PANELS + number: name for number, name in QTYPE_NAMES.items()}  # laid out: the same format
QTYPE_NAMES[kernels.BF16_PANELS] = "BF16"  # a dense bf16 matrix as panels (`dense_panels`)
ACTIVATIONS = kernels.ACTIVATIONS  # what a matmul takes activations as: "int8" | "bf16" (`QuantTensor.activations`)
KERNEL_FORMATS = set(kernels.BLOCKS)  # ggml type numbers (and our int8) the kernels multiply


def kernels_available() -> bool:
    """False without a C compiler or with TREESERVE_CPU_KERNELS=0 (then weights are dequantised)."""
    return kernels.available()


@dataclass
class QuantPart:
    qtype: int  # kernels.QTYPES value, or kernels.PANELS + one (laid out)
    data: torch.Tensor  # uint8 [rows, row_bytes] (laid out: [ceil(rows / 16) panels, row_bytes])
    scales: torch.Tensor | None = None  # fp32 [rows], int8 only
    panel_rows: int = 0  # panels: the output channels they hold

    @property
    def rows(self) -> int:
        return self.panel_rows if self.qtype > kernels.PANELS else self.data.shape[0]

    def in_panels(self, cols: int, formats: set[int]) -> QuantPart:
        """This part laid out as the 8-bit kernel's panels (`QuantTensor.in_panels` checks that
        kernel multiplies the matrix) where its format is one of `formats`, else itself."""
        if self.qtype not in formats:
            return self
        panels = kernels.lay_out(self.qtype, self.data, cols)
        return QuantPart(kernels.PANELS + self.qtype, panels, panel_rows=self.rows)

    def slice_rows(self, start: int, stop: int) -> QuantPart:
        """Output channels [start, stop): the same bytes (a view)."""
        self._check_not_laid_out()
        scales = None if self.scales is None else self.scales[start:stop]
        return QuantPart(self.qtype, self.data[start:stop], scales)

    def slice_columns(self, start: int, stop: int, cols: int) -> QuantPart:
        """Input columns [start, stop) of rows `cols` wide: each row's blocks over them, copied
        byte for byte (a block holds a run of one row's columns, and int8's scale is a row's)."""
        self._check_not_laid_out()
        weights, _ = kernels.BLOCKS[self.qtype]
        if start % weights or stop % weights:
            name = QTYPE_NAMES[self.qtype]
            raise ValueError(f"columns [{start}, {stop}) of a {cols}-wide {name} matrix cut its {weights}-weight "
                             "blocks: a slice must be whole blocks")  # fmt: skip
        first, last = kernels.row_bytes(self.qtype, start), kernels.row_bytes(self.qtype, stop)
        return QuantPart(self.qtype, self.data[:, first:last].contiguous(), self.scales)

    def _check_not_laid_out(self) -> None:
        if self.qtype > kernels.PANELS:
            raise ValueError("a matrix laid out as panels is not sliced (slice the file's rows, then lay out)")

    def dequantize(self, ids: torch.Tensor, cols: int) -> torch.Tensor:
        """fp32 rows `ids`: the dequantiser's values, to the bit (laid out too)."""
        if ids.numel():
            low, high = torch.aminmax(ids)  # one operator: each is slow right after a forward
            if int(low) < 0 or int(high) >= self.rows:
                raise IndexError(f"row ids out of range for a matrix of {self.rows} rows")
        if self.qtype == kernels.BF16_PANELS:
            return kernels.bf16_panel_rows(self.data, ids, cols)
        if self.qtype - kernels.PANELS in kernels.BYTE_LAYOUTS:
            return kernels.panel_rows(self.qtype, self.data, ids, cols)
        if self.qtype > kernels.PANELS:
            raise ValueError(f"a {QTYPE_NAMES[self.qtype]} matrix laid out as packed panels has no rows to look up "
                             "(only the 8-bit kernel reads it; dequantise the file's bytes)")  # fmt: skip
        return kernels.dequant_rows(self.qtype, self.data, self.scales, ids, cols)


@dataclass
class QuantTensor:
    parts: list[QuantPart]
    cols: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    activations: str = "int8"  # what the matmul takes activations as: kernels.ACTIVATIONS (`Plan`)
    input_order: torch.Tensor | None = None  # int64 [cols]: multiply x[..., input_order] (GPTQ act-order)
    _plan: kernels.Plan | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def plan(self) -> kernels.Plan:
        """The kernel's description of the parts (built at first use)."""
        if self._plan is None:
            parts = [(p.qtype, p.data, p.scales, p.rows) for p in self.parts]
            self._plan = kernels.Plan(parts, self.cols, self.activations)
        return self._plan

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.rows for p in self.parts), self.cols))

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() + (0 if p.scales is None else p.scales.numel() * 4) for p in self.parts)

    @property
    def formats(self) -> list[str]:
        return sorted({QTYPE_NAMES[p.qtype] for p in self.parts})

    def to(self, dtype: torch.dtype) -> QuantTensor:
        """The same bytes, computing in `dtype` (the loader's cast)."""
        return QuantTensor(self.parts, self.cols, dtype, self.device, self.activations, self.input_order)

    @staticmethod
    def cat(tensors: list[QuantTensor]) -> QuantTensor:
        """Row-stack (a fused projection); the parts keep their own formats and bytes."""
        assert len({t.cols for t in tensors}) == 1
        parts, first = [p for t in tensors for p in t.parts], tensors[0]
        orders = [t.input_order for t in tensors]
        if any(o is not None for o in orders) and not all(o is not None and torch.equal(o, orders[0]) for o in orders):
            raise ValueError("row-stacked matrices multiply their inputs in one order (act-order g_idx)")
        return QuantTensor(parts, first.cols, first.dtype, activations=first.activations, input_order=orders[0])

    def slice_rows(self, start: int, stop: int) -> QuantTensor:
        """Output channels [start, stop) (a column-parallel shard), across the parts they fall
        in: the file's bytes (views), each part keeping its format."""
        _check_range("rows", start, stop, self.shape[0])
        parts, first = [], 0
        for part in self.parts:
            lo, hi = max(start, first), min(stop, first + part.rows)
            if lo < hi:
                parts.append(part.slice_rows(lo - first, hi - first))
            first += part.rows
        return QuantTensor(parts, self.cols, self.dtype, self.device, self.activations, self.input_order)

    def slice_columns(self, start: int, stop: int) -> QuantTensor:
        """Input columns [start, stop) (a row-parallel shard): whole blocks of every row, the
        file's bytes copied; a ValueError where the slice would cut a block."""
        _check_range("columns", start, stop, self.cols)
        if self.input_order is not None:
            raise ValueError("an act-order (g_idx) matrix is not split by columns: its groups mix every rank's inputs")
        parts = [p.slice_columns(start, stop, self.cols) for p in self.parts]
        return QuantTensor(parts, stop - start, self.dtype, self.device, self.activations)

    def in_panels(self, lookups: bool = False) -> QuantTensor:
        """The same matrix with its parts laid out as the 8-bit kernel's panels, where that
        kernel or the tiles (bf16 activations) multiply the whole matrix (this CPU, every part's
        format, the width; other parts stay as they are). Q8_0 parts always; the nibble formats'
        only where the 8-bit kernel alone reads them: not for the tiles, not on a CPU with AMX,
        not where rows are looked up (`lookups`: an embedding's table). Itself when nothing changes."""
        tiles = self.plan.tiles and self.dtype == torch.bfloat16  # fp32 activations: the fp32 kernel
        if not (self.plan.q8_formats and (self.plan.q8 or tiles)):
            return self
        packed = self.plan.q8 and not lookups and load_amx() is None
        formats = kernels.LAYOUTS if packed else kernels.BYTE_LAYOUTS
        parts = [p.in_panels(self.cols, formats) for p in self.parts]
        if all(new is old for new, old in zip(parts, self.parts, strict=True)):
            return self
        return QuantTensor(parts, self.cols, self.dtype, self.device, self.activations, self.input_order)

    def with_activations(self, activations: str) -> QuantTensor:
        """The same bytes, multiplied with activations as `activations` says (kernels.ACTIVATIONS)."""
        return QuantTensor(self.parts, self.cols, self.dtype, self.device, activations, self.input_order)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix in the layer's input order (the reference the kernels are tested against)."""
        stored = torch.cat([p.dequantize(torch.arange(p.rows), self.cols) for p in self.parts])
        if self.input_order is None:
            return stored
        out = torch.empty_like(stored)
        out[:, self.input_order] = stored
        return out


def _check_range(what: str, start: int, stop: int, size: int) -> None:
    if not 0 <= start < stop <= size:
        raise ValueError(f"{what} [{start}, {stop}) are not a slice of a matrix's {size} {what}")


def quant_linear(x: torch.Tensor, weight: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a quantised weight: x [..., k] -> [..., n] in x's dtype (fp32 accumulation).
    Activations are rounded to 8 bits where the plan says so (llama.cpp's way: the formats and the
    CPU allow it); bf16 activations go onto bf16 AMX tiles of the dequantised weights where the
    plan says so; otherwise bf16 activations go in as they are where the CPU has bf16 dot
    products (bf16 weights, fp32 sums), and anything else as fp32."""
    plan = weight.plan
    if weight.input_order is not None:
        x = x.index_select(-1, weight.input_order)
    bf16 = x.dtype == torch.bfloat16
    fast = plan.fast(x.dtype)
    if fast and bias is None and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32):
        # the decode path, ~70 calls a token: no copies, no checks the kernel's own call repeats
        out = torch.empty(*x.shape[:-1], plan.n, dtype=x.dtype)
        plan.run(x, x.numel() // plan.k, out, None, True)
        return out
    rows = x.reshape(-1, plan.k)
    if not (bf16 and (fast or kernels.bf16_dot())):
        rows = rows.float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], plan.n, dtype=torch.bfloat16 if bf16 else torch.float32)
    kernels.qmatmul(plan, rows, None if bias is None else bias.float().contiguous(), out, fast)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], plan.n)
    return out if bf16 or x.dtype == torch.float32 else out.to(x.dtype)


def quant_embedding(ids: torch.Tensor, weight: QuantTensor) -> torch.Tensor:
    """Rows `ids` of a quantised table, in its dtype."""
    flat = ids.reshape(-1)
    if len(weight.parts) != 1:
        raise ValueError("a quantised embedding table is one part")
    rows = weight.parts[0].dequantize(flat, weight.cols)
    return rows.view(*ids.shape, weight.cols).to(weight.dtype)


def dense_panels(weight: torch.Tensor) -> QuantTensor:
    """A dense bf16 [n, k] weight laid out once as `bf16_panels.c`'s panels (the same size; the
    dense matrix's own values, multiplied with bf16 dot products in one order for every batch size)."""
    part = QuantPart(kernels.BF16_PANELS, kernels.bf16_panels(weight.detach()), panel_rows=weight.shape[0])
    return QuantTensor([part], weight.shape[1], torch.bfloat16, activations="bf16")


def dense_panels_supported(weight: torch.Tensor | QuantTensor) -> bool:
    """A dense bf16 CPU matrix with an even width, on a CPU with AVX512-BF16 (`bf16_panels.c` built)."""
    return (
        isinstance(weight, torch.Tensor) and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        and weight.dim() == 2 and weight.shape[1] % 2 == 0 and kernels.bf16_panels_available()
    )  # fmt: skip


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> QuantTensor:
    """Per-output-channel symmetric int8 of a dense [n, k] weight (k a multiple of 32)."""
    data, scales = kernels.quantize_i8(weight)
    return QuantTensor([QuantPart(kernels.I8, data, scales)], weight.shape[1], dtype)


def set_quantized(module: nn.Module, name: str, weight: QuantTensor) -> None:
    """Replace the parameter `name` of `module` by a quantised weight (a plain attribute)."""
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, weight)


def quantized_weights(model: nn.Module) -> dict[str, QuantTensor]:
    """Every quantised weight of a model, by dotted name."""
    found = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, QuantTensor):
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def describe(model: nn.Module) -> str | None:
    """'Q5_0+Q6_K+Q8_0'-style summary of the formats a model runs, None when it is not quantised."""
    formats = sorted({f for w in quantized_weights(model).values() for f in w.formats})
    return "+".join(formats) or None
