"""Chat templates rendered with jinja2 exactly as `transformers` renders them.

Same environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls), same helpers
(`raise_exception`, `tojson`, `strftime_now`, `{% generation %}` blocks) and the same
`continue_final_message` truncation rule.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; render as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:  # noqa: ANN001
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    template: str,
    messages: list[dict],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    **kwargs: object,
) -> str:
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    try:
        rendered = compile_template(template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
            **kwargs,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
    if continue_final_message:
        rendered = _cut_after_final_message(rendered, messages[-1]["content"])
    return rendered


def _cut_after_final_message(rendered: str, final: str | list) -> str:
    if isinstance(final, list):
        texts = [part["text"] for part in final if part.get("type") == "text"]
        final = texts[-1] if texts else ""
    if final.strip() not in rendered:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
    start = rendered.rindex(final.strip())
    if rendered[start : start + len(final.lstrip())] == final:
        return rendered[: start + len(final.lstrip())]
    return rendered[: start + len(final.strip())]
