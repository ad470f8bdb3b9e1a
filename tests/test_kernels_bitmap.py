"""Bitmap kernels against their twins in tests/naive.py."""

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
