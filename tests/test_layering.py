"""The layers of ARCHITECTURE.md, enforced: each package imports only what its rule allows.

    cli -> server -> grammar; cli -> evals; grammar, evals -> serving, perf -> quantize
        -> runtime -> fused_kernels -> sources -> models -> format -> paths, cpu -> errors
    (cache_manifest, beside paths: the damage check of cached model directories; it imports
    nothing of quantkit, and sources and everything above it may import it)

Read an arrow as "may import". A package may import itself and everything its rule lists;
anything else, in particular anything above it, fails this test with the offending line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The installed name of each top-level folder (pyproject.toml's package-dir table).
FOLDERS = {
    "quantkit": "quantkit",
    "fused_kernels": "quantkit.fused_kernels",
    "grammar": "quantkit.grammar",
    "evals": "quantkit.evals",
    "cli": "quantkit.cli",
}

_CORE = ("errors", "paths", "cache_manifest", "cpu", "format", "models", "sources")
# package (under quantkit.) -> the packages it may import besides itself.
RULES: dict[str, frozenset[str]] = {
    "": frozenset(),  # quantkit/__init__.py: the version, nothing else
    "errors": frozenset(),
    "paths": frozenset({"errors"}),
    "cache_manifest": frozenset(),
    "cpu": frozenset(),
    "format": frozenset({"errors", "paths"}),
    "models": frozenset({"errors", "paths", "format"}),
    "sources": frozenset({"errors", "paths", "cache_manifest", "format", "models"}),
    "fused_kernels": frozenset({"errors", "paths", "cpu", "format"}),
    "runtime": frozenset({*_CORE, "fused_kernels"}),
    "quantize": frozenset({*_CORE, "fused_kernels", "runtime"}),
    "perf": frozenset({*_CORE, "fused_kernels", "runtime"}),
    "serving": frozenset({*_CORE, "fused_kernels", "runtime", "perf"}),
    # The core never imports grammar (generate takes any LogitsProcessor); evals and grammar
    # stand side by side and do not import each other.
    "grammar": frozenset({*_CORE, "fused_kernels", "runtime", "quantize", "perf", "serving"}),
    "evals": frozenset({*_CORE, "fused_kernels", "runtime", "quantize", "perf", "serving"}),
    # The HTTP server: the serving engine plus grammar for `response_format`.
    "server": frozenset(
        {*_CORE, "fused_kernels", "runtime", "quantize", "perf", "serving", "grammar"}
    ),
    "cli": frozenset(
        {
            *_CORE,
            *("fused_kernels", "runtime", "quantize", "perf", "serving", "grammar", "evals"),
            "server",
        }
    ),
}


def package_of(module: str) -> str:
    """'quantkit.runtime.loader' -> 'runtime'; 'quantkit' -> ''."""
    parts = module.split(".")
    assert parts[0] == "quantkit", module
    return parts[1] if len(parts) > 1 else ""


def _modules() -> list[tuple[str, Path]]:
    out = []
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((".".join([pkg, *parts]), path))
    return out


def imports_of(source: str) -> list[tuple[int, str]]:
    """(line, module) for every quantkit import in `source` ("from quantkit.x import y" counts
    as quantkit.x: the package rule does not care which attribute is taken)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "quantkit":  # from quantkit import runtime
                out += [(node.lineno, f"quantkit.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return [(line, n) for line, n in out if n == "quantkit" or n.startswith("quantkit.")]


def violations(module: str, source: str) -> list[str]:
    own = package_of(module)
    allowed = RULES[own] | {own}
    bad = []
    for line, target in imports_of(source):
        if target == "quantkit" or target == "quantkit.__version__":
            continue
        theirs = package_of(target)
        if theirs not in RULES:
            bad.append(f"{module}:{line} imports {target}, which is in no layer")
        elif theirs not in allowed:
            bad.append(
                f"{module}:{line} imports {target}: {own or 'quantkit'} may import only "
                f"{', '.join(sorted(RULES[own])) or 'nothing'}"
            )
    return bad


def test_every_package_has_a_rule() -> None:
    packages = {package_of(m) for m, _ in _modules()}
    assert packages <= set(RULES), sorted(packages - set(RULES))
    # Every sub-package of quantkit/ on disk is in the table, including ones with one module.
    on_disk = {p.name for p in (ROOT / "quantkit").iterdir() if (p / "__init__.py").exists()}
    on_disk |= {p.stem for p in (ROOT / "quantkit").glob("*.py") if p.stem != "__init__"}
    assert on_disk <= set(RULES), sorted(on_disk - set(RULES))


@pytest.mark.parametrize("module,path", _modules(), ids=lambda v: str(v))
def test_no_forbidden_imports(module: str, path: Path) -> None:
    assert violations(module, path.read_text()) == []


@pytest.mark.parametrize(
    "module,source,expected",
    [
        # a lower package reaching up: format must not know the runtime
        ("quantkit.format.checkpoint", "from quantkit.runtime.quant_linear import Q", 1),
        ("quantkit.models.decoder", "import quantkit.serving.engine", 1),
        ("quantkit.fused_kernels.dispatch", "from quantkit.runtime import fast_path", 1),
        ("quantkit.runtime.loader", "from quantkit.quantize.awq import awq_quantize", 1),
        ("quantkit.perf.roofline", "from quantkit.serving.types import DecodeStep", 1),
        ("quantkit.grammar.compiler", "from quantkit.evals.harness import x", 1),
        ("quantkit.evals.harness", "from quantkit import grammar", 1),
        ("quantkit.runtime.generate", "from quantkit.nowhere import x", 1),
        # allowed: downward, sideways into itself, the version
        ("quantkit.runtime.loader", "from quantkit.format.checkpoint import load_checkpoint", 0),
        ("quantkit.serving.metrics", "from quantkit.perf.roofline import DecodeRoofline", 0),
        ("quantkit.cli.main", "from quantkit import __version__", 0),
        ("quantkit.quantize.awq", "from quantkit.quantize.rtn import rtn_quantize_weight", 0),
    ],
)
def test_the_rules_catch_a_bad_import(module: str, source: str, expected: int) -> None:
    assert len(violations(module, source)) == expected
