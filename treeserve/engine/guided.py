"""Structured outputs: constraints compiled by llguidance into a token mask per row and step.

Owns what the engine needs for `SamplingParams.structured_outputs`: turning a constraint
(JSON schema, any JSON object, regex, choice list, Lark or GBNF grammar) into an llguidance
grammar, checking it before a request is queued, one llguidance tokenizer per engine (built
from `Tokenizer.token_bytes`, so every tokenizer treeserve loads works: byte-level BPE,
SentencePiece-style, word-level, the ones rebuilt from GGUF metadata), the per-sequence
matcher (`Guide`), and a batch's bitmasks (`sampler.sample_masked` draws under them). The
mask is applied before the seeded draw and depends only on the row's own tokens, so guided
requests stay batch-invariant. Why llguidance and not xgrammar: `bench/structured_masks.py` (README,
"Structured outputs").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from treeserve.models.tokenizer import Tokenizer
from treeserve.sampling_params import StructuredOutputsParams

# JSON is written as json.dumps writes it (", " and ": ", no other whitespace): with free
# whitespace, small models loop on newlines and spaces until max_tokens. A schema's own
# "x-guidance" options (e.g. {"whitespace_flexible": true}) override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_of(constraint: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; ValueError naming what is wrong with it."""
    if constraint.json is not None or constraint.json_object:
        schema = constraint.json if constraint.json is not None else {"type": "object"}
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        return _checked(
            lambda: llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_LAYOUT), "json schema"
        )
    if constraint.regex is not None:
        return _checked(lambda: llguidance.LLMatcher.grammar_from_regex(constraint.regex), "regex")
    if constraint.choice is not None:
        lark = "start: " + " | ".join(json.dumps(c) for c in constraint.choice)
        return _checked(lambda: llguidance.LLMatcher.grammar_from_lark(lark), "choice")
    lark = constraint.grammar
    if "::=" in lark:  # GBNF / EBNF (llama.cpp's and xgrammar's format)
        from llguidance.gbnf_to_lark import gbnf_to_lark

        lark = _checked(lambda: gbnf_to_lark(lark), "grammar")
    return _checked(lambda: llguidance.LLMatcher.grammar_from_lark(lark), "grammar")


def _checked(build, what: str) -> str:  # noqa: ANN001 - a thunk
    try:
        grammar = build()
    except Exception as e:  # llguidance raises ValueError or RuntimeError with the parser's message
        raise ValueError(f"invalid structured_outputs {what}: {e}") from None
    ok, message = _validate(grammar)
    if not ok:
        raise ValueError(f"invalid structured_outputs {what}: {message}")
    return grammar


def _validate(grammar: str) -> tuple[bool, str]:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (not is_error, messages[0] if is_error and messages else "")


class Constraints:
    """One engine's constraint compiler: its llguidance tokenizer (built at the first guided
    request) and the grammars it compiled, cached by constraint."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._grammars: dict[str, str] = {}
        self._max_token_bytes = 1
        self.executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        self.speakable_words = torch.zeros(0, dtype=torch.int32)  # bitmask: special tokens other than EOS unset

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltok is None:
            tokens, specials = self.tokenizer.token_bytes()
            self._max_token_bytes = max(len(t) for t in tokens)
            eos = list(self.tokenizer.eos_token_ids)
            # a special token spells no text: the constraint may end with EOS but never emit another
            speakable = np.ones(-(-len(tokens) // 32) * 32, dtype=bool)
            speakable[sorted(set(specials) - set(eos))] = False
            self.speakable_words = torch.from_numpy(np.packbits(speakable, bitorder="little")).view(torch.int32)
            wrapped = llguidance.TokenizerWrapper(_TokenSource(self.tokenizer, tokens, specials))
            self._lltok = llguidance.LLTokenizer(wrapped, n_vocab=self.tokenizer.vocab_size, eos_token=eos)
        return self._lltok

    def check(self, constraint: StructuredOutputsParams, max_tokens: int | None) -> None:
        """Raise ValueError if the constraint is invalid, or no output within `max_tokens` can
        satisfy it: an empty language, or (regex and choice) more bytes than max_tokens of the
        vocabulary's longest token can spell. Compiles (and caches) it on the way."""
        guide = self.guide(constraint)
        allowed = self.allowed([guide])[0]  # an empty language puts the matcher in an error state here
        if guide.matcher.is_error() or not (guide.matcher.is_accepting() or allowed.any()):
            raise ValueError("structured_outputs: no output satisfies this constraint")
        shortest = _shortest_bytes(constraint)
        if max_tokens is not None and shortest is not None and shortest > max_tokens * self._max_token_bytes:
            raise ValueError(
                f"structured_outputs: the shortest output the constraint accepts is {shortest} bytes, "
                f"more than max_tokens={max_tokens} tokens of at most {self._max_token_bytes} bytes can hold"
            )

    def guide(self, constraint: StructuredOutputsParams) -> Guide:
        key = constraint.key
        grammar = self._grammars.get(key)
        if grammar is None:
            grammar = self._grammars[key] = grammar_of(constraint)
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return Guide(matcher)

    def bitmask(self, guides: list[Guide]) -> torch.Tensor:
        """[len(guides), ceil(vocab / 32)] int32, bit i of a row set where its constraint allows
        token i next (EOS only where it accepts; never a special token other than EOS). The
        masks are computed in parallel by llguidance's executor, with as many threads as torch. (Computing
        the next step's masks in a thread during the forward was measured and dropped: on two
        cores it gained nothing on Gemma 3 270M and cost 20% on a tiny model; bench/structured.py.)"""
        _ = self.lltokenizer  # built (with `speakable_words`) before the first mask
        words = torch.empty(len(guides), (self.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        targets = [(g.matcher, i) for i, g in enumerate(guides)]
        self.executor.unsafe_compute_mask_ptr(targets, words.data_ptr(), words.shape[1] * 4, len(guides))
        return words & self.speakable_words

    def allowed(self, guides: list[Guide]) -> torch.Tensor:
        """`bitmask` unpacked: [len(guides), vocab] bool."""
        return unpack(self.bitmask(guides), self.tokenizer.vocab_size)


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks -> [rows, vocab] bool."""
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)


@dataclass
class Guide:
    """One sequence's position in its constraint."""

    matcher: llguidance.LLMatcher

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False at a dead end: the mask allowed nothing (the sampler's
        -1; e.g. the text needs a character the vocabulary can only spell as a special token) or
        the matcher refused what it allowed. The engine ends that sequence alone ("abort")."""
        return token >= 0 and self.matcher.consume_token(token)


def _shortest_bytes(constraint: StructuredOutputsParams) -> int | None:
    """A lower bound on the UTF-8 length of any accepted output (None: not computed)."""
    if constraint.choice is not None:
        return min(len(c.encode()) for c in constraint.choice)
    if constraint.regex is not None:
        try:
            low, _ = re._parser.parse(constraint.regex).getwidth()  # type: ignore[attr-defined]
        except (re.error, OverflowError, RecursionError):
            return None  # Python's parser reads a different dialect: skip the bound
        return int(low)  # characters; each is >= 1 byte
    return None


class _TokenSource:
    """What `llguidance.TokenizerWrapper` reads: the token bytes, the specials, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], specials: list[int]) -> None:
        self.tokenizer, self.tokens, self.special_token_ids = tokenizer, tokens, specials
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
