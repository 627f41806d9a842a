"""Incremental detokenisation and the stop rules of one sequence (`StopChecker`).

After each token, in vLLM's order: EOS (unless `ignore_eos`), `stop_token_ids`, stop strings (may
span tokens; with `n_stop_occurrences=k` the k-th stops; none before `min_tokens`), `max_tokens`.
Text comes from `text_stream.py`. Without stop strings no rule reads the text, so it is made when
read (`lazy`), and a token that cannot end the sequence (`quiet_stops`) needs no call at all.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer as HFTokenizer

from treeserve.engine.text_stream import text_stream
from treeserve.sampling_params import SamplingParams

_CONTEXT_TOKENS = 6  # prompt tokens given to the stream so the first output token decodes right


@functools.lru_cache(maxsize=64)
def _shared(ids: frozenset[int]) -> frozenset[int]:
    """One object for equal sets of ending ids (a step's pass over the sequences finds it cached)."""
    return ids


class StopChecker:
    __slots__ = (  # what `append` reads for the usual token first: side by side in memory
        "first",
        "ending_ids",
        "lazy",
        "owns_tokens",
        "max_tokens",
        "tokens",
        "text_from",
        "text_end",
        "tokenizer",
        "prompt_context",
        "params",
        "eos_ids",
        "stop_ids",
        "step_text",
        "extend_text",
        "_text",
        "stops_found",
        "stop_offsets",
        "search_from",
        "max_stop_len",
        "hold",
    )

    def __init__(
        self,
        tokenizer: HFTokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        eos_ids: list[int],
        lazy: bool = True,
        tokens: list[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.prompt_context = prompt_ids[-_CONTEXT_TOKENS:]
        self.params = params
        self.eos_ids = frozenset(() if params.ignore_eos else eos_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.ending_ids = _shared(self.eos_ids | self.stop_ids)
        stream = text_stream(tokenizer, self.prompt_context, params.skip_special_tokens)
        self.step_text, self.extend_text = stream.step, stream.extend
        self._text = ""
        self.lazy = lazy and not params.stop  # the text is made when read
        # the sequence's own list, which its owner appends to before `append`; or the checker's own
        self.owns_tokens = tokens is None
        self.tokens = [] if tokens is None else tokens
        self.first = len(self.tokens)  # tokens[first:] are the ones appended
        self.text_from = self.first  # tokens[text_from:] are not in `_text` yet
        self.text_end: int | None = None  # the text ends before an ending token it leaves out
        self.max_tokens = params.max_tokens
        self.stops_found = 0
        # (output tokens, text end) at each stop-string occurrence (where search splits steps)
        self.stop_offsets: list[tuple[int, int]] = []
        self.search_from = 0
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        # the last characters a stop string may still cut (DELTA outputs hold them back)
        self.hold = 0 if params.include_stop_str_in_output else max(self.max_stop_len - 1, 0)

    def clone(self, output_ids: list[int], tokens: list[int] | None = None) -> StopChecker:
        """A checker at this one's state after `output_ids`, reading the new sequence's list `tokens`."""
        twin = StopChecker(self.tokenizer, self.prompt_context, self.params, [], lazy=self.lazy)
        twin.eos_ids, twin.ending_ids, twin.max_tokens = self.eos_ids, self.ending_ids, None
        for token in output_ids:
            twin.append(token)
        twin.max_tokens = self.max_tokens
        if tokens is not None:
            offset = len(tokens) - len(output_ids)
            twin.owns_tokens, twin.tokens, twin.first = False, tokens, offset
            twin.text_from += offset
            twin.text_end = None if twin.text_end is None else twin.text_end + offset
        return twin

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) - self.first

    def quiet_stops(self, max_len: int) -> tuple[frozenset[int], int]:
        """(ending ids, length): a token not among the ids keeping the list shorter needs no `append`."""
        if not self.lazy or self.owns_tokens:
            return self.ending_ids, 0
        if self.max_tokens is None:
            return self.ending_ids, max_len
        return self.ending_ids, min(max_len, self.first + self.max_tokens)

    @property
    def text(self) -> str:
        """The text so far (an ending token's only with `include_stop_str_in_output`)."""
        if self.lazy:
            end = len(self.tokens) if self.text_end is None else self.text_end
            if self.text_from < end:
                self._text += self.extend_text(self.tokens[self.text_from : end])
                self.text_from = end
        return self._text

    def append(self, token: int) -> tuple[str, str | int | None] | None:
        """Add one generated token; (finish_reason, stop_reason) when the sequence ends."""
        if self.owns_tokens:
            self.tokens.append(token)
        ending = token in self.ending_ids
        if self.lazy and not ending:
            return ("length", None) if self.max_tokens is not None and self.num_tokens >= self.max_tokens else None
        if self.lazy:
            chunk = None
            if not self.params.include_stop_str_in_output:
                self.text_end = len(self.tokens) - 1
        else:
            chunk = self.step_text(token)
        if ending:
            if chunk and self.params.include_stop_str_in_output:
                self._text += chunk
            return "stop", None if token in self.eos_ids else token
        if chunk:
            previous = len(self._text)
            self._text += chunk
            if self.max_stop_len and self.num_tokens > self.params.min_tokens:
                stop = self._find_stop(previous)
                if stop is not None:
                    return "stop", stop
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return "length", None
        return None

    def _find_stop(self, previous: int) -> str | None:
        """Count stop-string occurrences in new text; on the k-th, cut the text and return it."""
        start = max(self.search_from, previous - self.max_stop_len + 1, 0)
        stops, text = self.params.stop, self._text
        while True:
            index, stop = -1, None
            for s in stops:
                i = text.find(s, start)
                if i >= 0 and (stop is None or (i, s) < (index, stop)):
                    index, stop = i, s
            if stop is None:
                return None
            self.stops_found += 1
            self.stop_offsets.append((self.num_tokens, index + len(stop)))
            if self.stops_found == self.params.n_stop_occurrences:
                end = index + len(stop) if self.params.include_stop_str_in_output else index
                self._text = text[:end]
                return stop
            start = self.search_from = index + len(stop)
