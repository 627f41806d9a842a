"""Incremental detokenisation and the stop rules of one sequence.

Text is produced token by token in the chunks `tokenizers`' streaming decoder (`DecodeStream`, which
buffers partial UTF-8 sequences) gives, by `text_stream.py` (from a table of each token's text where
the decoder allows). After each token the checker applies, in vLLM's order: EOS (unless
`ignore_eos`), `stop_token_ids`, stop strings (which may span several tokens; with
`n_stop_occurrences=k` only the k-th occurrence stops; none before `min_tokens` tokens), then
`max_tokens`. (The sampler blocks EOS and stop token ids before `min_tokens`.)

Without stop strings no rule reads the text, so it is made when it is read (`text`): a step
only counts the token (the sequence's own list holds it), and the stream runs over the tokens
appended since the last read. The text is
the same read after every token or once at the end; a step no longer pays for it while nobody
looks. A request that streams reads it every step, so its text is made as tokens come.

Such a lazy checker need not even be told of most tokens: it counts the tokens in the list it
reads, so a token that is not an ending id and leaves the sequence short of its length limit
(`quiet_stops`) can go into the list without a call, the step's usual case on its short path
(`postprocess.py`).
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer as HFTokenizer

from treeserve.engine.text_stream import text_stream
from treeserve.sampling_params import SamplingParams

_CONTEXT_TOKENS = 6  # prompt tokens given to the stream so the first output token decodes right


@functools.lru_cache(maxsize=64)
def _shared(ids: frozenset[int]) -> frozenset[int]:
    """One object for equal sets of ending ids: every sequence's checker reads the same set, which
    a step's pass over the sequences then finds in the caches."""
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
        # the text is made when read, from the tokens not yet in it (stop strings, or `lazy` False
        # for a stream read every step anyway: made as tokens come)
        self.lazy = lazy and not params.stop
        # the tokens appended: the sequence's own list, from its length now on (its owner appends
        # each token before telling `append`), or a list of the checker's own (`tokens` None)
        self.owns_tokens = tokens is None
        self.tokens = [] if tokens is None else tokens
        self.first = len(self.tokens)  # tokens[first:] are the ones appended
        self.text_from = self.first  # tokens[text_from:] are not in `_text` yet
        self.text_end: int | None = None  # the text ends before an ending token it leaves out
        self.max_tokens = params.max_tokens
        self.stops_found = 0
        # (output tokens, text end) at each stop-string occurrence; speculative search splits steps here
        self.stop_offsets: list[tuple[int, int]] = []
        self.search_from = 0
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        # the last characters of the text a stop string may still cut (a stream of DELTA outputs
        # holds them back): those of its longest stop string but one, when the cut leaves it out
        self.hold = 0 if params.include_stop_str_in_output else max(self.max_stop_len - 1, 0)

    def clone(self, output_ids: list[int], tokens: list[int] | None = None) -> StopChecker:
        """A checker at this one's state, which `output_ids` (the tokens appended so far) reached;
        `tokens`: the new sequence's own list, which ends with `output_ids` already. The twin
        replays them on a list of its own, then reads `tokens` from where they start."""
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
        """Tokens appended so far."""
        return len(self.tokens) - self.first

    def quiet_stops(self, max_len: int) -> tuple[frozenset[int], int]:
        """(ending ids, length): a token of the sequence whose list this checker reads needs no
        `append` if it is not among the ids and the list stays shorter than the length (its
        max_tokens, or `max_len`, the context). A checker that makes its text token by token (a
        stream, stop strings) is told of every token: length 0."""
        if not self.lazy or self.owns_tokens:
            return self.ending_ids, 0
        if self.max_tokens is None:
            return self.ending_ids, max_len
        return self.ending_ids, min(max_len, self.first + self.max_tokens)

    @property
    def text(self) -> str:
        """The text of the tokens appended so far (an ending token's only with
        `include_stop_str_in_output`)."""
        if self.lazy:
            end = len(self.tokens) if self.text_end is None else self.text_end
            if self.text_from < end:
                self._text += self.extend_text(self.tokens[self.text_from : end])
                self.text_from = end
        return self._text

    def append(self, token: int) -> tuple[str, str | int | None] | None:
        """Add one generated token; returns (finish_reason, stop_reason) when the sequence ends.
        (The sequence's own list holds it already, unless the checker owns its list.)"""
        if self.owns_tokens:
            self.tokens.append(token)
        ending = token in self.ending_ids
        if self.lazy and not ending:  # the usual token: in the list for the text, maybe the last
            return ("length", None) if self.max_tokens is not None and self.num_tokens >= self.max_tokens else None
        if self.lazy:  # an ending token, without stop strings: its text only if asked for
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
            if self.max_stop_len and self.num_tokens > self.params.min_tokens:  # vLLM's rule
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
            index, stop = -1, None  # the earliest occurrence (ties: the least string), with no list per token
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
