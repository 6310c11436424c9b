"""The benchmark's model side: load the model (or only its tokenizer) and generate a batch of
outputs under their grammars, with and without fast-forward. Kept apart from
`jsonschema` so both stay small.
"""

from __future__ import annotations

from typing import Any

from quantkit.grammar.compiler import CompiledGrammar
from quantkit.grammar.constraints import validate_json
from quantkit.grammar.processor import GrammarLogitsProcessor
from quantkit.grammar.prompting import default_schema_prompt
from quantkit.runtime.head import head_name

__all__ = ["generate_batch", "load_model", "load_tokenizer", "model_vocabulary", "schema_jobs"]


def generate_batch(
    loaded: Any,
    rows: list[tuple[Any, Any, CompiledGrammar]],
    *,
    max_new: int,
    eos: set[int],
    fast_forward: bool = True,
    compare_ff: bool = False,
) -> tuple[list[float], list[float]]:
    from quantkit.runtime.generate import encode_prompt, generate
    from quantkit.runtime.sampling import SamplingParams

    prompts = [
        encode_prompt(loaded.tokenizer, default_schema_prompt(item.schema, max_schema_chars=1500))
        for _, item, _ in rows
    ]
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)

    def run(ff: bool) -> tuple[Any, GrammarLogitsProcessor]:
        processor = GrammarLogitsProcessor(
            [compiled for _, _, compiled in rows], max_new_tokens=max_new, greedy=params.greedy
        )
        out = generate(
            loaded.model, prompts, params, processors=[processor], eos_ids=eos,
            tokenizer=loaded.tokenizer, fast_forward=ff,
        )  # fmt: skip
        return out, processor

    out, processor = run(fast_forward)
    if compare_ff:
        plain, _ = run(not fast_forward)
        for i, (result, _, _) in enumerate(rows):
            result.ff_identical = plain.tokens[i] == out.tokens[i]
            result.tok_s_no_ff = _tok_s(plain.stats)
    for i, (result, item, _) in enumerate(rows):
        result.forced_tokens = processor.forced_count if len(rows) == 1 else 0
        result.unmasked_steps = processor.unmasked if len(rows) == 1 else 0
        result.tok_s = _tok_s(out.stats)
        result.steered = i in processor.steered
        result.finish = out.finish_reasons[i]
        result.new_tokens = len(out.tokens[i])
        result.output = out.texts[i] if out.texts else None
        if result.finish == "stop":
            problem = validate_json(result.output or "", item.schema)
            result.output_ok = problem is None
            result.output_error = problem
    # The first processor call is part of prefill (TTFT); the rest pair with the decode steps.
    return processor.mask_times_s[1:], list(out.stats.decode_latencies_s)


def _tok_s(stats: Any) -> float | None:
    steps = stats.decode_latencies_s
    return len(steps) / sum(steps) if steps and sum(steps) > 0 else None


def load_tokenizer(spec: str | None) -> tuple[Any, str]:
    """Without generation only the tokenizer (and config) is needed: no quantization, no
    weights loaded, and no wait on another process quantizing the embedded model."""
    from types import SimpleNamespace

    from quantkit.sources.resolve import read_config, resolve_model
    from quantkit.sources.tokenizer import load_tokenizer

    path = resolve_model(spec or "smollm2-135m")
    loaded = SimpleNamespace(path=path, tokenizer=load_tokenizer(path), config=read_config(path))
    return loaded, f"{path} (tokenizer only)"


def load_model(spec: str | None) -> tuple[Any, str]:
    """The model as `quantkit generate` runs it: the embedded INT4 checkpoint by default
    (quantized once on first use), float32 activations, the same automatic lm_head dtype."""
    import torch

    from quantkit.quantize.embedded import ensure_embedded_int4
    from quantkit.runtime.loader import load_model
    from quantkit.runtime.options import RuntimeOptions

    options = RuntimeOptions(dtype="float32", head_dtype="auto")
    loaded = load_model(spec or ensure_embedded_int4(), options=options)
    kind = loaded.describe()
    head = head_name(loaded.model)
    threads = torch.get_num_threads()
    return loaded, f"{loaded.path} ({kind}, lm_head {head}, {threads} torch threads)"


def model_vocabulary(loaded: Any) -> tuple[set[int], Any]:
    """A loaded model's EOS ids and its tokenizer's `TokenVocabulary`, as `generate` reads them."""
    from quantkit.grammar.vocabulary import TokenVocabulary
    from quantkit.runtime.generate import eos_token_ids

    eos = eos_token_ids(tokenizer=loaded.tokenizer, config=loaded.config, model_dir=loaded.path)
    vocab = TokenVocabulary.from_tokenizer(
        loaded.tokenizer, eos_token_ids=eos, vocab_size=loaded.config["vocab_size"]
    )
    return eos, vocab


def schema_jobs(
    loaded: Any, schemas: list[tuple[str, Any]], vocab: Any
) -> tuple[list[tuple[CompiledGrammar, list[int]]], list[str]]:
    """Each schema's compiled grammar (10 s limit, no cache) and its prompt's tokens, as the
    step benchmarks generate them; and `name (first line of the error)` of each that did not
    compile. EvalError where none did."""
    from quantkit.errors import EvalError, QuantkitError
    from quantkit.grammar.compiler import compile_grammar
    from quantkit.grammar.constraints import json_schema_grammar
    from quantkit.runtime.generate import encode_prompt

    jobs, skipped = [], []
    for name, schema in schemas:
        try:
            grammar = json_schema_grammar(schema, label=name)
            compiled = compile_grammar(grammar, vocab, timeout_s=10, cache=False)
        except QuantkitError as e:
            skipped.append(f"{name} ({str(e).splitlines()[0]})")
            continue
        prompt = encode_prompt(
            loaded.tokenizer, default_schema_prompt(schema, max_schema_chars=1500)
        )
        jobs.append((compiled, prompt))
    if not jobs:
        raise EvalError(f"expected a schema that compiles, got none of {len(schemas)}")
    return jobs, skipped
