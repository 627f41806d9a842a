"""The offline API, shaped like vLLM's `LLM`: generate, chat, and a forward-only `score`.

A call validates every input before submitting any; outputs come back in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import torch

from treeserve.config import EngineConfig
from treeserve.engine.llm_engine import LLMEngine
from treeserve.models.tokenizer import Tokenizer
from treeserve.outputs import RequestOutput, ScoreOutput
from treeserve.sampling_params import SamplingParams, ScoreParams

Prompt = str | list[int] | dict


class LLM:
    """`LLM(model=dir, dtype="bfloat16"|"float32", **settings)`: vLLM's flat keywords, mapped onto
    the `EngineConfig` tree by `EngineConfig.from_kwargs`."""

    def __init__(self, model: str, dtype: str = "bfloat16", **engine_kwargs: object):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, dtype=dtype, **engine_kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        return self._run(list(prompts), params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt, continue_final_message, chat_template
            )
            # the template already placed the special tokens (as transformers and vLLM do)
            prompts.append({"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        params = sampling_params if sampling_params is not None else SamplingParams()
        return self._run(prompts, params)

    def score(self, token_ids: list[list[int]], params: ScoreParams | Seq[ScoreParams]) -> list[ScoreOutput]:
        """Forward only: log-probs of `params.token_ids` (and hidden states) at `params.positions`;
        the pages enter the prefix cache."""
        return self._run([{"prompt_token_ids": t} for t in token_ids], params)

    def _run(self, prompts: list[Prompt], params: object) -> list:
        if not prompts:
            return []
        params_list = list(params) if isinstance(params, list | tuple) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} parameter sets")
        engine = self.engine
        staged = []
        for prompt, p in zip(prompts, params_list, strict=True):
            request_id = str(next(self._ids))
            text, ids = engine.tokenize_prompt(prompt)
            engine.check_request(request_id, ids, p)
            staged.append((request_id, {"prompt_token_ids": ids} if text is None else text, p))
        for request_id, prompt, p in staged:
            engine.add_request(request_id, prompt, p)
        done: dict[str, RequestOutput | ScoreOutput] = {}
        try:
            with torch.inference_mode():  # once for every step (`engine/inference_mode.py`)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            done[out.request_id] = out
        except Exception:  # a failed step aborted its batch (StepFailed): abort the rest of this call too
            for request_id, _, _ in staged:
                engine.abort(request_id)
            raise
        return [done[request_id] for request_id, _, _ in staged]
