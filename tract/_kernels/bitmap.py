"""Chunk-bitmap scans for the allocator (`tract.alloc`).

A bitmap is a uint64 array; bit ``i`` (word ``i // 64``, bit ``i % 64``) is
chunk ``i``, set when the chunk is allocated.  Only the first ``nbits`` bits
count.  Twins: ``tests/naive.py`` (``first_free_run``, ``count_free``).
"""

import functools

import numba
import numpy as np

from tract._kernels.config import c_kernel, kernel

__all__ = ["count_free", "first_free_run", "first_free_run_address"]


@kernel
def _count_free(words, nbits):
    free = np.int64(0)
    full = nbits // 64
    for index in range(full):
        word = words[index]
        # popcount of the clear bits, by SWAR (no intrinsic needed)
        x = ~word
        x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
        x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
        x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        free += np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))
    for bit in range(full * 64, nbits):
        if not (words[bit // 64] >> np.uint64(bit % 64)) & np.uint64(1):
            free += 1
    return free


@kernel
def _first_free_run(words, nbits, count, start):
    """First run of ``count`` clear bits starting at or after ``start``,
    wrapping once to the beginning; -1 if there is none.  A run never wraps."""
    for begin, end in ((start, nbits), (0, min(start + count - 1, nbits))):
        run = 0
        bit = begin
        while bit < end:
            word = words[bit // 64]
            if run == 0 and bit % 64 == 0 and word == np.uint64(0xFFFFFFFFFFFFFFFF):
                bit += 64  # a full word: skip it whole
                continue
            if (word >> np.uint64(bit % 64)) & np.uint64(1):
                run = 0
            else:
                run += 1
                if run == count:
                    return bit - count + 1
            bit += 1
    return -1


@functools.cache
def first_free_run_address() -> int:
    """Address of ``_first_free_run`` as a C function ``int64 (const uint64
    *words, int64 nwords, int64 nbits, int64 count, int64 start)``, for
    native callers that scan a bitmap in place (`tract._native._allocfast`);
    compiled (or loaded from the cache) on first use."""
    types = numba.types

    @c_kernel(types.int64(types.CPointer(types.uint64), types.int64, types.int64, types.int64,
                          types.int64))
    def scan(words, nwords, nbits, count, start):
        return _first_free_run(numba.carray(words, nwords), nbits, count, start)

    return scan.address


def _check(words: np.ndarray, nbits: int) -> None:
    if not isinstance(words, np.ndarray) or words.dtype != np.uint64 or words.ndim != 1:
        raise TypeError(f"bitmap must be a 1-d uint64 array, got {type(words).__name__} "
                        f"{getattr(words, 'dtype', '')}")
    if not 0 <= nbits <= words.size * 64:
        raise ValueError(f"nbits {nbits} is outside 0..{words.size * 64} for {words.size} words")


def count_free(words: np.ndarray, nbits: int) -> int:
    """Clear bits among the first ``nbits``."""
    _check(words, nbits)
    return int(_count_free(words, nbits))


def first_free_run(words: np.ndarray, nbits: int, count: int, start: int = 0) -> int:
    """Index of the first run of ``count`` clear bits at or after ``start``
    (then from 0), or -1."""
    _check(words, nbits)
    if count < 1:
        raise ValueError(f"run length {count} must be at least 1")
    if not 0 <= start < max(nbits, 1):
        raise ValueError(f"start {start} is outside 0..{nbits - 1}")
    return int(_first_free_run(words, nbits, count, start))
