"""What a request constrains its answer to, as a grammar: OpenAI's `response_format` (text,
json_object, json_schema with `strict`) and quantkit's types beyond it (grammar: Lark, or GBNF
with syntax "gbnf"; regex; choice), or vLLM's `structured_outputs` (json, regex, choice,
grammar, json_object), so clients written for vLLM work unchanged. At most one of the two
fields, and one constraint in `structured_outputs`; each mistake a 400 naming the field.

Everything here may be slow (a Lark grammar's syntax check, GBNF's conversion): the app calls
it from a worker thread, under the server's compile time limit.
"""

from __future__ import annotations

from typing import Any

from quantkit.errors import GrammarError
from quantkit.grammar.cfg import grammar_from_text
from quantkit.grammar.constraints import (
    Grammar,
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
)
from quantkit.grammar.strict import strict_schema
from quantkit.http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    ServerError,
    StructuredOutputs,
)

__all__ = ["request_grammar"]


def _needs(param: str, value: Any, what: str) -> Any:
    if value is None:
        raise ServerError(f"{param}: expected {what}, got none", param=param.split(".")[0])
    return value


def _from_response_format(fmt: ResponseFormat, timeout_s: float) -> Grammar | None:
    param = "response_format"
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_grammar({"type": "object"}, label="json_object")
    if fmt.type == "json_schema":
        spec = _needs(f"{param}.json_schema", fmt.json_schema, 'an object ({"name", "schema", '
                      '"strict"})')  # fmt: skip
        schema = strict_schema(spec.schema_) if spec.strict else spec.schema_
        return json_schema_grammar(schema, label=f"schema {spec.name}")
    if fmt.type == "grammar":
        text = _needs(f"{param}.grammar", fmt.grammar, "the grammar's text")
        return grammar_from_text(text, gbnf=fmt.syntax == "gbnf", where=f"{param}.grammar",
                                 timeout_s=timeout_s, origin=f"{param}.grammar",
                                 limit_hint="the server's --compile-timeout")  # fmt: skip
    if fmt.type == "regex":
        return regex_grammar(_needs(f"{param}.regex", fmt.regex, "a regular expression"))
    return choice_grammar(_needs(f"{param}.choice", fmt.choice, "a list of strings"))


def _from_structured_outputs(so: StructuredOutputs, timeout_s: float) -> Grammar:
    given = {k: v for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)}
    if len(given) != 1:
        raise ServerError(
            f"structured_outputs: expected exactly one of json, regex, choice, grammar, "
            f"json_object, got {len(given)} ({', '.join(sorted(given)) or 'none'})",
            param="structured_outputs",
        )
    if so.json_ is not None:
        return json_schema_grammar(so.json_, label="structured_outputs.json")
    if so.json_object:
        return json_schema_grammar({"type": "object"}, label="json_object")
    if so.regex is not None:
        return regex_grammar(so.regex)
    if so.choice is not None:
        return choice_grammar(so.choice)
    text = _needs("structured_outputs.grammar", so.grammar, "the grammar's text")
    return grammar_from_text(text, gbnf="::=" in text, where="structured_outputs.grammar",
                             timeout_s=timeout_s, origin="structured_outputs.grammar",
                             limit_hint="the server's --compile-timeout")  # fmt: skip


def request_grammar(
    body: CompletionRequest | ChatCompletionRequest, *, timeout_s: float
) -> tuple[Grammar, str] | None:
    """The grammar the request asks for and the field that asked (None: free text); a 400
    naming the field for what is wrong with it."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise ServerError("structured_outputs: expected it or response_format, got both",
                          param="structured_outputs")  # fmt: skip
    try:
        if body.structured_outputs is not None:
            return _from_structured_outputs(body.structured_outputs, timeout_s), (
                "structured_outputs")  # fmt: skip
        if body.response_format is not None:
            grammar = _from_response_format(body.response_format, timeout_s)
            return None if grammar is None else (grammar, "response_format")
    except GrammarError as e:
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        message = str(e) if str(e).startswith(param) else f"{param}: {e}"
        raise ServerError(message, param=param) from None
    return None
