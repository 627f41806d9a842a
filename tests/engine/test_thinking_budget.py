"""The thinking budget (`SamplingParams.max_thinking_tokens`): `</think>` forced after K thinking tokens.

Over a tiny random-weight model whose tokenizer has `<think>` and `</think>` and whose chat
template opens the think block in the prompt (`thinking_model.py`). Proven here: at most K
tokens before `</think>`, the answer after it is what the model writes after those tokens (a
request whose prompt holds them gives the same tokens), a budget never reached changes nothing,
requests without a budget are untouched beside budgeted ones, seeded outputs are batch-invariant
and the same with speculation or without overlapped steps, and bad input fails before anything
is queued. Page accounting is checked after every test by `make_llm`.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.thinking_model import build_thinking_dir
from tests.tiny_models import build_random_weights_dir
from treeserve import SamplingParams, StructuredOutputsParams
from treeserve.engine.guided import unpack
from treeserve.engine.thinking import ThinkState, ThinkTokens, forced_masks

THINK = ThinkTokens(start=7, end=8)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory) -> str:
    return build_thinking_dir(str(tmp_path_factory.mktemp("thinking")))


@pytest.fixture(scope="module")
def prompts(thinking_dir: str) -> list[list[int]]:
    """Chat prompts that end in an open think block (`<think>\\n`)."""
    from treeserve.models.tokenizer import Tokenizer

    tok = Tokenizer(thinking_dir)
    texts = ["Compute 1 + 2.", "The quick brown fox.", "Numbers 0 1 2 3"]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), False) for t in texts]


def ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def params(budget: int | None, seed: int = 0, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 16)
    return SamplingParams(temperature=1.0, seed=seed, max_thinking_tokens=budget, **kw)


# ---- the state of a think block, on token lists -------------------------------------------
@pytest.mark.parametrize(
    "prompt, output, open_, count",
    [
        ([1, 7, 2], [3, 4], True, 2),  # opened by the prompt
        ([1, 7, 2, 8], [3, 4], False, 0),  # opened and closed by the prompt
        ([1, 2], [3, 7, 4, 5, 6], True, 3),  # opened by the model (its <think> not counted)
        ([7], [3, 8, 4], False, 1),  # the model closed it
        ([7, 8], [7, 4, 8, 7], True, 0),  # a second block starts at 0
        ([1], [3, 4], False, 0),  # no think token anywhere: no block (the budget never applies)
    ],
)
def test_think_state_counts_generated_tokens_of_the_open_block(prompt, output, open_, count) -> None:
    state = ThinkState.of_prompt(prompt, THINK)
    tokens = prompt + output
    for n in range(len(prompt), len(tokens) + 1):  # token by token, as steps read them
        state.advance(tokens[:n], THINK)
    assert (state.open, state.count, state.seen) == (open_, count, len(tokens))
    whole = ThinkState.of_prompt(prompt, THINK)
    whole.advance(tokens, THINK)
    assert (whole.open, whole.count) == (open_, count)


def test_forced_masks_allow_the_forced_token_alone_and_keep_the_other_rows() -> None:
    vocab = 70
    guided = torch.tensor([[-1, -1, 3]], dtype=torch.int32)  # every token of the first 64, then 64 and 65
    masks = forced_masks([4, 9, 2], {4: 31, 2: 69}, guided, vocab)
    allowed = unpack(masks, vocab)
    assert allowed[0].nonzero().flatten().tolist() == [31]  # bit 31: the int32's sign bit
    assert allowed[1].nonzero().flatten().tolist() == [*range(64), 64, 65]
    assert allowed[2].nonzero().flatten().tolist() == [69]


# ---- the engine ----------------------------------------------------------------------------
def test_budget_closes_the_block_and_the_answer_follows(make_llm, thinking_dir, prompts) -> None:
    llm = make_llm(thinking_dir)
    start, end = llm.engine.think.start, llm.engine.think.end
    forced = 0
    for budget in (0, 1, 3, 5):
        for seed in range(3):
            for prompt in prompts:
                (out,) = ids(llm.generate([{"prompt_token_ids": prompt}], params(budget, seed)))
                assert end in out[: budget + 1], (budget, out)  # at most `budget` tokens before </think>
                k = out.index(end)
                free = ids(llm.generate([{"prompt_token_ids": prompt}], params(None, seed)))[0]
                assert out[:k] == free[:k]  # the thinking is the model's own until the budget closes it
                if k < budget:  # the model closed it within the budget: nothing was forced
                    assert out == free
                    continue
                assert k == budget
                forced += 1
                # the answer is what the model writes after the closed block, up to a block it opens again
                # (which the budget closes as well)
                after = [{"prompt_token_ids": prompt + out[: k + 1]}]
                answer = out[k + 1 :]
                assert ids(llm.generate(after, params(budget, seed, max_tokens=16 - k - 1)))[0] == answer
                free_answer = ids(llm.generate(after, params(None, seed, max_tokens=16 - k - 1)))[0]
                reopened = answer.index(start) + 1 if start in answer else len(answer)
                assert answer[:reopened] == free_answer[:reopened]
    assert forced >= 20  # of 36: most blocks ran into their budget
    # the answer's text follows the tag
    (o,) = llm.generate([{"prompt_token_ids": prompts[0]}], params(2, 0))
    assert "</think>" in o.outputs[0].text


def test_a_budget_not_reached_changes_nothing(make_llm, thinking_dir, prompts) -> None:
    llm = make_llm(thinking_dir)
    free = llm.generate([{"prompt_token_ids": p} for p in prompts], params(None, 5, n=2))
    roomy = llm.generate([{"prompt_token_ids": p} for p in prompts], params(16, 5, n=2))
    assert ids(roomy) == ids(free)
    assert [c.text for o in roomy for c in o.outputs] == [c.text for o in free for c in o.outputs]
    closed = llm.engine.tokenizer.encode("<|assistant|>\n<think>\nok</think>\n", False)  # no open block
    assert ids(llm.generate([{"prompt_token_ids": closed}], params(0, 3))) == ids(
        llm.generate([{"prompt_token_ids": closed}], params(None, 3))
    )


def test_budgeted_requests_are_batch_invariant_and_leave_the_others_alone(make_llm, thinking_dir, prompts) -> None:
    llm = make_llm(thinking_dir)
    budgets = [2, None, 0, None, 4, 1]
    batch = [(p, params(b, seed=s, n=2)) for s, (p, b) in enumerate(zip(prompts * 2, budgets, strict=True))]
    alone = [ids(llm.generate([{"prompt_token_ids": p}], sp)) for p, sp in batch]
    together = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [sp for _, sp in batch])
    assert [ids([o]) for o in together] == alone
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, max_thinking_tokens=b) for b in (None, 3)]
    assert (
        ids(llm.generate([{"prompt_token_ids": prompts[0]}] * 2, greedy))[0]
        == ids(llm.generate([{"prompt_token_ids": prompts[0]}], greedy[0]))[0]
    )


@pytest.mark.parametrize(
    "engine_kwargs",
    [{"async_scheduling": False}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}],
)
def test_same_outputs_without_overlap_and_with_speculation(make_llm, thinking_dir, prompts, engine_kwargs) -> None:
    budgets = [None, 0, 2, 6]
    requests = [{"prompt_token_ids": p} for p in prompts for _ in budgets]
    sps = [params(b, seed=i, n=2) for i, b in enumerate(budgets * len(prompts))]
    reference = ids(make_llm(thinking_dir).generate(requests, sps))
    assert ids(make_llm(thinking_dir, **engine_kwargs).generate(requests, sps)) == reference


def test_bad_budgets_fail_before_anything_is_queued(make_llm, thinking_dir, prompts, tmp_path) -> None:
    with pytest.raises(ValueError, match="max_thinking_tokens must be an integer >= 0"):
        SamplingParams(max_thinking_tokens=-1)
    with pytest.raises(ValueError, match="max_thinking_tokens must be an integer >= 0"):
        SamplingParams(max_thinking_tokens=1.5)
    with pytest.raises(ValueError, match="cannot be combined with structured_outputs"):
        SamplingParams(max_thinking_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    plain = make_llm(build_random_weights_dir(str(tmp_path / "plain")))
    engine = plain.engine
    engine.add_request("ok", "The quick brown fox", SamplingParams(max_tokens=4, seed=0))
    with pytest.raises(ValueError, match="needs a model whose tokenizer has <think> and </think>"):
        engine.add_request("bad", "The quick brown fox", SamplingParams(max_tokens=4, max_thinking_tokens=2))
    assert list(engine.requests) == ["ok"]  # the refused request left nothing behind
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="needs a model whose tokenizer"):  # a batch: nothing of it runs
        plain.generate(["a", "b"], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, max_thinking_tokens=0)])
    assert not engine.has_unfinished_requests()
