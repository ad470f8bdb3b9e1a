"""The two facts every protocol module shares: the cache line, and the check
word that tells a whole line from a torn one.

A line is written word by word, and the cache may write it back between two
stores (an eviction), so a reader on another host can meet a mix of old and
new words.  A line that others read while it may be mid-update (a grant line,
an object record, an index entry) carries a check word over its other words,
stored last; a reader that finds it wrong treats the line as torn and reads
again later (R4) or reports it (R5).  Each mechanism seeds the word with its
own tag, so a line of one kind never passes for a line of another.

`tract._native._region` exports the same ``LINE`` and ``CHECK_PRIME`` /
``CHECK_ADD`` (from ``_cachectl.h``), and the Numba kernels use these;
tests/test_rules.py holds both sides to one value.
"""

from __future__ import annotations

__all__ = ["CHECK_ADD", "CHECK_PRIME", "LINE", "MASK64", "check_word"]

LINE = 64
MASK64 = 0xFFFF_FFFF_FFFF_FFFF
CHECK_PRIME = 0x100_0000_01B3
CHECK_ADD = 0x9E37_79B9_7F4A_7C15


def check_word(tag: int, words) -> int:
    """The check word of ``words`` (u64s) for a line of the kind ``tag``."""
    check = tag
    for word in words:
        check = ((check ^ int(word)) * CHECK_PRIME + CHECK_ADD) & MASK64
    return check
