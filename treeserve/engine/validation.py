"""Request validation shared by an engine and a front end that has no model (the API process).

Neither function changes any state.
"""

from __future__ import annotations

from treeserve.engine.guided import Constraints
from treeserve.engine.thinking import THINK_END, THINK_START, ThinkTokens
from treeserve.models.tokenizer import Tokenizer
from treeserve.sampling_params import SamplingParams, ScoreParams


def check_text_length(tokenizer: Tokenizer, text: str, max_model_len: int) -> None:
    """Raise ValueError, before tokenising (which holds the GIL), for a text over twice `max_model_len`."""
    limit = 2 * max_model_len * tokenizer.max_token_chars
    if len(text) > limit:
        raise ValueError(
            f"the prompt has {len(text)} characters, more than {max_model_len} tokens (this model's "
            f"maximum context length) can hold"
        )


def tokenize_prompt(tokenizer: Tokenizer, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = list(prompt["prompt_token_ids"])
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_request(
    token_ids: list[int],
    params: SamplingParams | ScoreParams,
    vocab: int,
    lm_head: bool,
    max_model_len: int,
    constraints: Constraints,
    think: ThinkTokens | None,
) -> None:
    """Raise ValueError for anything that cannot run (`think`: the tokenizer's think tokens, if any)."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got {min(token_ids)}..{max(token_ids)}")
    if isinstance(params, ScoreParams):
        if params.token_ids and not lm_head:
            raise ValueError("this model has no LM head: ask for hidden states, not token log-probabilities")
        if len(token_ids) > max_model_len:
            raise ValueError(f"input of {len(token_ids)} tokens exceeds max_model_len={max_model_len}")
        if params.positions[-1] >= len(token_ids):
            raise ValueError(f"position {params.positions[-1]} is outside the {len(token_ids)}-token input")
        if params.token_ids and max(params.token_ids) >= vocab:
            raise ValueError(f"candidate token ids must be < vocab size {vocab}")
    elif isinstance(params, SamplingParams):
        if not lm_head:
            raise ValueError("this model has no LM head (a reward model): it can score but not generate")
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate within max_model_len={max_model_len}"
            )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be < vocab size {vocab}, got {max(params.logit_bias)}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be <= vocab size {vocab}, got {params.logprobs}")
        if params.structured_outputs is not None:
            room = max_model_len - len(token_ids)
            constraints.check(params.structured_outputs, min(params.max_tokens or room, room))
        if params.max_thinking_tokens is not None and (think is None or max(think.start, think.end) >= vocab):
            raise ValueError(
                f"max_thinking_tokens needs a model whose tokenizer has {THINK_START} and {THINK_END} tokens "
                "(a reasoning model); this one has not"
            )
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
            raise ValueError(f"prompt_logprobs must be <= vocab size {vocab}, got {params.prompt_logprobs}")
    else:
        raise ValueError(f"expected SamplingParams or ScoreParams, got {type(params).__name__}")
