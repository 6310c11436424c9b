"""The tokenizer of a model directory (transformers, imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.errors import CheckpointError

# Either is enough for transformers to build a fast tokenizer without network access.
TOKENIZER_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(model_dir: Path) -> Any:
    """The transformers tokenizer saved in `model_dir` (chat template and special tokens too)."""
    model_dir = Path(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise CheckpointError(
            f"tokenizer files missing in {model_dir}; expected tokenizer.json or tokenizer.model, "
            f"found neither"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise CheckpointError(
            f"tokenizer in {model_dir}: expected a loadable tokenizer, got "
            f"{type(e).__name__}: {str(e)[:200]}"
        ) from e
