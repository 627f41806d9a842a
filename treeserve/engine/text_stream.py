"""Incremental detokenisation: the chunks `tokenizers`' `DecodeStream` gives, for less host time.

`text_stream` picks a sequence's stream, each with `step(token)` and `extend(tokens)`, each
returning exactly what `DecodeStream.step` would: `JoinedStream` for ByteLevel and Fuse decoders
(bytes joined as lossy UTF-8, no call into the tokenizer), `TextStream` for the other decoders
whose text is each id's own text concatenated (`qualifies`), `DecodeSteps` for the rest.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from treeserve.models.tokenizer import decoded_token_bytes

_REPLACEMENT = "\ufffd"  # lossy UTF-8's stand-in for invalid bytes; DecodeStream waits while the text ends in it


@dataclass(frozen=True)
class StreamTable:
    """One tokenizer's tables for one `skip_special_tokens` setting, indexed by token id."""

    raw: list[bytes]
    texts: list[str | None]  # the text the shortcut returns for the id; None where it cannot take it
    joins_bytes: bool = False  # the decoder's text of any ids is their bytes joined, as lossy UTF-8


@dataclass
class _Entry:
    key: tuple[bytes, int]
    qualified: bool
    joins_bytes: bool
    tables: dict[bool, StreamTable] = field(default_factory=dict)


_ENTRIES: weakref.WeakKeyDictionary[HFTokenizer, _Entry] = weakref.WeakKeyDictionary()


def qualifies(decoder: dict | None) -> bool:
    """Whether a decoder (JSON state) gives each id's own text concatenated, but for the first character."""
    if decoder is None:
        return False
    kind = decoder.get("type")
    if kind in ("ByteLevel", "Fuse"):
        return True
    if kind == "Metaspace":
        return decoder.get("replacement") == "\u2581"  # the first token loses its ▁s, the others get spaces
    if kind != "Sequence":
        return False
    steps = list(decoder.get("decoders") or [])
    if steps and steps[-1] == {"type": "Strip", "content": " ", "start": 1, "stop": 0}:
        steps.pop()  # after Fuse it strips one leading space of the whole text
    replace = {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}
    return steps == [replace, {"type": "ByteFallback"}, {"type": "Fuse"}]


def _shortcut_text(data: bytes) -> str | None:
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    return text if text and not text.endswith(_REPLACEMENT) else None


def stream_table(hf: HFTokenizer, skip_special_tokens: bool) -> StreamTable | None:
    """The tokenizer's table, cached per decoder and vocabulary; None when its decoder does not qualify."""
    decoder = hf.decoder
    state = decoder.__getstate__() if decoder is not None else b"null"
    key = (state, hf.get_vocab_size(with_added_tokens=True))
    entry = _ENTRIES.get(hf)
    if entry is None or entry.key != key:
        decoder_state = json.loads(state)
        joins = decoder_state is not None and decoder_state.get("type") in ("ByteLevel", "Fuse")
        entry = _ENTRIES[hf] = _Entry(key, qualifies(decoder_state), joins)
    if not entry.qualified:
        return None
    table = entry.tables.get(skip_special_tokens)
    if table is None:
        raw, specials = decoded_token_bytes(hf)
        if skip_special_tokens:
            for i in specials:
                raw[i] = b""
        texts = [_shortcut_text(b) for b in raw]
        table = entry.tables[skip_special_tokens] = StreamTable(raw, texts, entry.joins_bytes)
    return table


class DecodeStreamError(Exception):
    """DecodeStream's InvalidPrefix error (a plain Exception there, with this message)."""


class TextStream:
    """`DecodeStream`'s algorithm (`_step`) with a shortcut: while the window is all prefix and
    valid UTF-8, a token whose own text is valid, non-empty UTF-8 not ending in U+FFFD returns
    that text from the table (why it equals DecodeStream's: docs/decisions.md)."""

    __slots__ = ("_hf", "_skip", "_raw", "_texts", "_fast", "_last", "_ids", "_prefix", "_prefix_index")

    def __init__(self, hf: HFTokenizer, table: StreamTable, context: list[int], skip_special_tokens: bool):
        self._hf = hf
        self._skip = skip_special_tokens
        self._raw = table.raw
        self._texts = table.texts
        self._last: int | None = None  # on the shortcut: the window is this one token
        self._ids = list(context)
        self._prefix = ""
        self._prefix_index = 0
        if self._ids:  # DecodeStream(ids=context) takes the context's text as its prefix on its first step
            self._take_prefix()
        self._fast = self._prefix_index == len(self._ids) and self._clean(self._ids)

    def step(self, token: int) -> str | None:
        if self._fast:
            try:
                text = self._texts[token]
            except IndexError:
                text = None
            if text is not None:
                self._last = token
                return text
            self._fast = False
            if self._last is not None:  # the window the shortcut left: that token, its text the prefix
                self._ids = [self._last]
                self._prefix = self._decode(self._ids)
                self._prefix_index = 1
                self._last = None
        return self._step(token)

    def extend(self, tokens: list[int]) -> str:
        return _joined_steps(self.step, tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=self._skip)

    def _take_prefix(self) -> None:
        prefix = self._decode(self._ids)
        if not prefix.endswith(_REPLACEMENT):
            self._prefix, self._prefix_index = prefix, len(self._ids)

    def _clean(self, ids: list[int]) -> bool:
        """The shortcut's condition: the window's bytes are valid, non-empty UTF-8, all ids in the table."""
        if max(ids, default=0) >= len(self._raw):
            return False
        data = b"".join([self._raw[i] for i in ids])
        try:
            data.decode()
        except UnicodeDecodeError:
            return False
        return bool(data)

    def _step(self, token: int) -> str | None:
        """tokenizers' `step_decode_stream`, line for line (Rust compares the texts' UTF-8 lengths)."""
        ids = self._ids
        if not self._prefix and ids:
            self._take_prefix()
        ids.append(token)
        string = self._decode(ids)
        prefix = self._prefix
        if len(string.encode()) <= len(prefix.encode()) or string.endswith(_REPLACEMENT):
            return None
        if not string.startswith(prefix):
            raise DecodeStreamError(
                "Invalid prefix encountered while decoding stream. Token ID: "
                f"{token}, Expected prefix: '{prefix}', Actual string: '{string}'"
            )
        text = string[len(prefix) :]
        new_prefix_index = len(ids) - self._prefix_index
        del ids[: self._prefix_index]
        self._prefix = self._decode(ids)
        self._prefix_index = new_prefix_index
        self._fast = self._clean(ids)  # all of the window is now its prefix
        return text


class JoinedStream:
    """`DecodeStream`'s algorithm on bytes, for decoders whose text is the ids' bytes as lossy UTF-8.
    The window is the prefix's bytes (`window`, text `prefix`) and those after it (`pending`)."""

    __slots__ = ("_raw", "_texts", "_window", "_pending", "_prefix", "_clean", "_last")

    def __init__(self, table: StreamTable, context: list[int]):
        self._raw, self._texts, self._last = table.raw, table.texts, None
        data = b"".join([self._bytes(i) for i in context])
        self._window, self._pending, self._prefix, self._clean = b"", data, "", False
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = _REPLACEMENT
        if text and not text.endswith(_REPLACEMENT):
            self._window, self._pending, self._prefix, self._clean = data, b"", text, True
        else:
            self._take_prefix()

    def _bytes(self, token: int) -> bytes:
        return self._raw[token] if token < len(self._raw) else b""

    def _take_prefix(self) -> None:
        """While the prefix is empty, all of the window becomes it, unless its text ends in U+FFFD."""
        if not self._prefix and (self._window or self._pending):
            data = self._window + self._pending
            text = data.decode("utf-8", "replace")
            if not text.endswith(_REPLACEMENT):
                self._window, self._pending, self._prefix = data, b"", text

    def _settle(self) -> None:
        try:
            self._clean = bool(self._window) and bool(self._window.decode())
        except UnicodeDecodeError:
            self._clean = False

    def extend(self, tokens: list[int]) -> str:
        """`step` over `tokens`, joined: the longest run not ending in U+FFFD in one decode (docs/decisions.md)."""
        raw, size = self._raw, len(self._raw)
        pieces = [raw[t] if t < size else b"" for t in tokens]
        data = self._pending + b"".join(pieces)
        run, end = len(tokens), len(data)
        while run and data[max(end - 4, 0) : end].decode("utf-8", "replace").endswith(_REPLACEMENT):
            run -= 1
            end -= len(pieces[run])
        if not run:
            return _joined_steps(self.step, tokens)
        done = data[:end]
        text = done.decode("utf-8", "replace")
        if text:  # the state the run's last chunk leaves: the window all prefix, nothing pending
            self._window, self._pending, self._prefix, self._last = done, b"", text, None
            self._clean = _REPLACEMENT not in text  # valid UTF-8
        return text + _joined_steps(self.step, tokens[run:]) if run < len(tokens) else text

    def step(self, token: int) -> str | None:
        if self._clean:
            try:
                text = self._texts[token]
            except IndexError:
                text = None
            if text is not None:
                self._last = token  # the window is now this token (set when the shortcut ends)
                return text
            self._clean = False
            if self._last is not None:
                self._window, self._prefix, self._last = self._raw[self._last], self._texts[self._last], None
        if not self._prefix:
            self._take_prefix()
        raw = self._raw
        pending = self._pending + (raw[token] if token < len(raw) else b"")
        string = (self._window + pending).decode("utf-8", "replace")
        prefix = self._prefix
        if string.endswith(_REPLACEMENT) or len(string.encode()) <= len(prefix.encode()):
            self._pending = pending
            return None
        if not string.startswith(prefix):
            raise DecodeStreamError(
                "Invalid prefix encountered while decoding stream. Token ID: "
                f"{token}, Expected prefix: '{prefix}', Actual string: '{string}'"
            )
        self._window, self._pending = pending, b""
        self._prefix = pending.decode("utf-8", "replace")
        self._settle()
        return string[len(prefix) :]


class DecodeSteps:
    __slots__ = ("step",)

    def __init__(self, hf: HFTokenizer, context: list[int], skip_special_tokens: bool):
        stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self.step: Callable[[int], str | None] = functools.partial(stream.step, hf)

    def extend(self, tokens: list[int]) -> str:
        return _joined_steps(self.step, tokens)


def _joined_steps(step: Callable[[int], str | None], tokens: list[int]) -> str:
    return "".join([chunk for token in tokens if (chunk := step(token))])


Stream = JoinedStream | TextStream | DecodeSteps


def text_stream(hf: HFTokenizer, context: list[int], skip_special_tokens: bool) -> Stream:
    table = stream_table(hf, skip_special_tokens)
    if table is not None and table.joins_bytes:
        return JoinedStream(table, context)
    if table is not None:
        return TextStream(hf, table, context, skip_special_tokens)
    return DecodeSteps(hf, context, skip_special_tokens)
