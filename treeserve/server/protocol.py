"""The HTTP request and response shapes: OpenAI's (as vLLM serves them, with vLLM's extras and
structured-output fields) plus `/v1/search` and `/v1/prm/score`. Bounds that protect the server
(`MAX_N`, `MAX_LOGPROBS`, `MAX_STOP`, `MAX_LOGIT_BIAS`) are in the schema: a 400 before queueing.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, create_model

from treeserve.search.config import MAX_N, SearchConfig, default_of

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_STOP = 16
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias (OpenAI allows 300)

Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Count = Annotated[int, Field(ge=1, le=MAX_N)]
MaxTokens = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]  # OpenAI's range
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):
    """`response_format.json_schema` (OpenAI's): the schema is enforced whatever `strict` says."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    type: Literal["json_object"]


class JsonSchemaFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: JsonSchema


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` body field; exactly one is checked by `StructuredOutputsParams`."""

    model_config = ConfigDict(extra="forbid")  # an unknown constraint must not be dropped silently

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """Sampling fields shared by completions and chat completions (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: Count = 1
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None
    response_format: ResponseFormat | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=2.0)] = 1.0  # above 0: no fp32 overflow
    min_tokens: Annotated[int, Field(ge=0)] = 0
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # reasoning models: tokens allowed in a `<think>` block
    max_thinking_tokens: Annotated[int, Field(ge=0)] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # 0 only with echo
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # with logprobs, the prompt's too


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None  # None: up to the context length
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


def _search_field(f: dataclasses.Field) -> tuple[Any, Any]:
    """A `/v1/search` field from SearchConfig field `f`: its type, bounds (a `cap` lowers `le`)
    and choices from the metadata; `stop` also takes one string, or null for none."""
    meta, kind = f.metadata, f.type.split(" |")[0]
    if "choices" in meta:
        annotation: Any = Literal[meta["choices"]]
    elif kind == "list[str]":
        annotation = str | list[str]
    else:
        caps = [v for v in (meta.get("le"), meta.get("cap")) if v is not None]
        bounds = {"ge": meta.get("ge"), "gt": meta.get("gt"), "le": min(caps) if caps else None}
        annotation = Annotated[{"int": int, "float": float, "bool": bool, "str": str}[kind], Field(**bounds)]
    default = default_of(f)
    if "None" in f.type or kind == "list[str]":
        annotation = annotation | None
        default = None if kind == "list[str]" else default
    return annotation, Field(default=default, description=meta["help"])


SEARCH_FIELDS = tuple(f.name for f in dataclasses.fields(SearchConfig) if f.metadata.get("http", True))
SearchRequest = create_model(
    "SearchRequest",
    __config__=ConfigDict(extra="forbid"),
    __doc__="`POST /v1/search`: one problem, one strategy; SearchConfig's fields plus the request's own.",
    model=(str | None, None),
    problem=(str | None, None),
    messages=(Annotated[list[ChatMessage], Field(min_length=1)] | None, None),
    stream=(bool, False),
    deadline_s=(float | None, None),  # answer with what the search holds after this many seconds
    verify=(bool | None, None),  # verify with `serve --verifier` (None: when it has one)
    selection=(Literal["naive", "weighted", "majority"] | None, None),
    **{f.name: _search_field(f) for f in dataclasses.fields(SearchConfig) if f.name in SEARCH_FIELDS},
)


def search_config(request: BaseModel) -> SearchConfig:
    """The request's SearchConfig (its cross-field checks raise ValueError: a 400)."""
    return SearchConfig(**{name: getattr(request, name) for name in SEARCH_FIELDS})


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    return {
        "error": {"message": message, "type": kind or kinds.get(status, "server_error"), "param": None, "code": status}
    }


Steps = Annotated[list[StrictStr], Field(min_length=1)]


class PRMScoreRequest(BaseModel):
    """`POST /v1/prm/score`: every step of one solution (`steps`) or of a batch (`solutions`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # the PRM's name (role "prm")
    question: StrictStr
    steps: Steps | None = None
    solutions: Annotated[list[Steps], Field(min_length=1, max_length=MAX_N)] | None = None
