"""What a row can tell about one token without computing its mask (`verdict`), for greedy
decoding: the processor asks about the model's best tokens in turn and takes the first one
`ALLOWED`, skipping the mask (`processor.GrammarLogitsProcessor`, `greedy=True`).

- `ALLOWED`: the row's mask keeps the token, and would keep it were it the best token the mask
  keeps (the checks made on the masked logits pass for it).
- `REFUSED`: the mask leaves the token out, or the checks on the masked logits clear it where
  it is the best token the mask keeps, wherever another token is `ALLOWED` (a repeated key is
  let through only where nothing else is left, and the key screen never clears the last token
  allowed, so a refusal on those grounds holds once a token after it is allowed; a caller
  stops at the first `ALLOWED` token or asks the mask).
- `UNKNOWN`: not told for this one token (the mask decides).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["Verdict", "keeps"]


class Verdict(IntEnum):
    REFUSED = 0
    ALLOWED = 1
    UNKNOWN = 2


def keeps(line: np.ndarray, token: int) -> bool:
    """Whether the bitmask `line` (32-bit words, token t at bit t % 32 of word t // 32) keeps
    `token`: a verdict read off a mask made already."""
    return bool((int(line[token >> 5]) >> (token & 31)) & 1)
