"""Parsers that turn model output text into OpenAI tool calls and reasoning content.

`tools` holds the tool-call formats, `reasoning` the thinking-section formats; both
parse a complete output or stream it incrementally with identical results.
"""

from __future__ import annotations

from collections.abc import Iterable


def held_back(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`.

    A streaming parser holds that much text back: it may be the start of a marker.
    """
    longest = 0
    for marker in markers:
        # Longest first, and only sizes that would beat the best found so far.
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
