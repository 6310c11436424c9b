"""The grammar's cost per decode step, this checkout against a git revision, paired in one process.

On a shared 2-core host the per-step time of the grammar inside `generate` moves by a third from
run to run (152-244 us for the same code and schemas), far more than most changes to it. This
takes both sides in one process: the revision's `grammar/` package is copied out of git under
another name (`quantkit_grammar_base`, its own imports rewritten), and for each schema both
compile it and generate the same greedy output on the same loaded model (embedded INT4 by
default), the side that goes first alternating schema by schema. Reported: each side's mean,
median and p99 of the processor's time a step (`mask_times_s` after the first call: the mask or
the verdicts, the advances, the budget steering and the row's checks), and whether every
generation gave the same tokens (a grammar change that should not change outputs must show
`same`). Only the grammar package differs: the model, the kernels and the sampler are this
checkout's for both.

Usage: python -m quantkit.evals.grammar.paired --base REV [--data DIR] [--per-category K]
           [--schema FILE ...] [--rounds N] [--max-new-tokens N] [--json F]
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from quantkit.errors import EvalError, QuantkitError
from quantkit.evals.common import git_commit, print_and_save, run_main
from quantkit.evals.grammar.data import add_schema_arguments, schemas_asked
from quantkit.evals.grammar.generate import load_model, model_vocabulary

__all__ = ["base_grammar", "main"]

BASE_NAME = "quantkit_grammar_base"
_REPO = Path(__file__).resolve().parents[2]


def base_grammar(rev: str, folder: Path, *, repo: Path = _REPO) -> ModuleType:
    """The `grammar/` package of git revision `rev`, written under `folder` as
    `quantkit_grammar_base` (imports of `quantkit.grammar` rewritten to it) and imported;
    EvalError where git cannot give it."""
    try:
        found = subprocess.run(
            ["git", "archive", "--format=tar", rev, "grammar"],
            cwd=repo, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EvalError(f"--base {rev}: expected git to give its grammar package, got {e}") from e
    if found.returncode:
        why = found.stderr.decode(errors="replace").strip().splitlines()
        raise EvalError(f"--base {rev}: expected a revision with grammar/, got git: "
                        f"{why[-1] if why else found.returncode}")  # fmt: skip
    target = folder / BASE_NAME
    with tarfile.open(fileobj=BytesIO(found.stdout)) as archive:
        for member in archive.getmembers():
            if not member.isfile() or not member.name.startswith("grammar/"):
                continue
            data = archive.extractfile(member)
            assert data is not None  # a regular file
            path = target / member.name[len("grammar/") :]
            path.parent.mkdir(parents=True, exist_ok=True)
            text = data.read().decode()
            path.write_text(text.replace("quantkit.grammar", BASE_NAME))
    for name in [m for m in sys.modules if m == BASE_NAME or m.startswith(BASE_NAME + ".")]:
        del sys.modules[name]  # another revision's, imported before
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(BASE_NAME)


def _sides(base: ModuleType) -> dict[str, tuple[Any, Any, Any]]:
    """(compiler, constraints, processor) modules of each side."""
    out = {}
    for side, name in (("base", base.__name__), ("this", "quantkit.grammar")):
        out[side] = tuple(
            importlib.import_module(f"{name}.{m}") for m in ("compiler", "constraints", "processor")
        )
    return out


def run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    from quantkit.grammar.prompting import default_schema_prompt
    from quantkit.runtime.generate import encode_prompt, generate
    from quantkit.runtime.sampling import SamplingParams

    schemas = schemas_asked(args)
    with tempfile.TemporaryDirectory() as tmp:
        sides = _sides(base_grammar(args.base, Path(tmp)))
        loaded, desc = load_model(args.model)
        eos, vocab = model_vocabulary(loaded)
        params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
        times: dict[str, list[float]] = {"base": [], "this": []}
        same, different, skipped = 0, [], []
        for round_ in range(args.rounds):
            for n, (name, schema) in enumerate(schemas):
                compiled = {}
                for side, (compiler, constraints, _) in sides.items():
                    try:
                        grammar = constraints.json_schema_grammar(schema, label=name)
                        compiled[side] = compiler.compile_grammar(
                            grammar, vocab, timeout_s=10, cache=False
                        )
                    except QuantkitError as e:  # either side's refusal skips the schema
                        skipped.append(f"{name} ({side}: {str(e).splitlines()[0]})")
                        break
                if len(compiled) < 2:
                    continue
                prompt = encode_prompt(
                    loaded.tokenizer, default_schema_prompt(schema, max_schema_chars=1500)
                )
                tokens = {}
                for side in ("base", "this") if (n + round_) % 2 == 0 else ("this", "base"):
                    processor = sides[side][2].GrammarLogitsProcessor(
                        [compiled[side]], max_new_tokens=args.max_new_tokens, greedy=True
                    )
                    out = generate(loaded.model, [prompt], params, processors=[processor],
                                   eos_ids=eos, tokenizer=loaded.tokenizer,
                                   fast_forward=True)  # fmt: skip
                    tokens[side] = out.tokens[0]
                    times[side] += processor.mask_times_s[1:]
                if tokens["base"] == tokens["this"]:
                    same += 1
                else:
                    different.append(name)
            log(f"round {round_ + 1}/{args.rounds}: {same} same, {len(different)} different")
    stats = {side: _stats(t) for side, t in times.items()}
    return {
        "commit": git_commit(), "base": args.base, "model": desc, "schemas": len(schemas),
        "rounds": args.rounds, "generations_same": same, "generations_different": different,
        "skipped": sorted(set(skipped)), "per_step_us": stats,
    }  # fmt: skip


def _stats(times: list[float]) -> dict[str, float]:
    us = np.asarray(times) * 1e6
    if not us.size:
        return {"steps": 0, "mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    return {"steps": int(us.size), "mean": float(us.mean()), "median": float(np.median(us)),
            "p99": float(np.percentile(us, 99))}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    lines = [
        f"grammar per decode step, {report['base']} vs this checkout ({report['commit']}), "
        f"{report['schemas']} schemas x {report['rounds']} rounds, paired",  # fmt: skip
        "side       steps    mean us  median us    p99 us",
    ]
    for side, s in report["per_step_us"].items():
        name = report["base"] if side == "base" else "this"
        lines.append(f"{name[:10]:10s} {s['steps']:5d} {s['mean']:10.1f} {s['median']:10.1f} "
                     f"{s['p99']:9.1f}")  # fmt: skip
    n = report["generations_same"] + len(report["generations_different"])
    lines.append(f"same tokens: {report['generations_same']} of {n} generations"
                 + (f"; different: {', '.join(report['generations_different'])}"
                    if report["generations_different"] else ""))  # fmt: skip
    if report["skipped"]:
        lines.append(f"skipped (not compiled by a side): {len(report['skipped'])}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.grammar.paired")
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=1)
    add_schema_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.rounds < 1 or args.per_category < 1 or args.max_new_tokens < 1:
        raise EvalError(
            f"expected --rounds, --per-category and --max-new-tokens >= 1, got {args.rounds}, "
            f"{args.per_category} and {args.max_new_tokens}"
        )
    report = run(args)
    print_and_save(report, table(report), args.json)
    return 1 if report["generations_different"] else 0


if __name__ == "__main__":
    run_main(main)
