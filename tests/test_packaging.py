"""The wheel holds every package of the source tree.

An editable install maps `quantkit` to its folder, so a subpackage missing from
`[tool.setuptools] packages` still imports in development and in CI, and only a real install
(`pip install .`, a wheel) lacks it: `quantkit.export` was missing that way, and every CLI
command failed on import there.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_packages(config: dict) -> set[str]:
    """Every folder with an __init__.py under each mapped package directory, as dotted names."""
    found = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_source_package_is_in_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = _source_packages(config)
    assert found - listed == set(), "packages missing from [tool.setuptools] packages"
    assert listed - found == set(), "listed packages with no folder"
