"""A checkpoint's tokenizer (`tokenizers`) with its special tokens, chat template and
`generation_config.json`'s eos ids; a GGUF file's come from `gguf_tokenizer.py`.
"""

from __future__ import annotations

import functools
import json
import os
import re

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


def _fallback_byte(text: str) -> int | None:
    """The byte a `<0xNN>` piece stands for, by ByteFallback's own test: six UTF-8 bytes, `<0x`,
    `>`, and Rust's `u8::from_str_radix(_, 16)` on the two in between (which takes a leading `+`)."""
    if not (text.startswith("<0x") and text.endswith(">") and len(text.encode()) == 6):
        return None
    digits = text[3:-1]
    return int(digits, 16) if re.fullmatch(r"\+?[0-9A-Fa-f]{1,2}", digits) and len(digits) == 2 else None


def decoded_token_bytes(hf: HFTokenizer) -> tuple[list[bytes], list[int]]:
    """Each token id's bytes in decoded text (b"" for none) and the special ids, following the
    decoder: byte-level, SentencePiece-style (`<0xNN>`, U+2581) or plain; added tokens first."""
    decoder = json.loads(hf.decoder.__getstate__()) if hf.decoder is not None else {}
    kinds = {d.get("type") for d in decoder.get("decoders") or [decoder]}
    added = hf.get_added_tokens_decoder()
    specials = sorted(i for i, t in added.items() if t.special)
    size = max(hf.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    texts = [hf.id_to_token(i) for i in range(size)]
    if "ByteLevel" in kinds:
        return [b"" if t is None else _byte_level_bytes(t) for t in texts], specials
    fallback = "ByteFallback" in kinds
    spaces = bool(kinds & {"Metaspace", "ByteFallback", "Replace"})
    out = []
    for text in texts:
        if text is None:
            out.append(b"")
        elif fallback and (byte := _fallback_byte(text)) is not None:
            out.append(bytes([byte]))
        else:
            out.append((text.replace("\u2581", " ") if spaces else text).encode())
    return out, specials


def _byte_level_bytes(text: str) -> bytes:
    """A byte-level token's bytes: its characters mapped back through GPT-2's alphabet, or its UTF-8
    when one of them is outside it (as the ByteLevel decoder does)."""
    try:
        return text.translate(_FROM_BYTE_LEVEL).encode("latin-1")
    except UnicodeEncodeError:
        return text.encode()


# str.translate table back from GPT-2's alphabet to the byte values (as latin-1 characters); the
# latin-1 characters outside the alphabet become U+FFFF, which makes latin-1 encoding fail
_FROM_BYTE_LEVEL = {ord(c): chr(b) for b, c in _byte_level_alphabet().items()}
_FROM_BYTE_LEVEL.update({c: "\uffff" for c in range(256) if c not in _FROM_BYTE_LEVEL})


class Tokenizer:
    def __init__(self, model_dir: str, model_eos_ids: list[int] | None = None):
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
        """`decoded_token_bytes` with special tokens emptied (what constraint libraries match)."""
        pieces, specials = decoded_token_bytes(self.hf)
        out = [pieces[i] if i < len(pieces) else b"" for i in range(self.vocab_size)]
        for i in specials:
            if i < self.vocab_size:
                out[i] = b""
        return out, specials

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
