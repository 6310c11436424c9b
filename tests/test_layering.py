"""The layers of ARCHITECTURE.md, enforced: each package imports only what its rule allows.

    cli -> evals -> http_api -> grammar -> batching, perf -> quantize
        -> runtime -> fused_kernels -> sources, export -> models -> format -> paths, cpu -> errors
    (cache_manifest, beside paths: the damage check of cached model directories; it imports
    nothing of quantkit, and sources and everything above it may import it)

Read an arrow as "may import". A package may import itself and everything its rule lists;
anything else, in particular anything above it, fails this test with the offending line.

Inside a package: no two modules import each other in a circle (every import counts, those
under `if TYPE_CHECKING:` and inside functions too), each sub-package keeps to its rule in
SUBRULES, and no CLI command imports another command's private names.
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

_CORE = ("errors", "paths", "cache_manifest", "cpu", "format", "models", "sources", "export")
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
    # Writing other engines' files: the twin of sources, beside it.
    "export": frozenset({"errors", "paths", "cache_manifest", "format", "models"}),
    "fused_kernels": frozenset({"errors", "paths", "cpu", "format"}),
    "runtime": frozenset({*_CORE, "fused_kernels"}),
    "quantize": frozenset({*_CORE, "fused_kernels", "runtime"}),
    "perf": frozenset({*_CORE, "fused_kernels", "runtime"}),
    "batching": frozenset({*_CORE, "fused_kernels", "runtime", "perf"}),
    # The core never imports grammar (generate takes any LogitsProcessor).
    "grammar": frozenset({*_CORE, "fused_kernels", "runtime", "quantize", "perf", "batching"}),
    # The HTTP server: the serving engine plus grammar for `response_format`.
    "http_api": frozenset(
        {*_CORE, "fused_kernels", "runtime", "quantize", "perf", "batching", "grammar"}
    ),
    # evals measures everything below the CLI: grammar (evals/grammar/) and the HTTP layer
    # (evals/speed/http_load replays a workload against a running server) included.
    "evals": frozenset(
        {
            *_CORE,
            *("fused_kernels", "runtime", "quantize", "perf", "batching", "grammar"),
            "http_api",
        }
    ),
    "cli": frozenset(
        {
            *_CORE,
            *("fused_kernels", "runtime", "quantize", "perf", "batching", "grammar", "evals"),
            "http_api",
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
        ("quantkit.models.decoder", "import quantkit.batching.engine", 1),
        ("quantkit.fused_kernels.dispatch", "from quantkit.runtime import fast_path", 1),
        ("quantkit.runtime.loader", "from quantkit.quantize.awq import awq_quantize", 1),
        ("quantkit.perf.roofline", "from quantkit.batching.types import DecodeStep", 1),
        ("quantkit.grammar.compiler", "from quantkit.evals.accuracy.harness import x", 1),
        ("quantkit.evals.accuracy.harness", "from quantkit.cli.options import load", 1),
        ("quantkit.http_api.app", "from quantkit.evals.common import git_commit", 1),
        ("quantkit.runtime.generate", "from quantkit.nowhere import x", 1),
        # allowed: downward, sideways into itself, the version
        ("quantkit.runtime.loader", "from quantkit.format.checkpoint import load_checkpoint", 0),
        ("quantkit.batching.metrics", "from quantkit.perf.roofline import DecodeRoofline", 0),
        ("quantkit.cli.main", "from quantkit import __version__", 0),
        ("quantkit.quantize.awq", "from quantkit.quantize.rtn import rtn_quantize_weight", 0),
    ],
)
def test_the_rules_catch_a_bad_import(module: str, source: str, expected: int) -> None:
    assert len(violations(module, source)) == expected


# --- inside a package: no cycles between modules, and one rule per sub-package ---------------


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, every import counted: at module top, inside a
    function, under `if TYPE_CHECKING:`. "from quantkit.a import b" is an edge to quantkit.a.b
    when that is a module, and to quantkit.a (its __init__) either way."""
    known = dict(_modules())
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                edges.add(node.module)
                edges |= {f"{node.module}.{a.name}" for a in node.names}
        graph[module] = {e for e in edges if e in known and e != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules() -> None:
    # A package's __init__ that re-exports its modules would close a cycle with each of them;
    # the project's __init__ files import nothing of it, so every edge counts.
    assert cycles(_graph()) == []


def test_the_cycle_check_sees_a_type_checking_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from quantkit.x import y\n"
    assert imports_of(source) == [(3, "quantkit.x")]


# Sub-packages: module prefix -> the modules (or sub-packages, by prefix) of its own package that
# it may import besides itself. Backends sit under the shared types; engines under the front.
_FK = "quantkit.fused_kernels"
_GR = "quantkit.grammar"
SUBRULES: dict[str, tuple[str, ...]] = {
    # fused_kernels: a backend imports the shared value types and checks, never another
    # backend or the registry that chooses between them (it looks backends up lazily).
    f"{_FK}.reference": (f"{_FK}.packed_weights", f"{_FK}.checks"),
    f"{_FK}.triton": (f"{_FK}.packed_weights", f"{_FK}.checks"),
    f"{_FK}.cpu": (f"{_FK}.packed_weights", f"{_FK}.checks"),
    # grammar: an engine imports the front's value modules (a row's `verdict` answers in the
    # front's `Verdict`), never the compiler or processor that pick engines, and never the
    # other engine.
    f"{_GR}.llguidance": (
        f"{_GR}.constraints",
        f"{_GR}.vocabulary",
        f"{_GR}.narrowing",
        f"{_GR}.native_threads",
        f"{_GR}.verdict",
    ),
    f"{_GR}.outlines": (f"{_GR}.constraints", f"{_GR}.vocabulary"),
    # the schema-to-regex lowering is a pure function of the schema: it needs the vocabulary's
    # whitespace rule and nothing else of grammar.
    f"{_GR}.outlines.schema_regex": (f"{_GR}.vocabulary",),
    # evals: each area stands alone on the shared helpers; the speed benchmarks may reuse the
    # kernel benchmark's timers and the accuracy library (perplexity), nothing else of evals.
    "quantkit.evals.accuracy": ("quantkit.evals.common",),
    "quantkit.evals.speed": ("quantkit.evals.common", "quantkit.evals.kernels"),
    "quantkit.evals.kernels": ("quantkit.evals.common",),
    "quantkit.evals.grammar": ("quantkit.evals.common",),
    "quantkit.evals.peers": ("quantkit.evals.common",),
    "quantkit.evals.studies": ("quantkit.evals.common", "quantkit.evals.accuracy"),
}


def _subrule_of(module: str) -> tuple[str, tuple[str, ...]] | None:
    """The most specific SUBRULES entry that `module` is in, if any."""
    best = None
    for prefix, allowed in SUBRULES.items():
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best[0])
        ):
            best = (prefix, allowed)
    return best


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def sub_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        rule = _subrule_of(module)
        if rule is None:
            continue
        prefix, allowed = rule
        package = ".".join(prefix.split(".")[:2])  # the top-level package: quantkit.grammar
        for target in sorted(targets):
            if not target.startswith(package + ".") or _within(target, (prefix,)):
                continue  # another package (the layer rule's business) or itself
            if _within(target, allowed) or target in _parents(prefix):
                continue
            bad.append(f"{module} imports {target}: {prefix} may import only {allowed}")
    return bad


def _parents(prefix: str) -> set[str]:
    """The package __init__ modules above `prefix` (importing a sub-module runs them)."""
    parts = prefix.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def test_every_sub_package_has_a_rule() -> None:
    packages = {m for m, path in _modules() if path.name == "__init__.py" and m.count(".") >= 2}
    assert packages <= set(SUBRULES), sorted(packages - set(SUBRULES))


def test_sub_packages_keep_their_rules() -> None:
    assert sub_violations(_graph()) == []


def test_the_sub_rules_catch_a_bad_import() -> None:
    graph = {
        f"{_FK}.cpu.w4a16": {f"{_FK}.triton.launch", f"{_FK}.checks", "quantkit.errors"},
        f"{_GR}.llguidance.engine": {f"{_GR}.compiler", f"{_GR}.constraints"},
        f"{_GR}.outlines.schema_regex.objects": {f"{_GR}.outlines.lowering"},
    }
    assert len(sub_violations(graph)) == 3


def private_imports(module: str, source: str) -> list[str]:
    """`from quantkit.cli.X import _name` in a CLI module other than X: a command borrowing
    another command's internals instead of a shared module."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quantkit.cli."):
            if node.module == module:
                continue
            bad += [
                f"{module}:{node.lineno} imports {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_")
            ]
    return bad


def test_no_command_imports_another_commands_private_names() -> None:
    found = [
        line
        for module, path in _modules()
        if module.startswith("quantkit.cli.")
        for line in private_imports(module, path.read_text())
    ]
    assert found == []
    example = "from quantkit.cli.generate_cmd import _load, generate_cmd"
    assert private_imports("quantkit.cli.bench_cmd", example) == [
        "quantkit.cli.bench_cmd:1 imports quantkit.cli.generate_cmd._load"
    ]
