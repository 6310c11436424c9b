"""Bad model input fails in one line naming what was wrong, with a non-zero exit: an
unsupported model_type (listing the supported ones), an unsupported rope_type, a config
missing a required field, and family options quantkit does not implement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.errors import ModelSourceError
from quantkit.models.config import ModelConfig
from tests.conftest import TINY_LLAMA, run_cli


def _one_error_line(capsys, model: Path, tmp_path: Path) -> str:
    code, _, err = run_cli(
        capsys, "quantize", str(model), "--method", "rtn", "-o", str(tmp_path / "q")
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error:"), err
    return lines[0]


@pytest.mark.parametrize(
    "change,wanted",
    [
        ({"model_type": "olmoe"}, "expected model_type one of llama, mistral, qwen2, qwen3, "
         "phi3, gemma2, gemma3_text, mixtral, qwen3_moe (SmolLM is llama), got 'olmoe'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
         "config.json rope_scaling.rope_type: expected one of default, linear, llama3, "
         "got 'yarn'"),
        ({"num_attention_heads": None}, "config.json num_attention_heads: expected a positive "
         "integer, got None (field missing)"),
    ],
    ids=["model_type", "rope_type", "missing_field"],
)  # fmt: skip
def test_cli_says_what_is_wrong_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, capsys, change: dict, wanted: str
) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_model_dir.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    assert wanted in _one_error_line(capsys, bad, tmp_path)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
         "rope_parameters.low_freq_factor"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_parameters.rope_type"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "relu"}, "hidden_act"),
        ({"layer_types": ["chunked_attention"] * 2}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 2, "sliding_window": None}, "sliding_window"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
    ids=["llama3-field", "longrope", "partial-rotary", "activation", "layer-type", "window",
         "vocab"],
)  # fmt: skip
def test_unimplemented_options_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ModelSourceError, match=f"config.json {field}: expected"):
        ModelConfig.from_dict({**TINY_LLAMA, **change})
