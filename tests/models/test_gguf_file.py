"""Our GGUF reader against the `gguf` package's: same metadata values, same tensor table and
bytes, on the tiny files the suite writes; bad files are refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tests.gguf_files import write_gguf
from tests.tiny_models import build_checkpoint
from treeserve.models.gguf_file import GGUFFile, Strings


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("gguf-file")
    hf = build_checkpoint(str(root / "hf"), "gemma3_text", head_dim=16, num_hidden_layers=2, sliding_window=8)
    return write_gguf(hf, str(root / "tiny.gguf"), "gemma3")


def test_fields_and_tensors_equal_the_gguf_packages_reader(tiny_gguf):
    ours, ref = GGUFFile(tiny_gguf), gguf.GGUFReader(tiny_gguf)
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]  # the package adds header pseudo-fields
    assert sorted(ours.fields) == sorted(keys)
    for key in keys:
        assert ours.get_field(key).contents() == ref.fields[key].contents(), key
        if isinstance(ours.fields[key].value, Strings | np.ndarray):  # arrays: .data has one entry an element
            assert len(ours.fields[key].data) == len(ref.fields[key].data), key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name,
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
    assert torch.from_numpy(ours.tensors[0].data).numel() > 0  # writable view: no copy, no warning


def test_bad_files_are_refused(tmp_path, tiny_gguf):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="bad magic"):
        GGUFFile(str(bad))
    data = Path(tiny_gguf).read_bytes()
    for cut in (0, 10, 200, len(data) - 100):
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="malformed GGUF file"):
            GGUFFile(str(bad))


def test_string_arrays_are_read_from_the_map(tmp_path, tiny_gguf):
    """A vocabulary is kept as offsets into the map (no Python string a token while the reader
    is cached), read the same; a token that is not UTF-8 is refused when read."""
    tokens = GGUFFile(tiny_gguf).fields["tokenizer.ggml.tokens"].value
    assert isinstance(tokens, Strings) and tokens.starts.dtype == np.int64
    listed = tokens.tolist()
    assert len(tokens) == len(listed) > 2 and [tokens[0], tokens[-1]] == [listed[0], listed[-1]]
    with pytest.raises(IndexError):
        tokens[len(tokens)]
    data = bytearray(Path(tiny_gguf).read_bytes())
    data[int(tokens.starts[1])] = 0xFF  # never a byte of UTF-8
    bad = tmp_path / "bad-token.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="malformed GGUF file"):
        GGUFFile(str(bad)).fields["tokenizer.ggml.tokens"].contents()
