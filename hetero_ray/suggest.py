"""'Did you mean …?' for a name that is not one of the known ones (a GPU type, a key, an optimizer, a schedule).

Below every other module (it imports nothing of hetero-ray), so each error message can use it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: object, known: Iterable[str]) -> str:
    """``" (did you mean 'A100-80GB'?)"`` for the known names closest to ``name``, or ``""`` when none is close.

    Case is ignored (``a100-80gb`` finds ``A100-80GB``). Names that ``name`` begins come first (``A100`` finds
    ``A100-40GB``, where difflib alone prefers the shorter ``A10``); then difflib's, at its default cutoff (0.6).
    """
    by_lower = {k.lower(): k for k in known}
    typed = str(name).lower()
    prefixed = sorted(k for k in by_lower if typed and k.startswith(typed))
    close = list(dict.fromkeys([*prefixed, *difflib.get_close_matches(typed, list(by_lower), n=2)]))[:2]
    if not close:
        return ""
    return f" (did you mean {' or '.join(repr(by_lower[c]) for c in close)}?)"
