"""`QuantTensor`: an [n, k] weight kept quantised as row-stacked parts, each a block of output
channels in one format (GGUF's Q4_0 ... Q6_K, or our per-channel int8), bytes as loaded. `dtype`
is the activations' (the engine's). `in_panels` lays parts out once for the 8-bit kernel;
`slice_rows` / `slice_columns` cut tensor-parallel shards from the file's bytes. CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from treeserve.kernels.cpu import quant as kernels

QTYPE_NAMES = {number: name for name, number in kernels.QTYPES.items()}
QTYPE_NAMES |= {kernels.PANELS + number: name for number, name in QTYPE_NAMES.items()}
QTYPE_NAMES[kernels.BF16_PANELS] = "BF16"
ACTIVATIONS = kernels.ACTIVATIONS
KERNEL_FORMATS = set(kernels.BLOCKS)


def kernels_available() -> bool:
    return kernels.available()


@dataclass
class QuantPart:
    qtype: int  # kernels.QTYPES value, or kernels.PANELS + one
    data: torch.Tensor  # uint8 [rows, row_bytes] (laid out: [ceil(rows / 16) panels, row_bytes])
    scales: torch.Tensor | None = None  # fp32 [rows], int8 only
    panel_rows: int = 0  # output channels, when laid out

    @property
    def rows(self) -> int:
        return self.panel_rows if self.qtype > kernels.PANELS else self.data.shape[0]

    def in_panels(self, cols: int, formats: set[int]) -> QuantPart:
        if self.qtype not in formats:
            return self
        panels = kernels.lay_out(self.qtype, self.data, cols)
        return QuantPart(kernels.PANELS + self.qtype, panels, panel_rows=self.rows)

    def slice_rows(self, start: int, stop: int) -> QuantPart:
        self._check_not_laid_out()
        scales = None if self.scales is None else self.scales[start:stop]
        return QuantPart(self.qtype, self.data[start:stop], scales)

    def slice_columns(self, start: int, stop: int, cols: int) -> QuantPart:
        """Input columns [start, stop) of rows `cols` wide: whole blocks, copied byte for byte."""
        self._check_not_laid_out()
        weights, _ = kernels.BLOCKS[self.qtype]
        if start % weights or stop % weights:
            name = QTYPE_NAMES[self.qtype]
            raise ValueError(
                f"columns [{start}, {stop}) of a {cols}-wide {name} matrix cut its {weights}-weight "
                "blocks: a slice must be whole blocks"
            )
        first, last = kernels.row_bytes(self.qtype, start), kernels.row_bytes(self.qtype, stop)
        return QuantPart(self.qtype, self.data[:, first:last].contiguous(), self.scales)

    def _check_not_laid_out(self) -> None:
        if self.qtype > kernels.PANELS:
            raise ValueError("a matrix laid out as panels is not sliced (slice the file's rows, then lay out)")

    def dequantize(self, ids: torch.Tensor, cols: int) -> torch.Tensor:
        if ids.numel():
            low, high = torch.aminmax(ids)  # one op: each is slow right after a forward
            if int(low) < 0 or int(high) >= self.rows:
                raise IndexError(f"row ids out of range for a matrix of {self.rows} rows")
        if self.qtype == kernels.BF16_PANELS:
            return kernels.bf16_panel_rows(self.data, ids, cols)
        if self.qtype - kernels.PANELS in kernels.BYTE_LAYOUTS:
            return kernels.panel_rows(self.qtype, self.data, ids, cols)
        if self.qtype > kernels.PANELS:
            raise ValueError(
                f"a {QTYPE_NAMES[self.qtype]} matrix laid out as packed panels has no rows to look up "
                "(only the 8-bit kernel reads it; dequantise the file's bytes)"
            )
        return kernels.dequant_rows(self.qtype, self.data, self.scales, ids, cols)


@dataclass
class QuantTensor:
    parts: list[QuantPart]
    cols: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    activations: str = "int8"  # kernels.ACTIVATIONS
    input_order: torch.Tensor | None = None  # GPTQ act-order: x[..., input_order] @ W^T
    _plan: kernels.Plan | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def plan(self) -> kernels.Plan:
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
        return QuantTensor(self.parts, self.cols, dtype, self.device, self.activations, self.input_order)

    @staticmethod
    def cat(tensors: list[QuantTensor]) -> QuantTensor:
        """Row-stack a fused projection; parts keep their formats and bytes."""
        assert len({t.cols for t in tensors}) == 1
        parts, first = [p for t in tensors for p in t.parts], tensors[0]
        if not all(same_input_order(t.input_order, first.input_order) for t in tensors):
            raise ValueError("row-stacked matrices multiply their inputs in one order (act-order g_idx)")
        return QuantTensor(parts, first.cols, first.dtype, activations=first.activations, input_order=first.input_order)

    def slice_rows(self, start: int, stop: int) -> QuantTensor:
        """Output channels [start, stop) as views of the parts' bytes (a column-parallel shard)."""
        _check_range("rows", start, stop, self.shape[0])
        parts, first = [], 0
        for part in self.parts:
            lo, hi = max(start, first), min(stop, first + part.rows)
            if lo < hi:
                parts.append(part.slice_rows(lo - first, hi - first))
            first += part.rows
        return QuantTensor(parts, self.cols, self.dtype, self.device, self.activations, self.input_order)

    def slice_columns(self, start: int, stop: int) -> QuantTensor:
        _check_range("columns", start, stop, self.cols)
        if self.input_order is not None:
            raise ValueError("an act-order (g_idx) matrix is not split by columns: its groups mix every rank's inputs")
        parts = [p.slice_columns(start, stop, self.cols) for p in self.parts]
        return QuantTensor(parts, stop - start, self.dtype, self.device, self.activations)

    def in_panels(self, lookups: bool = False) -> QuantTensor:
        """Parts laid out as the 8-bit kernel's panels where it or the tiles multiply the matrix: Q8_0
        always, nibble formats only where the 8-bit kernel alone reads them (its VNNI and AMX paths
        both do; not the bf16 tiles, not `lookups`)."""
        tiles = self.plan.tiles and self.dtype == torch.bfloat16
        if not (self.plan.q8_formats and (self.plan.q8 or tiles)):
            return self
        packed = self.plan.q8 and not lookups
        formats = kernels.LAYOUTS if packed else kernels.BYTE_LAYOUTS
        parts = [p.in_panels(self.cols, formats) for p in self.parts]
        if all(new is old for new, old in zip(parts, self.parts, strict=True)):
            return self
        return QuantTensor(parts, self.cols, self.dtype, self.device, self.activations, self.input_order)

    def with_activations(self, activations: str) -> QuantTensor:
        return QuantTensor(self.parts, self.cols, self.dtype, self.device, activations, self.input_order)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix in the layer's input order: the reference."""
        return in_input_order(
            torch.cat([p.dequantize(torch.arange(p.rows), self.cols) for p in self.parts]), self.input_order
        )


def _check_range(what: str, start: int, stop: int, size: int) -> None:
    if not 0 <= start < stop <= size:
        raise ValueError(f"{what} [{start}, {stop}) are not a slice of a matrix's {size} {what}")


def quant_linear(x: torch.Tensor, weight: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a quantised weight, in x's dtype with fp32 sums; the plan picks 8-bit
    activations or AMX tiles, else bf16 dot products or fp32."""
    plan = weight.plan
    if weight.input_order is not None:
        x = x.index_select(-1, weight.input_order)
    bf16 = x.dtype == torch.bfloat16
    fast = plan.fast(x.dtype)
    if fast and bias is None and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float32):
        # the decode path: no copies, no repeated checks
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
    """A dense bf16 [n, k] weight as `bf16_panels.c`'s panels: same size, one summation order."""
    part = QuantPart(kernels.BF16_PANELS, kernels.bf16_panels(weight.detach()), panel_rows=weight.shape[0])
    return QuantTensor([part], weight.shape[1], torch.bfloat16, activations="bf16")


def dense_panels_supported(weight: torch.Tensor | QuantTensor) -> bool:
    return (
        isinstance(weight, torch.Tensor)
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and kernels.bf16_panels_available()
    )


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> QuantTensor:
    """Per-channel symmetric int8 (k a multiple of 32)."""
    data, scales = kernels.quantize_i8(weight)
    return QuantTensor([QuantPart(kernels.I8, data, scales)], weight.shape[1], dtype)


def set_quantized(module: nn.Module, name: str, weight: QuantTensor) -> None:
    """Replace a parameter by a quantised weight (a plain attribute)."""
    if name in module._parameters:
        del module._parameters[name]
    setattr(module, name, weight)


def same_input_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Two matrices gather their inputs alike (act-order `input_order`s, None: as they come)."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def in_input_order(stored: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A matrix whose columns are stored in `order` (act-order), with its columns put back."""
    if order is None:
        return stored
    out = torch.empty_like(stored)
    out[:, order] = stored
    return out


def weights_of(model: nn.Module, kinds: type | tuple[type, ...]) -> dict[str, object]:
    """Every weight of `model` held as a plain attribute of one of `kinds`, by dotted name."""
    found = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, kinds):
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def quantized_weights(model: nn.Module) -> dict[str, QuantTensor]:
    return weights_of(model, QuantTensor)


def describe(model: nn.Module) -> str | None:
    """'Q5_0+Q6_K+Q8_0'-style summary of the formats a model runs, None when it is not quantised."""
    formats = sorted({f for w in quantized_weights(model).values() for f in w.formats})
    return "+".join(formats) or None
