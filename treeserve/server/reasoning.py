"""Reasoning parsers: a chat completion's text split into `reasoning_content` and `content`.

Owns vLLM's two `<think>...</think>` conventions (`--reasoning-parser`), for a whole text and for a
stream of text deltas, with one rule: a stream's reasoning and content deltas, joined, are the
whole text's parse, wherever the deltas split it (a tag split across deltas is held back until
it is whole or cannot be). The parser reads text, never token ids, so the tags must be in the
text: `for_tokenizer` refuses, at start-up, a tokenizer without `<think>` and `</think>` as
tokens, or one whose think tokens are special (decoding with `skip_special_tokens` drops them).

* `deepseek_r1`: everything before the first `</think>` is reasoning, a `<think>` in it removed
  (DeepSeek-R1's template puts `<think>` in the prompt, so the output often has only `</think>`);
  without `</think>` all of it is reasoning (the budget or `max_tokens` cut the thinking).
* `qwen3`: reasoning needs a `<think>` in the output: before it is content, from it to the first
  `</think>` (or the end) reasoning, after that content; without `<think>` all of it is content.

A parse's `reasoning` is None when there is no think block (qwen3 without `<think>`); its
`content` is None when a think block left nothing after it (vLLM's `content or None`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treeserve.engine.thinking import THINK_END, THINK_START, tags_in_text

if TYPE_CHECKING:
    from treeserve.models.tokenizer import Tokenizer

PARSERS = ("deepseek_r1", "qwen3")

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"  # where a stream is: before, in, after the think block


@dataclass(frozen=True)
class ReasoningParser:
    name: str  # one of PARSERS

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; choose one of {', '.join(PARSERS)}")

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Tokenizer) -> ReasoningParser:
        """The parser `name` for a model with this tokenizer; ValueError when its outputs cannot
        carry the think tags."""
        parser = cls(name)
        problem = tags_in_text(tokenizer)
        if problem == "missing":
            raise ValueError(
                f"--reasoning-parser {name}: the model's tokenizer has no {THINK_START} and {THINK_END} tokens; "
                "it is not a reasoning model this parser knows"
            )
        if problem == "special":
            raise ValueError(
                f"--reasoning-parser {name}: the tokenizer's {THINK_START}/{THINK_END} are special tokens, which "
                "decoded text leaves out, so no parser can find them"
            )
        return parser

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.name)

    def parse(self, text: str) -> Parsed:
        """The whole text's parse (a stream given all of it at once)."""
        stream = self.stream()
        stream.feed(text, final=True)
        return stream.parsed()


@dataclass
class Parsed:
    reasoning: str | None
    content: str | None


@dataclass
class ReasoningStream:
    """One choice's text, fed as it comes; `feed` returns the (reasoning, content) it releases."""

    parser: str
    state: str = ""
    held: str = ""  # the end of the text fed, which may be the start of a tag
    opened: bool = False  # deepseek_r1: its `<think>` was removed already
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = self.state or (THINKING if self.parser == "deepseek_r1" else BEFORE)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Take the next text delta (`final`: the last one); the reasoning and the content it releases."""
        buf, self.held = self.held + text, ""
        out = {THINKING: [], BEFORE: [], ANSWER: []}
        while buf:
            tags = self._tags()
            found = [(i, tag) for tag in tags if (i := buf.find(tag)) >= 0]
            if found:
                i, tag = min(found)
                out[self.state].append(buf[:i])
                buf = buf[i + len(tag) :]
                self._passed(tag)
                continue
            keep = 0 if final else _partial_tag(buf, tags)
            out[self.state].append(buf[: len(buf) - keep])
            self.held = buf[len(buf) - keep :]
            break
        reasoning, content = "".join(out[THINKING]), "".join(out[BEFORE] + out[ANSWER])
        self.reasoning.append(reasoning)
        self.content.append(content)
        return reasoning, content

    def parsed(self) -> Parsed:
        """Everything fed so far, as a parse."""
        content = "".join(self.content)
        if self.state == BEFORE:  # qwen3 without `<think>`: no think block
            return Parsed(None, content)
        return Parsed("".join(self.reasoning), content or None)

    def _tags(self) -> tuple[str, ...]:
        """The tags that change where the stream is, from here."""
        if self.state == BEFORE:
            return (THINK_START,)
        if self.state == THINKING:
            return (THINK_END,) if self.opened or self.parser == "qwen3" else (THINK_START, THINK_END)
        return ()

    def _passed(self, tag: str) -> None:
        if tag == THINK_START:
            self.state, self.opened = THINKING, True
        else:
            self.state = ANSWER


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (and is not all of it)."""
    for n in range(min(len(text), max((len(t) for t in tags), default=1) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0
