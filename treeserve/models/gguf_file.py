"""Read a GGUF file's metadata and tensor table fast, its tensor bytes memory-mapped.

The `gguf` package's reader builds numpy views for every element of every metadata array:
for Gemma 3's 262,144-token vocabulary that is ~10-18 s, most of a model load. This reader
parses the same format (v2/v3, little-endian) with one pass over the header: numeric arrays
become one `np.frombuffer` each, string arrays one tight loop that records where each string
lies in the map (`Strings`: 8 bytes a string, decoded when read; a vocabulary of 262k tokens
held as Python strings was ~20 MB for as long as the reader is cached). It offers the part of
`gguf.GGUFReader`'s interface treeserve uses: `fields[key].contents()` (same values; arrays as lists),
`len(fields[key].data)`, `get_field(key)`, and `tensors` with `name`, `tensor_type`, `shape`
(GGUF's dimension order), `n_elements`, `n_bytes`, `data_offset` and `data` (a view into the
map shaped as the `gguf` package shapes it). The map is copy-on-write, so tensors can be
wrapped by `torch.from_numpy` without a copy and without a read-only warning; nothing is
ever written back to the file.
"""

from __future__ import annotations

import array
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
# GGUF value types -> (struct format, numpy dtype); 8 is a string, 9 an array
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
_TYPED = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class Strings:
    """An array of strings in the map, read where they lie: string i is the UTF-8 bytes
    [starts[i], starts[i + 1] - 8) (each string after the first follows its 8-byte length)."""

    def __init__(self, buffer: memoryview, starts: np.ndarray, path: str):
        self.buffer, self.starts, self.path = buffer, starts, path

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, i: int) -> str:
        i = range(len(self))[i]  # IndexError outside, negative i from the end
        return self._decode(int(self.starts[i]), int(self.starts[i + 1]) - 8)

    def tolist(self) -> list[str]:
        ends = (self.starts[1:] - 8).tolist()
        return [self._decode(start, end) for start, end in zip(self.starts[:-1].tolist(), ends, strict=True)]

    def _decode(self, start: int, end: int) -> str:
        try:
            return str(self.buffer[start:end], "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"malformed GGUF file {self.path!r}: {e}") from e


@dataclass
class Field:
    value: object  # a Python scalar or str, `Strings` (string arrays), or a numpy array (numeric arrays)

    @property
    def data(self) -> object:
        return self.value

    def contents(self) -> object:
        """The value as `gguf.ReaderField.contents()` gives it (arrays as Python lists)."""
        return self.value.tolist() if isinstance(self.value, np.ndarray | Strings) else self.value


@dataclass
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dims, GGUF order (innermost first)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        try:
            self.mmap = np.memmap(path, dtype=np.uint8, mode="c")  # raises ValueError on an empty file
            self.buffer = memoryview(self.mmap)
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as e:
            raise ValueError(f"malformed GGUF file {path!r}: {e}") from e

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    # ---- parsing -----------------------------------------------------------------------
    def _unpack(self, fmt: str) -> object:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        text = bytes(self.buffer[self.offset : end]).decode("utf-8")
        self.offset = end
        return text

    def _strings(self, count: int) -> Strings:
        buffer, offset, starts = self.buffer, self.offset, array.array("q")
        size = len(buffer)
        for _ in range(count):
            length = int.from_bytes(buffer[offset : offset + 8], "little")
            offset += 8
            if offset + length > size:
                raise ValueError("a string runs past the end of the file")
            starts.append(offset)
            offset += length
        starts.append(offset + 8)  # where a next string would start
        self.offset = offset
        return Strings(buffer, np.frombuffer(starts, dtype=np.int64), self.path)

    def _value(self, kind: int) -> object:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<I"), self._unpack("<Q")
            if item == _STRING:
                return self._strings(count)
            if item not in _SCALARS:
                raise ValueError(f"unsupported array element type {item}")
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.offset)
            self.offset += count * dtype.itemsize
            return values
        if kind not in _SCALARS:
            raise ValueError(f"unsupported metadata value type {kind}")
        return self._unpack(_SCALARS[kind][0])

    def _parse(self) -> None:
        if bytes(self.buffer[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self.offset = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_fields = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = Field(self._value(self._unpack("<I")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        alignment = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-self.offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")

    def _tensor(self, start: int, name: str, dims: list[int], kind: GGMLQuantizationType, offset: int) -> Tensor:
        n_elements = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block
        at = start + offset
        if at + n_bytes > len(self.mmap):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        if kind in _TYPED:
            data = self.mmap[at : at + n_bytes].view(_TYPED[kind]).reshape(shape)
        else:
            data = self.mmap[at : at + n_bytes].reshape(quant_shape_to_byte_shape(shape, kind))
        return Tensor(name, kind, np.array(dims, dtype=np.uint64), n_elements, n_bytes, at, data)
