"""The OpenAI wire format the server speaks: request bodies as pydantic models, the error shape.

Request models are strict (a string where a number belongs is a 400, not a silent cast) and
ignore fields they do not know, as OpenAI-compatible servers do, so a client that sends a newer
field still gets served. Parameters quantkit cannot honour (suffix, best_of other than n)
are rejected with a 400 naming them, never ignored; so are values out of range (`prepare.py`
checks: n above the batch cap, top_logprobs or completions' logprobs above 20, penalties
outside [-2, 2], top_logprobs without logprobs: true).

Served as OpenAI defines them: n choices per prompt (several prompts on /v1/completions),
logprobs (chat: `logprobs` + `top_logprobs`; completions: `logprobs: N`, with `echo` the
prompt's too), echo (max_tokens 0 with it scores the prompt only), presence_penalty and
frequency_penalty, max_completion_tokens, stream_options.include_usage.

quantkit's extra sampling knobs travel as extra body fields (the openai client's `extra_body`):
top_k, min_p, repetition_penalty, and ignore_eos (generate exactly max_tokens tokens, as the
serving benchmark does).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantkit.errors import QuantkitError

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "JsonSchemaSpec",
    "ResponseFormat",
    "ServerError",
    "StreamOptions",
    "StructuredOutputs",
    "error_body",
]


class ServerError(QuantkitError):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type = message, status, type
        self.param, self.code, self.headers = param, code, headers or {}


def error_body(
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaSpec(_Body):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's types, and quantkit's beyond JSON: "grammar" (Lark as llguidance reads it, or
    llama.cpp GBNF with syntax "gbnf"), "regex" and "choice"."""

    type: Literal["text", "json_object", "json_schema", "grammar", "regex", "choice"]
    json_schema: JsonSchemaSpec | None = None
    grammar: str | None = None
    syntax: Literal["lark", "gbnf"] = "lark"
    regex: str | None = None
    choice: list[str] | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` request field: exactly one of these (a grammar holding
    `::=` is read as GBNF, else as Lark)."""

    # `json` shadows a BaseModel attribute, hence the alias.
    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


Count = Annotated[int, Field(ge=1)]


class _Sampling(_Body):
    """The fields completions and chat share."""

    model: str
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Count = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool | int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    user: str | None = None
    # quantkit's extras (extra_body).
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    # Checked in the handler (<= 0 is a 400 there, with OpenAI's wording).
    max_tokens: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class _TextPart(_Body):
    type: Literal["text"]
    text: str


class _FunctionCall(_Body):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(_Body):
    """An assistant turn's call, sent back in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_budget: Annotated[int, Field(ge=0)] | None = None  # extra body: thinking cap
    top_logprobs: int | None = None
