"""Bitmap kernels against their twins in tests/naive.py: on random
bitmaps, on bitmaps built from whole full, empty and edge words, and on
edges drawn on purpose (runs across a word or a 512-bit line, from a word's
or a line's last bit, a full word right after a free bit, a full bitmap, one
free bit at its very end), each through the wrapper and through the C
address the native allocator calls."""

import ctypes
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import naive
from tract._kernels import bitmap


@st.composite
def bitmaps(draw):
    nbits = draw(st.integers(1, 700))
    density = draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = rng.random(nbits) < density
    words = np.zeros((nbits + 63) // 64, dtype=np.uint64)
    for index in np.flatnonzero(bits):
        words[index // 64] |= np.uint64(1) << np.uint64(index % 64)
    if draw(st.booleans()) and nbits % 64:  # garbage past nbits must not count
        words[-1] |= ~np.uint64(0) << np.uint64(nbits % 64)
    return words, nbits


@settings(max_examples=300, deadline=None)
@given(bitmaps(), st.integers(1, 80), st.integers(0, 10**6))
def test_kernels_match_the_twins(case, count, start):
    words, nbits = case
    start %= nbits
    assert bitmap.count_free(words, nbits) == naive.count_free(words, nbits)
    assert (bitmap.first_free_run(words, nbits, count, start)
            == naive.first_free_run(words, nbits, count, start))


FULL = 2**64 - 1
LINE_BITS = 512  # one 64-byte line of the bitmap


def _scan():
    """`first_free_run` as the native allocator calls it, through its address."""
    scan = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64,
                            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(
        bitmap.first_free_run_address())

    def call(words, nbits, count, start):
        return scan(words.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)), words.size, nbits,
                    count, start)
    return call


def _held_to_the_twins(scan, words, nbits, count, start):
    """The run (by the wrapper and by address) and the free count, each
    equal to its twin's; returns the run."""
    want = naive.first_free_run(words, nbits, count, start)
    assert bitmap.first_free_run(words, nbits, count, start) == want, (nbits, count, start)
    assert scan(words, nbits, count, start) == want, (nbits, count, start)
    assert bitmap.count_free(words, nbits) == naive.count_free(words, nbits), nbits
    return want


def _with_free(nbits, *runs):
    """A bitmap of ``nbits`` all taken (and taken past ``nbits``) but for
    ``runs``, (first, length) each."""
    words = np.full(-(-nbits // 64), FULL, dtype=np.uint64)
    for first, length in runs:
        for index in range(first, first + length):
            words[index // 64] &= ~np.uint64(1 << index % 64)
    return words


# (name, nbits, free runs, count, start, the run found)
EDGES = [
    ("a run across a word boundary", 256, [(60, 8)], 8, 0, 60),
    ("a run across a line boundary", 1024, [(508, 8)], 8, 0, 508),
    ("a run from a word's last bit", 256, [(63, 3)], 3, 0, 63),
    ("one free bit, a word's last", 256, [(63, 1)], 1, 0, 63),
    ("a run from a line's last bit", 1024, [(511, 9)], 9, 0, 511),
    ("one free bit, a line's last", 1024, [(511, 1)], 1, 0, 511),
    ("a full word right after a free bit", 256, [(63, 1), (128, 12)], 2, 0, 128),
    ("a full line right after a free bit", 1100, [(511, 1), (1024, 4)], 2, 0, 1024),
    ("free bits either side of a full word", 256, [(60, 4), (128, 4)], 8, 0, -1),
    ("a run from a word's first bit after a full word", 256, [(10, 1), (128, 5)], 5, 0, 128),
    ("a fully used bitmap", 1024, [], 1, 0, -1),
    ("a fully used bitmap, from its end", 1000, [], 1, 999, -1),
    ("one free bit at the very end", 1024, [(1023, 1)], 1, 0, 1023),
    ("one free bit at the very end, of a partial word", 1000, [(999, 1)], 1, 500, 999),
    ("one free bit at the very end, two wanted", 1024, [(1023, 1)], 2, 0, -1),
    ("a run that ends at the bitmap's end", 1000, [(990, 10)], 10, 995, 990),
    ("a run that would wrap", 256, [(0, 3), (254, 2)], 5, 254, -1),
    ("a run at the start, found by wrapping", 256, [(0, 3), (254, 1)], 3, 255, 0),
    ("a run straddling the start", 1024, [(500, 20)], 20, 510, 500),
    ("the whole bitmap free", 576, [(0, 576)], 576, 0, 0),
    ("more than the bitmap", 576, [(0, 576)], 577, 0, -1),
    ("one bit", 1, [(0, 1)], 1, 0, 0),
    ("no bits", 0, [], 1, 0, -1),
]


@pytest.mark.parametrize("nbits, runs, count, start, first", [edge[1:] for edge in EDGES],
                         ids=[edge[0] for edge in EDGES])
def test_drawn_edges_match_the_twins(nbits, runs, count, start, first):
    words = _with_free(max(nbits, 1), *runs)
    assert _held_to_the_twins(_scan(), words, nbits, count, start) == first


def _random_words(rng, nbits):
    """Words drawn whole: full, empty, sparse, dense, or with only their
    first or last bits free (runs that meet at a word or line boundary)."""
    words = []
    for _ in range(-(-nbits // 64)):
        kind = rng.randrange(6)
        if kind == 0:
            words.append(FULL)
        elif kind == 1:
            words.append(0)
        elif kind == 2:
            words.append(rng.getrandbits(64) & rng.getrandbits(64))
        elif kind == 3:
            words.append(rng.getrandbits(64) | rng.getrandbits(64))
        elif kind == 4:
            words.append(FULL << rng.randint(1, 8) & FULL)  # low bits free
        else:
            words.append(FULL >> rng.randint(1, 8))  # high bits free
    return np.array(words, dtype=np.uint64)


def test_whole_word_bitmaps_match_the_twins():
    rng, scan = random.Random(12), _scan()
    for _ in range(600):
        nbits = rng.choice([64, 512, 576, 1024, rng.randint(1, 1100), rng.randint(1, 1100)])
        words = _random_words(rng, nbits)
        count = rng.choice([1, 2, 3, 8, 63, 64, 65, rng.randint(1, 200)])
        start = rng.choice([0, nbits - 1, rng.randrange(nbits), rng.randrange(nbits) // 64 * 64,
                            rng.randrange(nbits) // LINE_BITS * LINE_BITS - 1])
        _held_to_the_twins(scan, words, nbits, count, max(start, 0))


def test_inputs_are_checked():
    words = np.zeros(2, dtype=np.uint64)
    with pytest.raises(TypeError, match="1-d uint64"):
        bitmap.count_free(words.astype(np.int64), 10)
    with pytest.raises(ValueError, match="nbits 200 is outside 0..128"):
        bitmap.count_free(words, 200)
    with pytest.raises(ValueError, match="run length 0"):
        bitmap.first_free_run(words, 128, 0)
    with pytest.raises(ValueError, match="start 128 is outside"):
        bitmap.first_free_run(words, 128, 1, 128)
