"""DESIGN.md's layers, enforced: nothing imports upward.

cli -> evals, grammar -> quantkit runtime (L2) -> fused_kernels (L1) -> errors/scheme/packing (L0)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
L0 = {"quantkit.errors", "quantkit.scheme", "quantkit.packing", "quantkit"}
FOLDERS = {
    "cli": ("quantkit.cli", 4),
    "evals": ("quantkit.evals", 3),
    "grammar": ("quantkit.grammar", 3),
    "fused_kernels": ("quantkit.fused_kernels", 1),
}


def layer_of(module: str) -> int:
    for prefix, level in (pkg for pkg in FOLDERS.values()):
        if module == prefix or module.startswith(prefix + "."):
            return level
    if module in L0:
        return 0
    return 2  # the quantkit runtime


def _modules() -> list[tuple[str, Path]]:
    out = []
    for folder, (pkg, _) in {**FOLDERS, "quantkit": ("quantkit", 2)}.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((".".join([pkg, *parts]), path))
    return out


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return [n for n in names if n == "quantkit" or n.startswith("quantkit.")]


@pytest.mark.parametrize("module,path", _modules(), ids=lambda v: str(v))
def test_no_upward_imports(module: str, path: Path) -> None:
    own = layer_of(module)
    for target in _imports(path):
        # "from quantkit.x import name": judge by the module, not the imported attribute.
        level = layer_of(target) if target.count(".") <= 1 or _is_module(target) else None
        if level is None:
            level = layer_of(target.rsplit(".", 1)[0])
        assert level <= own, f"{module} (layer {own}) imports {target} (layer {level})"
        if own == 3:  # evals and grammar do not import each other
            assert not (
                module.startswith("quantkit.evals") and target.startswith("quantkit.grammar")
            )
            assert not (
                module.startswith("quantkit.grammar") and target.startswith("quantkit.evals")
            )


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[1] in {"cli", "evals", "grammar", "fused_kernels"}:
        folder = ROOT / {"fused_kernels": "fused_kernels"}.get(parts[1], parts[1])
        rest = parts[2:]
    else:
        folder, rest = ROOT / "quantkit", parts[1:]
    target = folder.joinpath(*rest)
    return target.with_suffix(".py").exists() or (target / "__init__.py").exists()


def test_layer_table_sanity() -> None:
    assert layer_of("quantkit.packing") == 0
    assert layer_of("quantkit.fused_kernels.dispatch") == 1
    assert layer_of("quantkit.model") == 2
    assert layer_of("quantkit.evals.perplexity") == 3
    assert layer_of("quantkit.cli.main") == 4


def test_l0_imports_nothing_above_itself() -> None:
    for name in ("errors", "scheme", "packing"):
        for target in _imports(ROOT / "quantkit" / f"{name}.py"):
            assert target in L0 or target.rsplit(".", 1)[0] in L0, f"{name} imports {target}"
