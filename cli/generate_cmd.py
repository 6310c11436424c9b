"""`quantkit generate [MODEL_OR_CKPT] --prompt TEXT`: stream a completion, then say how close the
decode came to the machine's bandwidth ceiling. `--schema FILE.json | --regex PATTERN | --choice A
--choice B ... | --grammar FILE.lark|FILE.gbnf` constrain the output (see
`quantkit.cli.grammar_run`)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click
import torch

from quantkit.cli.grammar_run import GrammarRun, write_atomic
from quantkit.cli.options import Runtime, load, runtime_options
from quantkit.cli.reasoning_run import reasoning_gate
from quantkit.cli.tool_run import ToolRequest
from quantkit.errors import GenerationError
from quantkit.grammar.compiler import DEFAULT_ENGINE, DEFAULT_TIMEOUT_S, ENGINES
from quantkit.grammar.reasoning import split_reasoning
from quantkit.perf.measured import generation_roofline
from quantkit.perf.roofline import DecodeRoofline
from quantkit.runtime.describe import act_dtype_name, backend_line, device_name, kv_dtype_name
from quantkit.runtime.generate import (
    GenerationResult,
    StreamEvent,
    cache_length,
    encode_prompt,
    eos_token_ids,
    generate,
)
from quantkit.runtime.head import head_name
from quantkit.runtime.layer_progress import layer_progress
from quantkit.runtime.loader import LoadedModel
from quantkit.runtime.sampling import SamplingParams


def _interpreter_progress(
    loaded: LoadedModel, device: torch.device, max_new_tokens: int
) -> contextlib.AbstractContextManager[None]:
    """Under TRITON_INTERPRET=1 on CPU tensors every kernel runs as numpy calls: say so, and
    show each forward's progress per layer on stderr (a forward can take a minute)."""
    if loaded.scheme is None or device.type != "cpu":
        return contextlib.nullcontext()
    from quantkit.fused_kernels.kernel_registry import resolve_backend

    if resolve_backend(device, kind=loaded.scheme.kind) != "triton":
        return contextlib.nullcontext()
    click.echo(
        "note: the triton backend runs here under TRITON_INTERPRET=1 (every kernel as numpy "
        "calls, meant for tests): a model of this size can take minutes per token; progress "
        "per layer follows",
        err=True,
    )
    return layer_progress(
        loaded.model, new_tokens=max_new_tokens, label="triton interpreter", stream=sys.stderr
    )


def _summary_dict(
    result: GenerationResult,
    roof: DecodeRoofline | None,
    *,
    device: torch.device,
    backend: str,
    loaded: LoadedModel,
) -> dict[str, Any]:
    stats = result.stats.to_dict()
    out: dict[str, Any] = {
        "text": result.texts[0] if result.texts else "",
        "finish_reason": result.finish_reasons[0],
        "tokens": result.tokens[0],
        **stats,
        "bytes_per_token": None,
        "ceiling_tok_s": None,
        "mbu": None,
        "device": device_name(device),
        "backend": backend,
        "head_dtype": head_name(loaded.model),
        "act_dtype": act_dtype_name(loaded),
        "kv_dtype": kv_dtype_name(loaded),
        "model": str(loaded.path),
    }
    if roof is not None:
        detail = roof.to_dict()
        if stats["decode_tok_s"] is None:
            detail["mbu"] = None
        out.update(detail)
    return out


def _fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _print_summary(summary: dict[str, Any]) -> None:
    s = summary
    click.echo("")
    click.echo("---")
    for call in s.get("tool_calls", []):
        click.echo(f"tool call  {call['name']}({call['arguments']})")
    click.echo(
        f"tokens     {s['prompt_tokens']} prompt + {s['generated_tokens']} generated "
        f"(finish: {s['finish_reason']})"
    )
    prompt_rate = f" ({s['prompt_tok_s']:.0f} prompt tok/s)" if s["prompt_tok_s"] else ""
    click.echo(f"TTFT       {_fmt_ms(s['ttft_ms'])}{prompt_rate}")
    click.echo(f"TPOT       p50 {_fmt_ms(s['tpot_ms_p50'])}, p99 {_fmt_ms(s['tpot_ms_p99'])}")
    rate = "n/a (one token: no decode step)"
    if s["decode_tok_s"] is not None:
        rate = f"{s['decode_tok_s']:.1f} tok/s"
    click.echo(f"decode     {rate}")
    if (spec := s.get("speculation")) is not None:
        click.echo(
            f"speculate  {spec['accepted_tokens']}/{spec['drafted_tokens']} drafts accepted "
            f"({spec['acceptance_rate']:.0%}) over {spec['verify_steps']} verifying calls, "
            f"{spec['tokens_per_step']:.2f} tokens a model call; MBU below counts model calls"
        )
    if s["bytes_per_token"] is not None:
        mb = 1e-6
        click.echo(
            f"bytes      {s['bytes_per_token'] * mb:.1f} MB/token: Linears "
            f"{s['bytes_linear'] * mb:.1f} + scales/zeros {s['bytes_qparams'] * mb:.1f} + "
            f"lm_head {s['bytes_lm_head'] * mb:.1f} + norms {s['bytes_other'] * mb:.2f} + "
            f"KV {s['bytes_kv'] * mb:.2f} (at {s['kv_context']} tokens)"
        )
        mbu = "n/a" if s["mbu"] is None else f"{s['mbu']:.0%}"
        click.echo(
            f"roofline   ceiling {s['ceiling_tok_s']:.1f} tok/s at {s['peak_gb_s']:.1f} GB/s; "
            f"MBU {mbu}"
        )
    click.echo(f"device     {s['device']}")
    click.echo(f"backend    {s['backend']}")


@click.command("generate")
@click.argument("model", required=False, metavar="[MODEL_OR_CKPT]")
@click.option(
    "--prompt",
    default=None,
    help="The prompt text (optional with --schema: then a default prompt asks for a JSON "
    "object matching the schema, its title and description included).",
)
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="0 = off.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option(
    "--seed",
    type=click.IntRange(0, 2**63 - 1),
    default=None,
    help="Sampling seed (default: random).",
)
@click.option("--stop", multiple=True, help="Stop string (repeatable); removed from the output.")
@click.option(
    "--chat/--no-chat",
    default=None,
    help="Wrap the prompt in the tokenizer's chat template [default: chat if it has one].",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, no streaming.")
@runtime_options()
@click.option("--compile", "compile_step", is_flag=True, help="torch.compile the decode step.")
@click.option(
    "--schema", "schema_file", default=None, help="Output: JSON valid for this schema file."
)
@click.option(
    "--strict",
    is_flag=True,
    help="With --schema: objects hold only the properties their schema declares (as OpenAI's "
    "strict structured outputs: additionalProperties false where the schema is silent).",
)
@click.option("--regex", default=None, help="Output: text that fully matches this regex.")
@click.option("--choice", "choices", multiple=True, help="Output: one of these (repeatable).")
@click.option(
    "--grammar",
    "grammar_file",
    default=None,
    help="Output: text this context-free grammar derives: Lark syntax as llguidance reads it, or "
    "llama.cpp GBNF if the file ends in .gbnf (converted to Lark). llguidance only.",
)
@click.option(
    "--tools",
    "tools_file",
    default=None,
    help="Tools the model may call: a JSON list of OpenAI function tools. The chat template "
    "shows them (or, if it ignores them, a system message does); the answer's calls are "
    "constrained to declared tools with valid arguments.",
)
@click.option(
    "--tool-choice",
    default=None,
    help="With --tools: none, auto (the default: text or a call), required (a call), or a "
    "tool's name (a call of that tool).",
)
@click.option(
    "--parallel-tool-calls/--no-parallel-tool-calls",
    default=True,
    show_default=True,
    help="With --tools: allow several calls in one answer.",
)
@click.option(
    "--reasoning-budget",
    type=click.IntRange(min=0),
    default=None,
    help="For a reasoning model (its chat template speaks of <think>): at most this many "
    "thinking tokens, then </think> is written for it. The grammar of --schema/--regex/"
    "--choice/--grammar/--tools applies after the thinking, which is reported apart.",
)
@click.option(
    "--compile-timeout",
    type=float,
    default=DEFAULT_TIMEOUT_S,
    show_default=True,
    help="Seconds allowed to compile the --schema/--regex/--choice/--grammar grammar (every "
    "phase, a --grammar file's conversion and check included).",
)
@click.option(
    "--grammar-engine",
    type=click.Choice(ENGINES),
    default=DEFAULT_ENGINE,
    show_default=True,
    help="Constraint engine: llguidance, outlines (outlines-core), or auto (llguidance for "
    "schemas, outlines for --regex/--choice, each falling back to the other; --grammar: "
    "llguidance only).",
)
@click.option(
    "--fast-forward/--no-fast-forward",
    default=True,
    show_default=True,
    help="Append the tokens the grammar forces without sampling, fed in one model call.",
)
@click.option("--output", default=None, help="Also write the output to this file (atomically).")
def generate_cmd(
    model: str | None,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    seed: int | None,
    stop: tuple[str, ...],
    chat: bool | None,
    as_json: bool,
    compile_step: bool,
    schema_file: str | None,
    strict: bool,
    regex: str | None,
    choices: tuple[str, ...],
    grammar_file: str | None,
    tools_file: str | None,
    tool_choice: str | None,
    parallel_tool_calls: bool,
    reasoning_budget: int | None,
    compile_timeout: float,
    grammar_engine: str,
    fast_forward: bool,
    output: str | None,
    runtime: Runtime,
) -> None:
    """Generate a completion of --prompt with MODEL_OR_CKPT (a checkpoint, a HF directory, a
    .gguf file or smollm2-135m; default: the embedded model as INT4, quantized on first use),
    streaming the text, then print TTFT, TPOT, tok/s and MBU against this machine's ceiling.

    With --json, `generated_tokens` counts every sampled token, the EOS that ended the text
    included; `tokens` lists the output ids (EOS excluded)."""
    # Every check that needs no model first, so bad input fails in milliseconds.
    if strict and schema_file is None:
        raise GenerationError("--strict: expected --schema FILE with it, got no --schema")
    tools = ToolRequest.from_options(tools_file, tool_choice, parallel=parallel_tool_calls)
    if tools is not None and (schema_file or regex or choices or grammar_file):
        raise GenerationError(
            "--tools: expected no --schema/--regex/--choice/--grammar with it (the tool "
            "calls are the constraint), got one"
        )
    grammar, prompt = _grammar_and_prompt(
        prompt, schema_file, regex, choices, grammar_file, compile_timeout, grammar_engine,
        strict=strict,
    )  # fmt: skip
    spec = runtime.speculation()
    if spec is not None and (grammar is not None or compile_step):
        raise GenerationError(
            "--speculate: expected no --schema/--regex/--choice/--grammar (a grammar advances "
            "one token a step; --fast-forward skips its forced tokens instead) and no --compile, "
            "got " + ("a grammar" if grammar is not None else "--compile")
        )
    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        max_new_tokens=max_new_tokens,
        stop=tuple(stop),
    )
    runtime.set_threads()
    dev = runtime.torch_device()
    options = runtime.options(dev)
    loaded = load(model, options)
    if tools is not None:
        ids = tools.prompt_ids(loaded.tokenizer, prompt, chat=chat)
        grammar = tools.grammar_run(loaded.tokenizer, compile_timeout=compile_timeout,
                                    log=lambda line: click.echo(line, err=True))  # fmt: skip
    else:
        ids = encode_prompt(loaded.tokenizer, prompt, chat=chat)
    _warn_if_clamped(loaded, len(ids), max_new_tokens)
    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    processors: list[Any] = []
    if grammar is not None:
        processors = [
            grammar.processor(
                loaded, eos_ids=eos, max_new_tokens=max_new_tokens, greedy=params.greedy
            )
        ]
    thinking = reasoning_gate(loaded, ids, processors, eos=eos, chat=chat,
                              max_new_tokens=max_new_tokens, budget=reasoning_budget)  # fmt: skip
    if thinking is not None:
        processors = [thinking]
    slots = _warm_compile(loaded, ids, max_new_tokens) if compile_step else None
    with _interpreter_progress(loaded, dev, max_new_tokens):
        result = generate(
            loaded.model,
            [ids],
            params,
            eos_ids=eos,
            tokenizer=loaded.tokenizer,
            on_token=None if as_json else _stream,
            compile=compile_step,
            cache_len=slots,
            processors=processors,
            fast_forward=fast_forward and grammar is not None,
            speculate=spec,
        )
    backend = backend_line(loaded, dev, options.torch_dtype())
    roof = generation_roofline(loaded.model, result.stats, dev)
    summary = _summary_dict(result, roof, device=dev, backend=backend, loaded=loaded)
    if thinking is not None:  # the thinking apart; the grammar and the calls see the answer
        summary["reasoning"], summary["text"] = split_reasoning(summary["text"], thinking.fmt)
        summary["reasoning_tokens"] = thinking.thinking
    if tools is not None:
        summary["tool_calls"] = tools.calls(loaded.tokenizer, summary["text"])
    _report(summary, result, grammar, as_json=as_json, output=output)


def _grammar_and_prompt(
    prompt: str | None,
    schema_file: str | None,
    regex: str | None,
    choices: tuple[str, ...],
    grammar_file: str | None,
    compile_timeout: float,
    engine: str,
    *,
    strict: bool = False,
) -> tuple[GrammarRun | None, str]:
    """The constraint (if any) and the prompt: --schema alone gets a default prompt."""
    grammar = GrammarRun.from_options(
        schema=schema_file,
        strict=strict,
        regex=regex,
        choices=choices,
        grammar_file=grammar_file,
        compile_timeout=compile_timeout,
        engine=engine,
    )
    if grammar is not None:
        prompt = grammar.prompt(prompt)
    if prompt is None:
        raise GenerationError("--prompt: expected a prompt (or --schema FILE), got none")
    if not prompt.strip():
        raise GenerationError("--prompt: expected some text, got an empty prompt")
    return grammar, prompt


def _warn_if_clamped(loaded: LoadedModel, prompt_tokens: int, max_new_tokens: int) -> None:
    """One warning line when the prompt and --max-new-tokens overflow the context window:
    `generate` caps the row at what fits, which the user should not have to discover."""
    context = loaded.model.config.max_position_embeddings
    fits = context - prompt_tokens
    if 0 < fits < max_new_tokens:  # fits <= 0: generate refuses the prompt itself
        click.echo(
            f"warning: --max-new-tokens {max_new_tokens}: only {fits} tokens fit after the "
            f"{prompt_tokens}-token prompt in the {context}-token context window; generating "
            f"at most {fits}",
            err=True,
        )


def _stream(event: StreamEvent) -> None:
    if event.text:
        sys.stdout.write(event.text)
        sys.stdout.flush()


def _warm_compile(loaded: LoadedModel, ids: list[int], max_new_tokens: int) -> int:
    """The compiled step is specialized to the cache length: warm up with the real one."""
    context = loaded.model.config.max_position_embeddings
    slots = cache_length([len(ids)], max_new_tokens, context=context)
    click.echo("compiling the decode step (a short warm-up run; minutes on a CPU) ...", err=True)
    warm = SamplingParams(max_new_tokens=min(3, max_new_tokens))
    generate(loaded.model, [ids], warm, compile=True, cache_len=slots)
    return slots


def _report(
    summary: dict[str, Any],
    result: GenerationResult,
    grammar: GrammarRun | None,
    *,
    as_json: bool,
    output: str | None,
) -> None:
    """Print the summary (or one JSON object); check and write the constrained output."""
    finish = result.finish_reasons[0]
    if grammar is not None:
        summary.update(grammar.summary(summary["text"], finish, result.stats.decode_latencies_s))
    if as_json:
        click.echo(json.dumps(summary))
    else:
        _print_summary(summary)
        for line in grammar.summary_lines(summary) if grammar is not None else []:
            click.echo(line)
    if grammar is not None:  # a GrammarError (exit 2) if the output is incomplete or invalid
        grammar.finish(summary["text"], finish, output=Path(output) if output else None)
    elif output is not None:
        write_atomic(Path(output), summary["text"])
