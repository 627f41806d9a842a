"""Reasoning parsers (`--reasoning-parser`): a chat completion's text split into
`reasoning_content` and `content`, whole or as a stream of deltas; joined deltas always equal the
whole text's parse (a split tag is held back). Text only, so `for_tokenizer` refuses tokenizers
without non-special `<think>` / `</think>` tokens.
* `deepseek_r1`: before the first `</think>` is reasoning (a `<think>` in it removed); without
  `</think>`, all of it.
* `qwen3`: reasoning only from a `<think>` to the first `</think>` (or the end); the rest content.
`reasoning` is None without a think block; `content` None when nothing follows it (vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treeserve.engine.thinking import THINK_END, THINK_START, tags_in_text

if TYPE_CHECKING:
    from treeserve.models.tokenizer import Tokenizer

PARSERS = ("deepseek_r1", "qwen3")

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"  # where a stream is, around the think block


@dataclass(frozen=True)
class ReasoningParser:
    name: str

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; choose one of {', '.join(PARSERS)}")

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Tokenizer) -> ReasoningParser:
        """ValueError when this tokenizer's outputs cannot carry the think tags."""
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
        stream = self.stream()
        stream.feed(text, final=True)
        return stream.parsed()


@dataclass
class Parsed:
    reasoning: str | None
    content: str | None


@dataclass
class ReasoningStream:
    """One choice's text, fed as it comes."""

    parser: str
    state: str = ""
    held: str = ""  # may be the start of a tag
    opened: bool = False  # deepseek_r1: its `<think>` was removed already
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.state = self.state or (THINKING if self.parser == "deepseek_r1" else BEFORE)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The (reasoning, content) the next delta releases (`final`: the last one)."""
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
        content = "".join(self.content)
        if self.state == BEFORE:  # qwen3 without `<think>`: no think block
            return Parsed(None, content)
        return Parsed("".join(self.reasoning), content or None)

    def _tags(self) -> tuple[str, ...]:
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
    """The longest end of `text` that begins one of `tags` (and is not all of it)."""
    for n in range(min(len(text), max((len(t) for t in tags), default=1) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0
