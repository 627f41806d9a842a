"""Incremental detokenisation: the text chunks `tokenizers`' `DecodeStream` gives, for less host time.

This module owns the stream a sequence's generated tokens go through (`text_stream`: its `step`
takes one token, its `extend` many) and the per-tokenizer tables behind it. `DecodeStream.step`
decodes its whole window of ids for every token (0.4-3 us). For a decoder whose text is the
concatenation of each token's own text (`qualifies`: ByteLevel; Fuse; SentencePiece's
Replace("▁", " ") + ByteFallback + Fuse, optionally followed by Strip(" ", 1, 0); Metaspace with
"▁"), `TextStream` (or `JoinedStream`, below) gives the same chunks, every step's return value,
from a table of each id's decoded bytes; any other decoder keeps `DecodeStream`.

`TextStream` is `DecodeStream`'s algorithm (tokenizers' `step_decode_stream`, ported in `_step`) with
one shortcut. That algorithm keeps a window of ids and the text (`prefix`) of its first
`prefix_index` ids; each token is pushed, the window decoded, and when the text is longer than the
prefix and does not end in U+FFFD the rest is returned and the window drops its prefix ids. The
shortcut: when all of the window is its prefix and the window's own bytes are valid, non-empty
UTF-8, a token whose bytes are valid, non-empty UTF-8 not ending in U+FFFD decodes, under every
qualifying decoder, to the prefix plus its own text (the window's bytes end on a whole character;
Strip and Metaspace change only the window's first character or token, which is not the new one),
so `DecodeStream` returns exactly that text and keeps the token alone as its window: the shortcut
returns the text from the table and notes the token. Everything else (a character split across
tokens, invalid UTF-8, a skipped special token, an id outside the vocabulary, the start after a
context whose text is empty or ends in U+FFFD) runs the ported algorithm with the tokenizer's own
`decode`, so it returns what `DecodeStream` returns. That keeps two of its surprises: a prompt tail
ending mid-character has no prefix, so the first chunk repeats the tail's text; and (SentencePiece)
a run of byte pieces that is not UTF-8, followed by text, raises its InvalidPrefix error.

`JoinedStream` is the same algorithm for ByteLevel and Fuse decoders, whose text of any ids is their
bytes joined as lossy UTF-8: it runs on bytes, with no call into the tokenizer. Its `extend` gives
the chunks of many tokens in one decode (below).

`extend(tokens)` returns the chunks `step` would return for each token, joined, and leaves the
stream where those steps leave it (for everything later steps return).
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

    raw: list[bytes]  # the id's bytes in decoded text (b"" for a skipped special token or a gap)
    texts: list[str | None]  # the text the shortcut returns for the id; None where it cannot take it
    joins_bytes: bool = False  # the decoder's text of any ids is their bytes joined, as lossy UTF-8


@dataclass
class _Entry:
    key: tuple[bytes, int]  # the decoder's state and the vocabulary size the tables were built for
    qualified: bool
    joins_bytes: bool  # ByteLevel or Fuse: `JoinedStream` serves it
    tables: dict[bool, StreamTable] = field(default_factory=dict)


_ENTRIES: weakref.WeakKeyDictionary[HFTokenizer, _Entry] = weakref.WeakKeyDictionary()


def qualifies(decoder: dict | None) -> bool:
    """Whether a decoder (its JSON state) decodes ids to the concatenation of each id's own text, apart
    from what `TextStream`'s shortcut never meets (the window's first character or token)."""
    if decoder is None:
        return False  # no decoder: tokens joined with spaces
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
    """The id's text where the shortcut can take it: valid, non-empty UTF-8 not ending in U+FFFD."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    return text if text and not text.endswith(_REPLACEMENT) else None


def stream_table(hf: HFTokenizer, skip_special_tokens: bool) -> StreamTable | None:
    """The tokenizer's table, built once per tokenizer object and setting (rebuilt if its decoder or
    vocabulary size changed); None when its decoder does not qualify."""
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
    """DecodeStream's InvalidPrefix error (it raises a plain Exception with this message)."""


class TextStream:
    """One sequence's incremental decoder: `step(token)` returns what `DecodeStream.step` would."""

    __slots__ = ("_hf", "_skip", "_raw", "_texts", "_fast", "_last", "_ids", "_prefix", "_prefix_index")

    def __init__(self, hf: HFTokenizer, table: StreamTable, context: list[int], skip_special_tokens: bool):
        self._hf = hf
        self._skip = skip_special_tokens
        self._raw = table.raw
        self._texts = table.texts
        self._last: int | None = None  # on the shortcut: the window is this one token
        self._ids = list(context)  # DecodeStream(ids=context) starts with no prefix ...
        self._prefix = ""
        self._prefix_index = 0
        if self._ids:  # ... and takes the context's text as its prefix on the first step; done here
            self._take_prefix()
        self._fast = self._prefix_index == len(self._ids) and self._clean(self._ids)

    def step(self, token: int) -> str | None:
        """Add one token; the new text, or None while there is none (DecodeStream's rule)."""
        if self._fast:
            try:
                text = self._texts[token]
            except IndexError:  # an id past the vocabulary (a padded LM head): decodes to nothing
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
        """`step` over `tokens`, its chunks joined."""
        return _joined_steps(self.step, tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids, skip_special_tokens=self._skip)

    def _take_prefix(self) -> None:
        prefix = self._decode(self._ids)
        if not prefix.endswith(_REPLACEMENT):
            self._prefix, self._prefix_index = prefix, len(self._ids)

    def _clean(self, ids: list[int]) -> bool:
        """Whether the window's own bytes are valid, non-empty UTF-8 (the shortcut's condition); never
        with an id past the table (whose text the table does not know)."""
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
    """`TextStream` for decoders whose text of any ids is their bytes joined and decoded as lossy
    UTF-8 (ByteLevel: Rust's `from_utf8_lossy`, which replaces the same maximal invalid subparts as
    Python's "replace"; Fuse: the tokens' texts joined). `DecodeStream`'s algorithm on bytes, with
    no call into the tokenizer: the window is the bytes of its prefix ids (`window`, whose text is
    `prefix`) and of the ids after them (`pending`). A step adds the token's bytes to `pending`;
    the window's text, when longer than the prefix (in UTF-8 bytes) and not ending in U+FFFD, gives
    what follows the prefix, and `pending` becomes the window. `clean`: nothing pending and the
    window valid, non-empty UTF-8, where a token of whole characters just returns its text."""

    __slots__ = ("_raw", "_texts", "_window", "_pending", "_prefix", "_clean", "_last")

    def __init__(self, table: StreamTable, context: list[int]):
        self._raw, self._texts, self._last = table.raw, table.texts, None
        data = b"".join([self._bytes(i) for i in context])
        self._window, self._pending, self._prefix, self._clean = b"", data, "", False
        # DecodeStream(ids=context) takes the context's text as its prefix on its first step; here
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = _REPLACEMENT
        if text and not text.endswith(_REPLACEMENT):  # valid: the prefix, and the shortcut may run
            self._window, self._pending, self._prefix, self._clean = data, b"", text, True
        else:
            self._take_prefix()  # (lossy; an invalid window never takes the shortcut)

    def _bytes(self, token: int) -> bytes:
        return self._raw[token] if token < len(self._raw) else b""  # an id past the vocabulary: nothing

    def _take_prefix(self) -> None:
        """DecodeStream's first move while its prefix is empty: all of the window becomes the prefix,
        unless its text ends in U+FFFD."""
        if not self._prefix and (self._window or self._pending):
            data = self._window + self._pending
            text = data.decode("utf-8", "replace")
            if not text.endswith(_REPLACEMENT):
                self._window, self._pending, self._prefix = data, b"", text

    def _settle(self) -> None:
        """After the window became all prefix: whether the shortcut may run."""
        try:
            self._clean = bool(self._window) and bool(self._window.decode())
        except UnicodeDecodeError:
            self._clean = False

    def extend(self, tokens: list[int]) -> str:
        """`step` over `tokens`, its chunks joined, in one decode. The window ends on a whole
        character and its text is the prefix (both empty before the first chunk, once `__init__`'s
        `_take_prefix` found the context's text ending in U+FFFD: no later step's `_take_prefix`
        meets other bytes, since the step before would have given them as a chunk). So a step's
        text is the prefix plus the lossy text of the bytes since the last chunk, and a step gives
        a chunk exactly when those bytes' text is non-empty and does not end in U+FFFD: the chunks
        of a run of tokens join to the lossy text of the pending and the run's bytes when that does
        not end in U+FFFD. The longest such run goes in one decode and the rest (bytes held back)
        step by step. Whether a text ends in U+FFFD shows in its last 4 bytes' text: a character
        is at most 4 bytes, and a lead byte is never taken as another's continuation."""
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
            self._clean = _REPLACEMENT not in text  # valid UTF-8 (a U+FFFD of its own: the long way, same text)
        return text + _joined_steps(self.step, tokens[run:]) if run < len(tokens) else text

    def step(self, token: int) -> str | None:
        """Add one token; the new text, or None while there is none (DecodeStream's rule)."""
        if self._clean:
            try:
                text = self._texts[token]
            except IndexError:  # an id past the vocabulary (a padded LM head)
                text = None
            if text is not None:  # the window's text plus this whole-character text: all of it new
                self._last = token  # the window is now this token (set when the shortcut ends)
                return text
            self._clean = False
            if self._last is not None:
                self._window, self._prefix, self._last = self._raw[self._last], self._texts[self._last], None
        if not self._prefix:
            self._take_prefix()
        raw = self._raw
        pending = self._pending + (raw[token] if token < len(raw) else b"")  # `_bytes`, inlined
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
    """`DecodeStream` itself, for decoders that do not qualify, with the same two methods."""

    __slots__ = ("step",)

    def __init__(self, hf: HFTokenizer, context: list[int], skip_special_tokens: bool):
        stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self.step: Callable[[int], str | None] = functools.partial(stream.step, hf)

    def extend(self, tokens: list[int]) -> str:
        """`step` over `tokens`, its chunks joined."""
        return _joined_steps(self.step, tokens)


def _joined_steps(step: Callable[[int], str | None], tokens: list[int]) -> str:
    return "".join([chunk for token in tokens if (chunk := step(token))])


Stream = JoinedStream | TextStream | DecodeSteps


def text_stream(hf: HFTokenizer, context: list[int], skip_special_tokens: bool) -> Stream:
    """A sequence's stream after the prompt tokens `context`: a `JoinedStream` or a `TextStream` when the
    tokenizer's decoder qualifies, else `DecodeStream` (`DecodeSteps`)."""
    table = stream_table(hf, skip_special_tokens)
    if table is not None and table.joins_bytes:
        return JoinedStream(table, context)
    if table is not None:
        return TextStream(hf, table, context, skip_special_tokens)
    return DecodeSteps(hf, context, skip_special_tokens)
