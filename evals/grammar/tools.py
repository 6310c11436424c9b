"""Tool calling over the function schemas of a real suite: the BFCL files of JSONSchemaBench,
on the embedded model, with tool_choice "required".

Each BFCL file's schema is a call of one of its functions (`{"fname": {parameters}}`, or an
`anyOf` of those); its functions become OpenAI tools (a `.` in a name, which OpenAI's name
pattern forbids, becomes `_`, as BFCL's own OpenAI handler writes it). The file has no user
question, so the prompt asks for a call of the tools with realistic arguments. For each:

1. the tool-call grammar compiles (`grammar.tool_calls`, llguidance) or why not;
2. greedy generation under it (fast-forward on, --max-new-tokens): did it finish, and do the
   calls parse and their arguments validate against their tool's parameters (the goal: 100%);
3. the same prompt generated again without the constraint, for the same number of tokens (EOS
   ignored): decode tok/s with and without, the constraint's cost.

Usage: python -m quantkit.evals.grammar.tools [--data DIR] [--limit N] [--max-new-tokens N]
           [--json F]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError, GrammarError
from quantkit.evals.common import run_main, write_json_atomic
from quantkit.evals.grammar.data import default_bench_dir
from quantkit.evals.grammar.generate import load_model

__all__ = ["bfcl_tools", "main"]


def bfcl_tools(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The OpenAI tools a BFCL call schema names."""
    branches = schema.get("anyOf", [schema])
    tools = []
    for branch in branches:
        for name, parameters in branch.get("properties", {}).items():
            function = {"name": name.replace(".", "_")[:64], "description": f"BFCL {name}",
                        "parameters": parameters}  # fmt: skip
            tools.append({"type": "function", "function": function})
    return tools


def _files(folder: Path, limit: int) -> list[Path]:
    files = sorted((folder / "maskbench" / "data").glob("BFCL_*.json"))
    if not files:
        raise EvalError(f"expected BFCL_*.json files under {folder}/maskbench/data, found none")
    step = max(1, len(files) // limit)
    return files[::step][:limit]


def _tok_s(stats: Any) -> float | None:
    steps = stats.decode_latencies_s
    return len(steps) / sum(steps) if steps and sum(steps) > 0 else None


def _one(loaded: Any, path: Path, max_new: int, eos: set[int]) -> dict[str, Any]:
    import json

    from quantkit.grammar.compiler import compile_grammar
    from quantkit.grammar.constraints import validate_json
    from quantkit.grammar.processor import GrammarLogitsProcessor
    from quantkit.grammar.tool_calls import (
        format_for,
        parse_tool_calls,
        parse_tools,
        render_tool_prompt,
        tool_call_grammar,
    )
    from quantkit.grammar.vocabulary import TokenVocabulary
    from quantkit.runtime.generate import generate
    from quantkit.runtime.sampling import SamplingParams

    raw = bfcl_tools(json.loads(path.read_text(encoding="utf-8"))["schema"])
    row: dict[str, Any] = {"name": path.name, "tools": len(raw)}
    tokenizer = loaded.tokenizer
    fmt = format_for(getattr(tokenizer, "chat_template", None))
    try:
        tools = parse_tools(raw)
        grammar = tool_call_grammar(tools, "required", fmt)
        size = loaded.config.get("vocab_size")
        vocab = TokenVocabulary.from_tokenizer(tokenizer, eos_token_ids=eos, vocab_size=size)
        started = time.perf_counter()
        compiled = compile_grammar(grammar, vocab, engine="llguidance", timeout_s=30)
        row["compile_ms"] = (time.perf_counter() - started) * 1e3
    except GrammarError as e:
        row.update(compiled=False, error=str(e))
        return row
    row["compiled"] = True
    names = " or ".join(t.name for t in tools)
    ask = [{"role": "user", "content": f"Call {names} with realistic arguments."}]
    ids = tokenizer.encode(render_tool_prompt(tokenizer, ask, tools, fmt),
                           add_special_tokens=False)  # fmt: skip
    processor = GrammarLogitsProcessor(compiled, max_new_tokens=max_new)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    out = generate(loaded.model, [ids], params, processors=[processor], eos_ids=eos,
                   tokenizer=tokenizer, fast_forward=True)  # fmt: skip
    text = out.texts[0] if out.texts else ""
    _, calls = parse_tool_calls(text, fmt)
    by_name = {t.name: t for t in tools}
    problems = [validate_json(c.arguments, by_name[c.name].parameters) if c.name in by_name
                else f"unknown tool {c.name}" for c in calls]  # fmt: skip
    stats = processor.mask_stats()
    row.update(
        finish=out.finish_reasons[0], new_tokens=len(out.tokens[0]), calls=len(calls),
        valid=bool(calls) and all(p is None for p in problems), output=text,
        problems=[p for p in problems if p], tok_s=_tok_s(out.stats),
        mask_mean_us=stats["mean_us"], forced=processor.forced_count,
    )  # fmt: skip
    free = generate(loaded.model, [ids], SamplingParams(temperature=0.0,
                    max_new_tokens=max(2, len(out.tokens[0]))), eos_ids=set(),
                    tokenizer=tokenizer)  # fmt: skip
    row["tok_s_free"] = _tok_s(free.stats)
    return row


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    compiled = [r for r in rows if r.get("compiled")]
    valid = [r for r in compiled if r.get("valid")]
    finished = [r for r in compiled if r.get("finish") == "stop"]
    pairs = [(r["tok_s"], r["tok_s_free"]) for r in compiled if r.get("tok_s") and
             r.get("tok_s_free")]  # fmt: skip
    with_grammar = sum(a for a, _ in pairs) / len(pairs) if pairs else None
    free = sum(b for _, b in pairs) / len(pairs) if pairs else None
    masks = [r["mask_mean_us"] for r in compiled if r.get("mask_mean_us") is not None]
    return {
        "files": len(rows), "compiled": len(compiled), "finished": len(finished),
        "valid_calls": len(valid), "valid_share": len(valid) / max(len(compiled), 1),
        "tok_s_constrained": with_grammar, "tok_s_free": free,
        "mask_mean_us": sum(masks) / len(masks) if masks else None,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.tools")
    parser.add_argument("--data", type=Path, default=None, help="JSONSchemaBench root folder")
    parser.add_argument("--limit", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        files = _files(args.data or default_bench_dir(), args.limit)
    except EvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from quantkit.runtime.generate import eos_token_ids

    loaded, described = load_model(args.model)
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    print(f"model: {described}", flush=True)
    rows = []
    for i, path in enumerate(files):
        row = _one(loaded, path, args.max_new_tokens, eos)
        rows.append(row)
        print(f"[{i + 1}/{len(files)}] {path.name}: "
              + (f"{row['finish']}, {row['calls']} call(s), valid={row['valid']}, "
                 f"{row['tok_s'] or 0:.1f} tok/s (free {row['tok_s_free'] or 0:.1f})"
                 if row["compiled"] else f"not compiled: {row['error']}"), flush=True)  # fmt: skip
    summary = _summary(rows)
    print(
        f"\n{summary['compiled']}/{summary['files']} compiled; valid calls "
        f"{summary['valid_calls']}/{summary['compiled']} ({summary['valid_share']:.1%}); "
        f"finished {summary['finished']}; decode {summary['tok_s_constrained'] or 0:.1f} tok/s "
        f"constrained vs {summary['tok_s_free'] or 0:.1f} free; mask mean "
        f"{summary['mask_mean_us'] or 0:.0f} us"
    )
    if args.json is not None:
        write_json_atomic(args.json, {"summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    run_main(main)
