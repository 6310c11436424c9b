"""One sequence's outlines-core Guide behind the row interface the processor drives.

Both engines' rows answer the same four questions: advance by a token (False when the grammar
does not allow it), fill this step's allowed-token bitmask (int32 words, bit t % 32 of word
t // 32, the same layout for both), is the grammar complete here, and which tokens it forces
next (outlines-core: none are computed, so its rows are never fast-forwarded).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantkit.grammar.vocabulary import import_outlines_core

__all__ = ["OutlinesRow"]


class OutlinesRow:
    engine = "outlines"

    def __init__(self, index: Any) -> None:
        self.guide = import_outlines_core().Guide(index)

    def advance(self, token: int) -> bool:
        try:
            self.guide.advance(int(token), return_tokens=False)
        except ValueError:
            return False
        return True

    def fill(self, line: np.ndarray) -> None:
        self.guide.write_mask_into(line.ctypes.data, line.shape[0], 4)

    def is_finished(self) -> bool:
        return bool(self.guide.is_finished())

    def forced_tokens(self) -> list[int]:
        return []
