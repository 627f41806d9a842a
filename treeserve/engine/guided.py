"""Structured outputs: constraints compiled by llguidance into a token mask per row and step.

Owns turning a constraint (JSON schema, regex, choice, Lark or GBNF grammar) into an llguidance
grammar and checking it, the engine's llguidance tokenizer, each sequence's matcher (`Guide`) and
a batch's bitmasks. A mask depends only on the row's own tokens, so guided rows stay batch-invariant.
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

# JSON as json.dumps writes it: with free whitespace small models loop on spaces until max_tokens
# (a schema's own "x-guidance" options override this)
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
    if "::=" in lark:  # GBNF
        from llguidance.gbnf_to_lark import gbnf_to_lark

        lark = _checked(lambda: gbnf_to_lark(lark), "grammar")
    return _checked(lambda: llguidance.LLMatcher.grammar_from_lark(lark), "grammar")


def _checked(build, what: str) -> str:  # noqa: ANN001 - a thunk
    try:
        grammar = build()
    except Exception as e:
        raise ValueError(f"invalid structured_outputs {what}: {e}") from None
    ok, message = _validate(grammar)
    if not ok:
        raise ValueError(f"invalid structured_outputs {what}: {message}")
    return grammar


def _validate(grammar: str) -> tuple[bool, str]:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return (not is_error, messages[0] if is_error and messages else "")


class Constraints:
    """One engine's constraint compiler: its llguidance tokenizer (built lazily) and cached grammars."""

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
        """Raise ValueError if the constraint is invalid, or no output within `max_tokens` can satisfy it."""
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
        """[len(guides), ceil(vocab / 32)] int32, bit i of a row set where its constraint allows token i
        next (EOS only where it accepts; no other special token)."""
        _ = self.lltokenizer  # built (with `speakable_words`) before the first mask
        words = torch.empty(len(guides), (self.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        targets = [(g.matcher, i) for i, g in enumerate(guides)]
        self.executor.unsafe_compute_mask_ptr(targets, words.data_ptr(), words.shape[1] * 4, len(guides))
        return words & self.speakable_words

    def allowed(self, guides: list[Guide]) -> torch.Tensor:
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
        """Consume a sampled token; False at a dead end (the mask allowed nothing: the sampler's -1,
        or the matcher refused it): the engine aborts that sequence alone."""
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
        return int(low)
    return None


class _TokenSource:
    """What `llguidance.TokenizerWrapper` reads: the token bytes, the specials, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], specials: list[int]) -> None:
        self.tokenizer, self.tokens, self.special_token_ids = tokenizer, tokens, specials
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
