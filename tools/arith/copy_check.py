"""Dense copy-check targets for the arithmetic PRM: is each copied number copied right?

Most of the generator's first mistakes are copies, not arithmetic (`evaluate.first_mistakes`
on the shipped generator: a miscopied operand 39%, a miscopied rest 24%, a wrong result 31%).
Step tags alone do not teach a PRM of this size to compare a copied number with its source,
just as they did not teach it arithmetic (`tools.arith.facts`). These targets put the
comparison right where it happens: '+' or '-' at every copied token of a step,

* the operands and the operator of `a op b = c` (copied from the expression the step before
  left, or the problem's for the first step);
* every number of the rewritten rest `leaving <rest>` (the expression before, with the
  operation replaced by the `c` just written: a copy check, not an arithmetic one);
* the boxed answer (the last result),

the way `facts.fact_check_targets` puts the arithmetic verdict at the result token. Only steps
up to the first bad one get targets: after it the written expression and the true one differ,
and "copied right" has two meanings.
"""

from __future__ import annotations

import re

from tools.arith.common import BAD_ID, GOOD_ID, encode_text
from tools.arith.facts import TOKENS
from treeserve.eval.arith import (
    OPS,
    BinOp,
    Expr,
    evaluate,
    extract_boxed,
    parse,
    problem_expression,
    ready_nodes,
    render,
    replace,
    to_number,
)
from treeserve.eval.arith_labels import parse_op_step, step_verdicts

_NUMBER = re.compile(r"\d+")
_ELEMENT = re.compile(r"\d+|[-+*]")  # the copied elements of a rest: numbers and operators


def _skeleton(text: str) -> str:
    return _ELEMENT.sub("#", text)


def copy_verdicts(state: Expr, step: str) -> list[bool] | None:
    """Right or wrong for each copied token of `step` given the true expression `state`
    before it, in the order those tokens appear: `a`, `op`, `b`, then the rest's numbers and
    operators (only where its parentheses are as expected), or the boxed number of a final step.
    None where the step is neither (or its numbers are not one token each)."""
    boxed = extract_boxed(step)
    if boxed is not None:
        return [to_number(boxed) == evaluate(state)] if _NUMBER.fullmatch(boxed.strip()) else None
    parsed = parse_op_step(step)
    if parsed is None or isinstance(state, int) or min(parsed[0], parsed[2], parsed[3]) < 0:
        return None
    a, op, b, c, rest = parsed
    nodes = list(ready_nodes(state))
    path, node = max(nodes, key=lambda pn: (pn[1].op == op) + (pn[1].left == a) + (pn[1].right == b))
    swapped = op in "+*" and (a, b) == (node.right, node.left)
    verdicts = [a == node.left or swapped, op == node.op, b == node.right or swapped]
    expected = replace(state, path, c)
    wanted = render(expected) if isinstance(expected, BinOp) else None
    if rest is not None and wanted is not None and _skeleton(rest) == _skeleton(wanted):
        pairs = zip(_ELEMENT.findall(rest), _ELEMENT.findall(wanted), strict=True)
        verdicts += [x == y for x, y in pairs]
    return verdicts


def copied_positions(step_ids: list[int], final: bool) -> list[int]:
    """Offsets in a step's token ids of the tokens `copy_verdicts` judges, in order: the last
    number of a final step; else the first number, the operator after it, the second number
    and every number and operator after the third number (the result)."""
    numbers = [j for j, t in enumerate(step_ids) if TOKENS[t].isdigit()]
    if final:
        return numbers[-1:]
    if len(numbers) < 3:
        return []
    rest = [
        j for j in range(numbers[2] + 1, len(step_ids)) if TOKENS[step_ids[j]].isdigit() or TOKENS[step_ids[j]] in OPS
    ]
    return [numbers[0], numbers[0] + 2, numbers[1], *rest]


def copy_check_targets(problem: str, steps: list[str], ids: list[int], tags: list[int]) -> list[int]:
    """'+'/'-' at the copied tokens of every step up to the first bad one, -100 elsewhere;
    `ids` and `tags` are the PRM input of (`problem`, `steps`) (`prm_io.prm_input`)."""
    target = [-100] * len(ids)
    state = problem_expression(problem)
    for step, tag in zip(steps, tags, strict=True):
        verdicts = copy_verdicts(state, step)
        if verdicts is None:
            break
        step_ids = encode_text(step.strip())
        if len(_NUMBER.findall(step)) != sum(TOKENS[t].isdigit() for t in step_ids):
            break  # a number longer than one token: offsets would not line up
        final = extract_boxed(step) is not None
        offsets = copied_positions(step_ids, final)[: len(verdicts)]  # a rest of another shape is not judged
        if len(offsets) != len(verdicts):
            break
        start = tag - len(step_ids)
        for offset, right in zip(offsets, verdicts, strict=True):
            target[start + offset] = GOOD_ID if right else BAD_ID
        if final or step_verdicts(state, [step])[0] != "good":
            break
        a, op, b, c, rest = parse_op_step(step)  # type: ignore[misc]
        state = parse(rest) if rest is not None else c
    return target
