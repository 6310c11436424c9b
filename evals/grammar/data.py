"""JSONSchemaBench's data: categories, a fixed sample, and error classification."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError
from quantkit.paths import DATA_ENV, data_folder

__all__ = [
    "BENCH_ENV",
    "DATA_ENV",
    "BenchSchema",
    "add_schema_arguments",
    "category_of",
    "classify_error",
    "default_bench_dir",
    "sample_schemas",
    "schemas_asked",
]

BENCH_ENV = "QUANTKIT_JSONSCHEMABENCH"  # JSONSchemaBench's root folder itself

# Published compile coverage ("compliance") on GlaiveAI-2K, JSONSchemaBench paper, table 3.
PUBLISHED_GLAIVE = {"Outlines": 0.96, "XGrammar": 0.93, "Guidance": 0.98}


def default_bench_dir() -> Path:
    """$QUANTKIT_JSONSCHEMABENCH, else $QUANTKIT_DATA/jsonschemabench; EvalError when neither is
    set (there is no default: pass --data to the bench modules or set one of the two)."""
    folder = data_folder("jsonschemabench", env=BENCH_ENV)
    if folder is not None:
        return folder
    raise EvalError(
        f"no JSONSchemaBench data: pass --data DIR or set {BENCH_ENV}=DIR (a folder holding "
        f"maskbench/data/*.json), or set {DATA_ENV} to a folder holding jsonschemabench/"
    )


def category_of(name: str) -> str:
    """`Github_easy---foo.json` -> Github_easy; `BFCL_simple_3.json` -> BFCL; `JME_7` -> JME."""
    if "---" in name:
        return name.split("---", 1)[0]
    return re.split(r"[_.]", name, maxsplit=1)[0]


@dataclass(frozen=True)
class BenchSchema:
    name: str
    category: str
    schema: Any
    tests: list[dict[str, Any]]


def sample_schemas(
    folder: Path,
    *,
    per_category: int = 15,
    limit: int | None = None,
    categories: Sequence[str] | None = None,
) -> list[BenchSchema]:
    """A fixed sample: per category (all, or those in `categories`), `per_category` files evenly
    spaced in sorted name order (the same files on every run), interleaved across categories;
    the first `limit` of them."""
    files = sorted((folder / "maskbench" / "data").glob("*.json"))
    by_category: dict[str, list[Path]] = defaultdict(list)
    for path in files:
        category = category_of(path.name)
        if categories is None or category in categories:
            by_category[category].append(path)
    if not by_category:
        return []
    picked: list[list[Path]] = []
    for category in sorted(by_category):
        paths = by_category[category]
        k = min(per_category, len(paths))
        picked.append([paths[(i * len(paths)) // k] for i in range(k)])
    order = [p for round_ in zip(*[_pad(c, per_category) for c in picked], strict=True) for p in
             round_ if p is not None]  # fmt: skip
    if limit is not None:
        order = order[:limit]
    out = []
    for path in order:
        data = json.loads(path.read_text(encoding="utf-8"))
        out.append(
            BenchSchema(path.name, category_of(path.name), data["schema"], data.get("tests", []))
        )
    return out


def _pad(paths: list[Path], n: int) -> list[Path | None]:
    return [*paths, *[None] * (n - len(paths))]


def classify_error(message: str) -> str:
    """A short cause for a GrammarError message, for the coverage table."""
    keyword = re.search(r"keyword '([^']+)'", message)
    if keyword:
        return f"unsupported: {keyword.group(1)}"
    keys = re.search(r'Unimplemented keys: \["([^"]+)"', message)  # llguidance's wording
    if keys:
        return f"unsupported: {keys.group(1)}"
    if "oneOf constraints are not supported" in message:
        return "oneOf (not provably exclusive)"
    if "Unknown format" in message:
        return "unknown format"
    for needle, kind in (("phase: lowering", "lowering timeout"), ("phase: cache load",
                         "cache load timeout")):  # fmt: skip
        if needle in message:
            return kind
    for needle, kind in (
        ("longer than the limit", "compile timeout"),
        ("of memory", "compile memory"),
        ("expected a valid JSON Schema", "invalid schema"),
        ("external $ref", "external $ref"),
        ("allOf", "allOf combination"),
        ("pattern", "pattern"),
        ("no JSON value satisfies", "unsatisfiable"),
        ("regex of at most", "regex too large"),
        ("subschemas once $refs are inlined", "too many inlined $refs"),
        ("outlines-core cannot compile", "outlines-core rejected"),
    ):
        if needle in message:
            return kind
    return "other"


def add_schema_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a run over schemas on a model: the sample's folder and size, or schema
    files; the token limit, the model, the JSON report (`schemas_asked` reads the first)."""
    parser.add_argument("--data", type=Path, default=None, help="JSONSchemaBench root folder")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--schema", action="append", default=None,
                        help="a JSON schema file instead of the sample (repeatable)")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--model", default=None, help="default: the embedded model as INT4")
    parser.add_argument("--json", type=Path, default=None)


def schemas_asked(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, schema) of each `--schema` file, else of the sample (`--data`, or the default
    folder; `--per-category`); EvalError for a file that is not JSON or a missing folder."""
    if args.schema:
        found = []
        for name in args.schema:
            try:
                found.append((Path(name).name, json.loads(Path(name).read_text())))
            except (OSError, json.JSONDecodeError) as e:
                raise EvalError(f"--schema {name}: expected JSON, got {e}") from e
        return found
    folder = args.data or default_bench_dir()
    if not (folder / "maskbench" / "data").is_dir():
        raise EvalError(f"expected JSONSchemaBench at {folder}, found nothing")
    return [(i.name, i.schema) for i in sample_schemas(folder, per_category=args.per_category)]
