"""A checkpoint's tokenizer: `tokenizers` for text <-> ids, plus its special tokens and chat template.

Reads `tokenizer.json`, `tokenizer_config.json` and, when present, `chat_template.jinja`
and `generation_config.json` (whose `eos_token_id` list real checkpoints use to stop). For a
GGUF file, the same two come from its metadata (`gguf_tokenizer.py`).
"""

from __future__ import annotations

import functools
import json
import os

from tokenizers import Tokenizer as HFTokenizer

from treeserve.models.chat import render_chat
from treeserve.models.gguf_loader import is_gguf, read_gguf

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"malformed JSON file {path!r}: {e}") from e


def _load(model_dir: str) -> tuple[HFTokenizer, dict]:
    if is_gguf(model_dir):
        from treeserve.models.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(read_gguf(model_dir))
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir!r}")
    try:
        hf = HFTokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"malformed tokenizer.json in {model_dir!r}: {e}") from e
    return hf, _read_json(os.path.join(model_dir, "tokenizer_config.json"))


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-unicode map: printable bytes stand for themselves, the rest are shifted to 256+."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    chars, shift = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return chars


class Tokenizer:
    def __init__(self, model_dir: str, model_eos_ids: list[int] | None = None):
        """`model_dir`: a Hugging Face checkpoint directory or a GGUF file."""
        self.hf, config = _load(model_dir)
        self.special_tokens = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k)))}
        self.chat_template = self._find_chat_template(model_dir, config)
        eos_ids = set(model_eos_ids or [])
        gen_eos = _read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id")
        eos_ids.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        eos_text = self.special_tokens.get("eos_token")
        if eos_text is not None and (eos_id := self.hf.token_to_id(eos_text)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids = sorted(eos_ids)
        self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _find_chat_template(model_dir: str, config: dict) -> str | None:
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                return f.read()
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            return named.get("default")
        return template

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in characters: a text of c characters is at least
        c / max_token_chars tokens (a bound that needs no tokenising)."""
        return max(len(token) for token in self.hf.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError as e:  # e.g. a lone UTF-16 surrogate, which JSON can carry
            raise ValueError(f"the text cannot be tokenized (is it valid Unicode?): {e}") from e

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_bytes(self) -> tuple[list[bytes], list[int]]:
        """Each token id's bytes in decoded text (what a constraint library matches text against)
        and the ids of special tokens (which decode to nothing). Follows the decoder: byte-level
        (GPT-2's byte-to-unicode alphabet), SentencePiece-style (`<0xNN>` byte pieces, U+2581 as a
        space) or plain (the token's text)."""
        decoder = json.loads(self.hf.decoder.__getstate__()) if self.hf.decoder is not None else {}
        kinds = {d.get("type") for d in decoder.get("decoders") or [decoder]}
        specials = {i for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
        texts = [""] * self.vocab_size
        for text, i in self.hf.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                texts[i] = text
        to_byte = {c: b for b, c in _byte_level_alphabet().items()}
        out = []
        for i, text in enumerate(texts):
            if i in specials:
                out.append(b"")
            elif "ByteLevel" in kinds:
                out.append(bytes(to_byte[c] for c in text) if all(c in to_byte for c in text) else text.encode())
            elif "ByteFallback" in kinds and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                out.append(bytes([int(text[3:5], 16)]))
            elif kinds & {"Metaspace", "ByteFallback", "Replace"}:
                out.append(text.replace("\u2581", " ").encode())
            else:
                out.append(text.encode())
        return out, sorted(specials)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: object,
    ) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        return render_chat(
            template, messages, self.special_tokens, add_generation_prompt, continue_final_message, **kwargs
        )
