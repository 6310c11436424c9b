"""The llm-compressor comparison's --peer-ckpt: a checkpoint the peer wrote earlier is named
by its recipe, and what cannot be one is refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from quantkit.evals.studies.int4_llmcompressor import _peer_ckpts


def test_a_peer_checkpoint_is_taken_by_its_recipe(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert _peer_ckpts([f"awq+gptq={tmp_path}"]) == {"awq+gptq": tmp_path}


@pytest.mark.parametrize("given", ["awq={}", "awq+gptq", "gptq={}/missing"])
def test_what_is_not_a_peer_checkpoint_is_refused(tmp_path: Path, given: str) -> None:
    with pytest.raises(SystemExit, match="expected"):
        _peer_ckpts([given.format(tmp_path)])
