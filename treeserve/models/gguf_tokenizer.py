"""A GGUF file's tokenizer (`tokenizer.ggml.*` keys) rebuilt as a `tokenizers.Tokenizer` plus a
`tokenizer_config.json`, giving llama.cpp's `llama_tokenize(text, add_special=True,
parse_special=True)` ids; mirrors `llama-vocab.cpp`.
- "llama" (SPM: Llama 2, Gemma 3): BPE with a merge for every split of a token into two tokens,
  ranked by the merged token's score; byte fallback; "▁" before every fragment when
  `add_space_prefix` (default true); no pre-tokenizer.
- "gpt2" (byte-level BPE) with llama.cpp's pre-tokenizer regexes for "gpt-2", "llama-bpe",
  "qwen2" and "default"; anything else raises ValueError.
Control (3) and unknown (2) tokens become special added tokens, user-defined (4) plain ones. Gap:
`tokenizers` matches special tokens leftmost-longest, llama.cpp longest first (only overlapping
ones differ); llama.cpp's name-based fix-ups are not copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from treeserve.models.gguf_file import GGUFFile

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

# llama.cpp's `llm_tokenizer_bpe` regexes; each splits every piece the previous one left.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
_PRE_REGEXES = {
    "gpt2": [_GPT2],
    "gpt-2": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "qwen2": [_QWEN2],
    "default": _DEFAULT,
}
_LLAMA3_PRES = {"llama-bpe", "llama3", "llama-v3"}

# Special ids llama.cpp assumes for an SPM vocabulary whose file does not name them.
_SPM_DEFAULT_IDS = {"bos": 1, "eos": 2, "unk": 0}
_ID_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


def tokenizer_from_gguf(reader: GGUFFile) -> tuple[Tokenizer, dict]:
    """-> (tokenizer, tokenizer_config: special token strings, add_bos/eos_token, chat_template)."""
    model_type = _value(reader, "tokenizer.ggml.model")
    if model_type not in ("llama", "gpt2"):
        raise ValueError(f"unsupported GGUF tokenizer model {model_type!r}: only 'llama' (SPM) and 'gpt2' (BPE)")
    pre = _value(reader, "tokenizer.ggml.pre") or "default"
    if model_type == "gpt2" and pre not in _PRE_REGEXES:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} for 'gpt2' tokenizer: one of {sorted(_PRE_REGEXES)}")

    tokens = _tokens(reader)
    types = _array(reader, "tokenizer.ggml.token_type", np.int32, len(tokens), default=1)
    ids = _special_ids(reader, model_type, len(tokens))
    add_bos = bool(_value(reader, "tokenizer.ggml.add_bos_token", model_type == "llama" or pre in _LLAMA3_PRES))
    add_eos = bool(_value(reader, "tokenizer.ggml.add_eos_token", False))
    for flag, name in ((add_bos, "bos"), (add_eos, "eos")):
        if flag and name not in ids:
            raise ValueError(f"tokenizer.ggml.add_{name}_token is true but the file has no {name} token id")

    if model_type == "llama":
        scores = _array(reader, "tokenizer.ggml.scores", np.float32, len(tokens), default=0.0)
        add_prefix = bool(_value(reader, "tokenizer.ggml.add_space_prefix", True))
        tokenizer = _spm_tokenizer(tokens, scores, ids.get("unk"), add_prefix)
    else:
        merges = _value(reader, "tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("GGUF 'gpt2' tokenizer has no tokenizer.ggml.merges")
        tokenizer = _bpe_tokenizer(tokens, merges, pre)

    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in np.flatnonzero(types == USER_DEFINED)]
    )
    special = np.flatnonzero((types == CONTROL) | (types == UNKNOWN))
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    tokenizer.post_processor = _post_processor(tokens, ids, add_bos, add_eos)

    config: dict = {f"{name}_token": tokens[i] for name, i in ids.items()}
    config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    template = _value(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return tokenizer, config


def _spm_tokenizer(tokens: list[str], scores: np.ndarray, unk: int | None, add_prefix: bool) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_token = tokens[unk] if unk is not None else None
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=_spm_merges(tokens, vocab, scores), unk_token=unk_token, byte_fallback=True)
    )
    prefix = [normalizers.Prepend("▁")] if add_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def _spm_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray) -> list[tuple[str, str]]:
    """Every (left, right) with left, right and left + right all tokens, best merged score first
    (ties by merged id; llama.cpp's by position differ only where two such merges compete)."""
    pairs: list[tuple[str, str]] = []
    merged: list[int] = []
    for i, token in enumerate(tokens):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                pairs.append((left, right))
                merged.append(i)
    merged_ids = np.asarray(merged, dtype=np.int64)
    order = np.lexsort((merged_ids, -scores[merged_ids]))
    return [pairs[j] for j in order]


def _bpe_tokenizer(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = []
    for merge in merges:
        cut = merge.find(" ", 1)
        if cut < 0:
            raise ValueError(f"malformed GGUF merge {merge!r}: expected 'left right'")
        pairs.append((merge[:cut], merge[cut + 1 :]))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRES))
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in _PRE_REGEXES[pre]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _post_processor(
    tokens: list[str], ids: dict[str, int], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing | None:
    if not (add_bos or add_eos):
        return None
    first = [tokens[ids["bos"]]] if add_bos else []
    last = [tokens[ids["eos"]]] if add_eos else []
    single = [*first, "$A", *last]
    pair = [*single, *(f"{t}:1" for t in first), "$B:1", *(f"{t}:1" for t in last)]
    special = {tokens[ids[name]]: ids[name] for name, added in (("bos", add_bos), ("eos", add_eos)) if added}
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(special.items()))


def _special_ids(reader: GGUFFile, model_type: str, n_tokens: int) -> dict[str, int]:
    defaults = _SPM_DEFAULT_IDS if model_type == "llama" else {}
    ids = {}
    for name, key in _ID_KEYS.items():
        value = _value(reader, f"tokenizer.ggml.{key}", defaults.get(name))
        if value is not None and 0 <= int(value) < n_tokens:
            ids[name] = int(value)
    return ids


def _tokens(reader: GGUFFile) -> list[str]:
    tokens = _value(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    # llama.cpp renames empty tokens the same way, so that ids stay one per distinct text.
    tokens = [token or f"[EMPTY_{i}]" for i, token in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    return tokens


def _array(reader: GGUFFile, key: str, dtype: type, n: int, default: float) -> np.ndarray:
    values = _value(reader, key)
    if values is None:
        return np.full(n, default, dtype=dtype)
    if len(values) < n:
        raise ValueError(f"GGUF {key} has {len(values)} entries for {n} tokens")
    return np.asarray(values[:n], dtype=dtype)


def _value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()
