"""What quantization cost: quantized checkpoints vs their reference, on one table.

For the reference and each checkpoint: lm-eval on quantkit's offline tasks (`QuantkitLM`), the
perplexity of the held-out Wikipedia split (sliding window), and for each checkpoint the mean
KL divergence and top-1 agreement of its next-token distributions with the reference's on the
same text. Recovery = checkpoint / reference for higher-is-better metrics (accuracy) and
reference / checkpoint for lower-is-better ones (perplexity), so 100% means nothing was lost.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import EvalError
from quantkit.evals.accuracy.perplexity import (
    LogitAgreement,
    Perplexity,
    compare_logits,
    perplexity,
)
from quantkit.evals.accuracy.task_data import LOCAL_TASKS, check_task_data, resolve_task_names
from quantkit.evals.common import write_json_atomic
from quantkit.runtime.loader import LoadedModel, load_model
from quantkit.sources.resolve import resolve_model
from quantkit.sources.tokenizer import load_tokenizer

__all__ = ["Comparison", "ModelResult", "Row", "compare_models", "format_table", "write_json"]

_SHORT = {full: short for short, full in LOCAL_TASKS.items()}


@dataclass
class ModelResult:
    name: str
    path: str
    scheme: str
    metrics: dict[str, dict[str, float]]  # task -> metric -> value
    higher_is_better: dict[str, dict[str, bool]]
    lm_eval: dict[str, Any]  # lm-eval's results, configs, versions, n-samples
    perplexity: Perplexity | None
    agreement: LogitAgreement | None  # None for the reference
    seconds: float


@dataclass(frozen=True)
class Row:
    task: str
    metric: str
    higher_is_better: bool | None  # None: not a quality metric (KL, agreement)
    reference: float
    values: list[float]
    recovery: list[float | None] = field(default_factory=list)


@dataclass
class Comparison:
    reference: ModelResult
    candidates: list[ModelResult]
    rows: list[Row]
    settings: dict[str, Any]


def _recovery(ref: float, value: float, higher_is_better: bool | None) -> float | None:
    if higher_is_better is None or not (math.isfinite(ref) and math.isfinite(value)):
        return None
    if higher_is_better:
        return value / ref if ref > 0 else None
    return ref / value if value > 0 else None


def _metrics(results: dict[str, Any]) -> tuple[dict, dict]:
    """task -> metric -> value (stderr and alias dropped), and task -> metric -> higher better."""
    values: dict[str, dict[str, float]] = {}
    better: dict[str, dict[str, bool]] = {}
    for task, entries in results["results"].items():
        # The task's metrics are the keys of higher_is_better; results also hold stderrs,
        # the alias and bookkeeping such as sample_len.
        hib = results.get("higher_is_better", {}).get(task, {})
        for key, value in entries.items():
            metric, _, _filter = key.partition(",")
            if metric in hib and isinstance(value, (int, float)):
                values.setdefault(task, {})[metric] = float(value)
                better.setdefault(task, {})[metric] = bool(hib[metric])
    return values, better


def _check_tokenizers(specs: Sequence[str]) -> list[Any]:
    """Each model's tokenizer, loaded before any evaluation starts so that a checkpoint without
    one fails in a second, not after the reference's run (CheckpointError from the loader)."""
    return [load_tokenizer(resolve_model(spec)) for spec in specs]


def _same_vocab(ref_tok: Any, tok: Any, name: str) -> None:
    if len(ref_tok) != len(tok) or ref_tok.get_vocab() != tok.get_vocab():
        raise EvalError(
            f"{name}: expected the reference's tokenizer ({len(ref_tok)} tokens) to compare "
            f"next-token distributions, got a different one ({len(tok)} tokens)"
        )


def _fingerprint(loaded: LoadedModel, options: dict[str, Any]) -> str:
    """Names a model's response cache: its directory, every file's size and mtime, and the
    options that change scores. Rewriting a checkpoint in place therefore starts a new cache."""
    parts = [str(loaded.path.resolve()), json.dumps(options, sort_keys=True, default=str)]
    for f in sorted(loaded.path.iterdir()):
        if f.is_file():
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _name(spec: str, taken: set[str]) -> str:
    base = Path(spec).name or str(spec)
    name, n = base, 2
    while name in taken:
        name, n = f"{base}#{n}", n + 1
    taken.add(name)
    return name


@dataclass(frozen=True)
class _EvalPlan:
    """How every model is scored: the same tasks, text, options and lm-eval entry points."""

    task_names: list[str]
    limit: int | None
    metadata: dict[str, str] | None  # for the tasks' data loaders
    lm_options: dict[str, Any]  # QuantkitLM's batching options
    held: torch.Tensor | None  # held-out tokens for perplexity and agreement; None: skipped
    window: int
    max_batch_tokens: int
    add_bos_token: bool | None
    dtype: torch.dtype
    cache_dir: str | Path | None
    progress: bool
    lm_class: Callable[..., Any]  # QuantkitLM, imported once lm-eval may be
    evaluate: Callable[..., dict]  # the harness's simple_evaluate


def compare_models(
    checkpoints: Sequence[str | Path],
    *,
    reference: str | Path,
    tasks: Sequence[str],
    limit: int | None = None,
    ppl_tokens: int = 8192,
    window: int = 512,
    batch_size: int = 32,
    max_batch_tokens: int = 2048,
    add_bos_token: bool | None = None,
    data_dir: str | Path | None = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Comparison:
    """Evaluate `reference` and every checkpoint; see the module docstring.

    tasks: short names (arc_easy, piqa, lambada, ...) or quantkit_* task names.
    ppl_tokens: held-out tokens for perplexity and the logit comparison (0 skips both).
    dtype: activations and dense weights of every model (the same for all, so the comparison
        is like for like).
    cache_dir: keep each model's lm-eval answers there (lm-eval's sqlite response cache, one
        file per model fingerprint), so a re-run with one more checkpoint only evaluates it.
    """
    from quantkit.evals.accuracy.harness import offline_env, simple_evaluate

    offline_env()  # before lm-eval (and `datasets`, which reads it once) is imported
    from quantkit.evals.accuracy.lm_eval_model import QuantkitLM

    say = log or (lambda _msg: None)
    _check_arguments(checkpoints, limit=limit, ppl_tokens=ppl_tokens, window=window)
    task_names = resolve_task_names(list(tasks))
    specs = [str(reference), *(str(c) for c in checkpoints)]
    names, tokenizers = _names_and_tokenizers(specs)
    check_task_data(task_names, data_dir)  # a bad row: one line now, not after a model loads
    held = None
    if ppl_tokens:
        from quantkit.quantize.calibration import heldout_tokens

        held = heldout_tokens(tokenizers[0], max_tokens=ppl_tokens)
    plan = _EvalPlan(
        task_names=task_names,
        limit=limit,
        metadata={"data_dir": str(data_dir)} if data_dir else None,
        lm_options=dict(
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            add_bos_token=add_bos_token,
            progress=progress,
        ),
        held=held,
        window=window,
        max_batch_tokens=max_batch_tokens,
        add_bos_token=add_bos_token,
        dtype=dtype,
        cache_dir=cache_dir,
        progress=progress,
        lm_class=QuantkitLM,
        evaluate=simple_evaluate,
    )
    results = _score_all(plan, specs, names, say)
    settings = {
        "tasks": task_names,
        "limit": limit,
        "ppl_tokens": 0 if held is None else int(held.numel()),
        "window": window,
        "add_bos_token": add_bos_token,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return Comparison(results[0], results[1:], _rows(task_names, results[0], results[1:]), settings)


def _check_arguments(
    checkpoints: Sequence[str | Path], *, limit: int | None, ppl_tokens: int, window: int
) -> None:
    if not checkpoints:
        raise EvalError("checkpoints: expected at least one checkpoint to compare, got none")
    if limit is not None and limit < 1:
        raise EvalError(f"--limit: expected an integer >= 1, got {limit}")
    if ppl_tokens and ppl_tokens < window + 1:
        raise EvalError(
            f"--ppl-tokens: expected 0 or more than the window ({window}), got {ppl_tokens}"
        )


def _names_and_tokenizers(specs: list[str]) -> tuple[list[str], list[Any]]:
    """Each model's table name ("reference", then the checkpoints' distinct names) and its
    tokenizer, every checkpoint's checked to be the reference's."""
    tokenizers = _check_tokenizers(specs)
    taken: set[str] = set()
    names = ["reference", *(_name(s, taken) for s in specs[1:])]
    for name, tok in zip(names[1:], tokenizers[1:], strict=True):
        _same_vocab(tokenizers[0], tok, name)
    return names, tokenizers


def _score_all(
    plan: _EvalPlan, specs: list[str], names: list[str], say: Callable[[str], None]
) -> list[ModelResult]:
    """Score the models one at a time, the reference first: only the reference stays loaded
    beside the model being scored, for the logit comparison."""
    ref_loaded: LoadedModel | None = None
    results: list[ModelResult] = []
    for i, (spec, name) in enumerate(zip(specs, names, strict=True)):
        say(f"[{i + 1}/{len(specs)}] {name}: {spec}")
        result, loaded = _score_model(plan, spec, name, ref_loaded)
        results.append(result)
        say(f"[{i + 1}/{len(specs)}] {name}: done in {results[-1].seconds:.0f} s")
        if ref_loaded is None:
            ref_loaded = loaded  # kept for the logit comparison
        del loaded
    return results


def _score_model(
    plan: _EvalPlan, spec: str, name: str, ref_loaded: LoadedModel | None
) -> tuple[ModelResult, LoadedModel]:
    """Load one model and score it: lm-eval on the tasks, then perplexity and (for a
    checkpoint) its agreement with the reference on the held-out text."""
    start = time.perf_counter()
    loaded = load_model(spec, dtype=plan.dtype)
    lm = plan.lm_class(pretrained=loaded, **plan.lm_options)
    cache = None
    if plan.cache_dir is not None:
        Path(plan.cache_dir).mkdir(parents=True, exist_ok=True)
        key = _fingerprint(loaded, {"add_bos_token": plan.add_bos_token, "dtype": str(plan.dtype)})
        cache = str(Path(plan.cache_dir) / f"{Path(loaded.path).name}-{key}")
    raw = plan.evaluate(
        lm,
        plan.task_names,
        limit=plan.limit,
        metadata=plan.metadata,
        bootstrap_iters=1000,
        use_cache=cache,
    )
    values, better = _metrics(raw)
    ppl = agreement = None
    if plan.held is not None:
        with torch.inference_mode():
            ppl = perplexity(
                loaded.model,
                plan.held,
                window=plan.window,
                batch_size=max(1, plan.max_batch_tokens // plan.window),
                progress=plan.progress,
            )
            if ref_loaded is not None:
                # batch 1: two [B, window, vocab] fp32 log-prob tensors are alive at once.
                agreement = compare_logits(
                    ref_loaded.model, loaded.model, plan.held, window=plan.window, batch_size=1
                )
    scheme = loaded.describe()
    raw = {k: raw[k] for k in ("results", "configs", "versions", "n-samples") if k in raw}
    result = ModelResult(
        name=name,
        path=str(loaded.path),
        scheme=scheme,
        metrics=values,
        higher_is_better=better,
        lm_eval=raw,
        perplexity=ppl,
        agreement=agreement,
        seconds=time.perf_counter() - start,
    )
    return result, loaded


def _rows(tasks: list[str], ref: ModelResult, cands: list[ModelResult]) -> list[Row]:
    rows = []
    for task in tasks:  # the order asked for
        for metric, value in ref.metrics.get(task, {}).items():
            hib = ref.higher_is_better[task][metric]
            values = [c.metrics.get(task, {}).get(metric, math.nan) for c in cands]
            rows.append(
                Row(
                    _SHORT.get(task, task),
                    metric,
                    hib,
                    value,
                    values,
                    [_recovery(value, v, hib) for v in values],
                )
            )
    if ref.perplexity is not None:
        p = ref.perplexity
        label = f"ppl w{p.window} ({p.tokens} tok)"
        values = [c.perplexity.ppl if c.perplexity else math.nan for c in cands]
        recovery = [_recovery(p.ppl, v, False) for v in values]
        rows.append(Row("wiki held-out", label, False, p.ppl, values, recovery))
        kl = [c.agreement.kl if c.agreement else math.nan for c in cands]
        top1 = [c.agreement.top1 if c.agreement else math.nan for c in cands]
        rows.append(Row("vs reference", "KL nats/tok", None, 0.0, kl, [None] * len(cands)))
        rows.append(Row("vs reference", "top-1 agree", None, 1.0, top1, [None] * len(cands)))
    return rows


def mean_recovery(comparison: Comparison) -> list[float | None]:
    """Per checkpoint: the mean recovery over the higher-is-better (accuracy) rows."""
    out = []
    for i in range(len(comparison.candidates)):
        rec = [r.recovery[i] for r in comparison.rows if r.higher_is_better and r.recovery[i]]
        out.append(sum(rec) / len(rec) if rec else None)
    return out


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def format_table(comparison: Comparison) -> str:
    """One table: task, metric, reference, then each checkpoint with its recovery %."""
    cands = comparison.candidates
    head = ["task", "metric", "reference"]
    for c in cands:
        head += [c.name, "rec %"]
    body = []
    for r in comparison.rows:
        line = [r.task, r.metric, _fmt(r.reference)]
        for v, rec in zip(r.values, r.recovery, strict=True):
            line += [_fmt(v), "-" if rec is None else f"{100 * rec:.1f}"]
        body.append(line)
    means = mean_recovery(comparison)
    foot = ["mean accuracy recovery", "", ""]
    for m in means:
        foot += ["", "-" if m is None else f"{100 * m:.1f}"]
    widths = [max(len(row[j]) for row in [head, *body, foot]) for j in range(len(head))]

    def line(cells: list[str]) -> str:
        parts = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        parts += [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(parts).rstrip()

    rule = "-" * len(line(head))
    schemes = ", ".join(f"{c.name} = {c.scheme}" for c in cands)
    limit = comparison.settings.get("limit")
    lines = [line(head), rule, *(line(b) for b in body), rule, line(foot)]
    lines.append(f"{schemes}; items per task: {limit or 'all'}")
    return "\n".join(lines)


def write_json(comparison: Comparison, path: Path) -> None:
    """Everything: settings, the table rows, and each model's full lm-eval results."""

    data = {
        "settings": comparison.settings,
        "table": [asdict(r) for r in comparison.rows],
        "mean_accuracy_recovery": dict(
            zip([c.name for c in comparison.candidates], mean_recovery(comparison), strict=True)
        ),
        "reference": asdict(comparison.reference),
        "checkpoints": [asdict(c) for c in comparison.candidates],
    }
    write_json_atomic(Path(path), data, indent=2, default=str)
