"""GGUF checkpoints: loading (dequantisation, llama.cpp's tensor layout undone) and conversion.

Tiny Llama and Gemma 3 checkpoints are written as GGUF files the way llama.cpp's converter
writes them (`tests/gguf_files.py`, Q8_0/Q5_0/Q4_0 weights). The reference is transformers
loading the same GGUF file with its own GGUF reader: our fp32 logits must equal its logits.
The converted Hugging Face directory must load in transformers and give the same logits too.
Our side loads the file dequantised (`dequantize=True`): the reader is what is tested here; the
quantised kernels are compared with this dequantised model in `test_quantized_models.py`.
Phi-3 (transformers' GGUF reader drops its rotated share and longrope) is written in F32 and
compared with transformers on the checkpoint the file was written from.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tests import gguf_files
from tests.gguf_files import write_gguf
from tests.models.test_parity import our_logits
from tests.tiny_models import build_checkpoint
from treeserve import ScoreParams
from treeserve.cli import main
from treeserve.models.gguf_loader import GGUFCheckpoint
from treeserve.models.loader import read_model_config

IDS = list(range(3, 40))  # longer than the Gemma window (8)

GEMMA = dict(head_dim=16, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16)


def _gguf(tmp_path, arch: str, **overrides) -> str:
    model_type = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}.get(arch, arch)
    hf_dir = build_checkpoint(str(tmp_path / "hf"), model_type, **overrides)
    return write_gguf(hf_dir, str(tmp_path / "hf" / "tiny.gguf"), arch)


def _transformers_logits(model_dir: str, gguf_file: str | None = None, **config) -> torch.Tensor:
    auto = transformers.AutoModelForCausalLM
    hf = auto.from_pretrained(model_dir, gguf_file=gguf_file, dtype=torch.float32, **config)
    with torch.no_grad():
        return hf.eval()(torch.tensor([IDS])).logits[0]


def _our_logits(llm) -> torch.Tensor:  # noqa: ANN001 - treeserve.LLM
    out = llm.score([IDS], ScoreParams(positions=list(range(len(IDS))), return_hidden_states=True))[0]
    return llm.engine.model.compute_logits(out.hidden_states)


@pytest.mark.parametrize(
    "arch,overrides", [("llama", {}), ("gemma3", GEMMA), ("qwen3", {}), ("qwen3moe", {"mlp_only_layers": []})]
)  # llama.cpp: every layer routed
def test_gguf_logits_equal_transformers_gguf_reader(tmp_path, make_llm, arch, overrides):
    path = _gguf(tmp_path, arch, **overrides)
    # transformers' GGUF reader leaves query_pre_attn_scalar at its default (256, the real models'
    # head_dim); llama.cpp, and we, take the file's head_dim
    config = {"query_pre_attn_scalar": overrides["head_dim"]} if arch == "gemma3" else {}
    if arch == "qwen3":  # nor does it read head_dim from attention.key_length (Qwen3's is no hidden / heads)
        config = {"head_dim": 32}
    if arch == "qwen3moe":  # nor the experts' width from expert_feed_forward_length
        config = {"moe_intermediate_size": 32}
    ref = _transformers_logits(os.path.dirname(path), os.path.basename(path), **config)
    diff = (_our_logits(make_llm(path, dequantize=True)) - ref).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff {diff}"


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_gguf_phi3_logits_equal_transformers(tmp_path, make_llm, rope):
    """Phi-4-mini's layout (fused q/k/v and gate/up, 0.75 of each head rotated), with and without
    longrope: an F32 file loads to the logits transformers gives on the checkpoint it came from,
    as that checkpoint does in treeserve."""
    hf_dir = build_checkpoint(str(tmp_path / "hf"), "phi3", **({"rope_scaling": None} if rope == "default" else {}))
    path = write_gguf(hf_dir, str(tmp_path / "tiny.gguf"), "phi3", quants=("F32",))
    config = GGUFCheckpoint(path).config
    assert config["partial_rotary_factor"] == 0.75 and config["original_max_position_embeddings"] == 64
    assert (config["rope_scaling"] or {}).get("rope_type", "default") == rope
    ref = _transformers_logits(hf_dir)
    for model in (path, hf_dir):
        diff = (_our_logits(make_llm(model)) - ref).abs().max().item()
        assert diff <= 1e-4, f"{model}: max abs logit diff {diff}"


def test_gguf_phi3_longrope_past_the_pretraining_length(tmp_path, make_llm):
    """Past original_max_position_embeddings (64) the file's long factors take over as the
    checkpoint's do (`test_families.py` checks those against transformers at the crossing)."""
    hf_dir = build_checkpoint(str(tmp_path / "hf"), "phi3")
    path = write_gguf(hf_dir, str(tmp_path / "tiny.gguf"), "phi3", quants=("F32",))
    ids = torch.randint(5, 400, (80,), generator=torch.Generator().manual_seed(0)).tolist()
    assert torch.equal(our_logits(make_llm(path), ids), our_logits(make_llm(hf_dir), ids))


def test_gguf_phi3_longrope_without_both_factors_is_refused(tmp_path, monkeypatch):
    hf_dir = build_checkpoint(str(tmp_path / "hf"), "phi3")
    add_phi3 = gguf_files._add_phi3
    long_only = lambda *args: {k: v for k, v in add_phi3(*args).items() if "long" in k}  # noqa: E731
    monkeypatch.setattr(gguf_files, "_add_phi3", long_only)
    path = write_gguf(hf_dir, str(tmp_path / "tiny.gguf"), "phi3", quants=("F32",))
    with pytest.raises(ValueError, match="longrope needs rope_factors_long, rope_factors_short"):
        read_model_config(path)


def test_gemma_layer_pattern_from_metadata(tmp_path):
    """Newer converters write one sliding/global flag per layer; older files rely on the period 6."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    path = _gguf(tmp_path, "gemma3", head_dim=16, num_hidden_layers=3, sliding_window=8, layer_types=layer_types)
    assert GGUFCheckpoint(path).config["layer_types"] == layer_types


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("gemma3", GEMMA), ("phi3", {})])
def test_convert_gguf_writes_a_directory_transformers_loads(tmp_path, make_llm, arch, overrides):
    path = _gguf(tmp_path, arch, **overrides)
    out = str(tmp_path / "converted")
    assert main(["convert-gguf", path, out]) == 0
    ref = _transformers_logits(out)
    assert (_our_logits(make_llm(path, dequantize=True)) - ref).abs().max().item() <= 1e-4
    assert (_our_logits(make_llm(out)) - ref).abs().max().item() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "Compute (12 + 7) * 3 - 15."
    assert tokenizer(text).input_ids == make_llm(path).get_tokenizer().encode(text)


def test_bad_gguf_files_are_refused(tmp_path, make_llm):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="malformed GGUF"):
        make_llm(str(junk))
    assert main(["convert-gguf", str(junk), str(tmp_path / "out")]) == 2
    assert main(["convert-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2


def test_every_entry_point_accepts_a_gguf_model_path(tmp_path):
    """The engine, `eval` and `serve` check model paths with one rule: a directory or a .gguf file."""
    from treeserve.config import check_model_path
    from treeserve.eval.runner import EvalSettings
    from treeserve.runtime.model_settings import ModelSettings
    from treeserve.server.settings import ServerSettings

    path = _gguf(tmp_path, "llama")
    check_model_path(path)
    ServerSettings(ModelSettings(path), prm=None).check()
    EvalSettings(generator=ModelSettings(path)).check()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        check_model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="a checkpoint directory or a .gguf file"):
        check_model_path(str(tmp_path / "nope.gguf"))
