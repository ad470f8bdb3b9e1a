"""Chained block hashes: the keys of the prefix index (DESIGN.md §3).

A prompt is cut into blocks of ``block_size`` tokens (a partial trailing
block is not hashed) and block ``i`` hashes to 128 bits that depend on every
token before it: ``h_i = H(key, h_{i-1}, tokens_i)``.  The same prefix gives
the same hashes on every host of the rack, so a block any host computed is
found by any other.

Modes (`BlockHasher`):

``keyed`` (default)
    SipHash-1-3-128 keyed by the pool's random hash key: a PRF, so a tenant
    who does not know the key cannot craft a prompt whose blocks collide
    with another tenant's (the reason vLLM moved to SHA-256).
``fast``
    XXH3-128 seeded from the key, bit-exact with the ``xxhash`` package; not
    a PRF, for trusted single-tenant pools.

The namespace (model, dtype, layout... fingerprint) and any tenant salt
enter the first block through the chain's root, so blocks of different
namespaces or tenants never share a hash.  Tokens are int32 or int64 arrays
with values in 0..2**32-1, hashed as uint32 little-endian whatever the
dtype.

Engine modes, so an adapter can key the pool by the hashes its engine
already computes: `vllm_block_hashes` (vLLM's default ``sha256``: SHA-256
of the pickled ``(parent, tuple(tokens), extra_keys)``, seeded by
``NONE_HASH``) and `sglang_page_keys` (SGLang HiCache: SHA-256 over the
prior digest and the tokens as uint32 little-endian, hex).  `index_keys`
turns such digests into index keys (their first 128 bits).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct

import numpy as np

from tract._kernels import blockhash

__all__ = ["MODES", "BlockHasher", "index_keys", "sglang_page_keys", "vllm_block_hashes"]

MODES = ("keyed", "fast")
_ROOT_DOMAIN = b"tract block-hash root v1\0"
_VLLM_DEFAULT_SEED = "vllm-none-hash"
_SGLANG_NAMESPACE = b"sglang-cache-namespace-v1"


def _text(value: str | bytes, name: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise TypeError(f"{name} must be str or bytes, got {type(value).__name__}")


def _check_tokens(tokens) -> np.ndarray:
    if not isinstance(tokens, np.ndarray):
        raise TypeError(f"tokens must be a numpy array of int32 or int64, got "
                        f"{type(tokens).__name__}")
    if tokens.dtype not in (np.int32, np.int64):
        raise TypeError(f"tokens must be int32 or int64, got dtype {tokens.dtype}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-d, got shape {tokens.shape}")
    if not tokens.flags.c_contiguous:
        raise ValueError("tokens must be contiguous in memory (a strided view was given; "
                         "pass np.ascontiguousarray(tokens))")
    # the kernels take int64 only: one compiled specialization each (a cold compile
    # of the fast chain is seconds), and widening costs less than a tenth of hashing
    return tokens if tokens.dtype == np.int64 else tokens.astype(np.int64)


def _check_block_size(block_size: int) -> int:
    if not isinstance(block_size, (int, np.integer)) or not 1 <= block_size <= 1 << 20:
        raise ValueError(f"block_size must be an integer in 1..{1 << 20}, got {block_size!r}")
    return int(block_size)


class BlockHasher:
    """Chained 128-bit hashes of full blocks of tokens.

    Parameters
    ----------
    key : bytes
        16 bytes: the pool's hash key (``Pool.header.hash_key``).
    block_size : int
        Tokens per block.
    mode : {"keyed", "fast"}
        See the module docstring.
    namespace : str or bytes
        What must match for two blocks to be shared (model, dtype, layout,
        parallel rank...).
    salt : str or bytes or None
        A tenant's salt: the same prompt under two salts shares nothing.
    """

    def __init__(self, key: bytes, block_size: int, *, mode: str = "keyed",
                 namespace: str | bytes = b"", salt: str | bytes | None = None):
        if not isinstance(key, (bytes, bytearray)) or len(key) != 16:
            raise ValueError(f"key must be 16 bytes (the pool's hash key), got "
                             f"{type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.block_size = _check_block_size(block_size)
        self.mode = mode
        self._k0, self._k1 = (np.uint64(int.from_bytes(key[i:i + 8], "little")) for i in (0, 8))
        space, salt_bytes = _text(namespace, "namespace"), None if salt is None else \
            _text(salt, "salt")
        root = (_ROOT_DOMAIN + mode.encode() + b"\0" + struct.pack("<QQ", self.block_size, len(space))
                + space + (b"\0" if salt_bytes is None
                           else b"\1" + struct.pack("<Q", len(salt_bytes)) + salt_bytes))
        low, high = blockhash.siphash13_128(np.frombuffer(root, dtype=np.uint8), self._k0, self._k1)
        self.root = np.array([low, high], dtype=np.uint64)
        if mode == "fast":
            self._secret = blockhash.secret_table(int(self._k0), 4 * self.block_size + 16)

    def __call__(self, tokens: np.ndarray, parent: np.ndarray | None = None) -> np.ndarray:
        """Hashes of the full blocks of ``tokens``, an (n_blocks, 2) uint64
        array (low, high words).  ``parent``: the hash of the block before
        ``tokens[0]``, to continue a chain; the root when None."""
        tokens = _check_tokens(tokens)
        if parent is None:
            parent = self.root
        parent = np.asarray(parent)
        if parent.shape != (2,) or parent.dtype != np.uint64:
            raise ValueError(f"parent must be a (2,) uint64 array (one row of a hash array), "
                             f"got shape {parent.shape} dtype {parent.dtype}")
        out = np.empty((tokens.size // self.block_size, 2), dtype=np.uint64)
        if self.mode == "keyed":
            bad = blockhash.keyed_chain(tokens, self.block_size, self._k0, self._k1, parent[0],
                                        parent[1], out)
        else:
            chain = blockhash.fast_chain_odd if self.block_size % 2 else blockhash.fast_chain
            bad = chain(tokens, self.block_size, self._k0, self._secret, parent[0], parent[1],
                        out)
        if bad >= 0:
            block = tokens[bad * self.block_size:(bad + 1) * self.block_size]
            index = bad * self.block_size + int(np.flatnonzero((block < 0) | (block > 2**32 - 1))[0])
            raise ValueError(f"token {int(tokens[index])} at index {index} is outside "
                             f"0..2**32-1")
        return out


def index_keys(digests) -> np.ndarray:
    """Index keys of engine digests (bytes, or hex strings of at least 32
    hex digits): their first 128 bits, an (n, 2) uint64 array."""
    keys = np.empty((len(digests), 2), dtype=np.uint64)
    for row, digest in enumerate(digests):
        raw = bytes.fromhex(digest) if isinstance(digest, str) else digest
        if not isinstance(raw, (bytes, bytearray)) or len(raw) < 16:
            raise ValueError(f"digest {row} must be at least 16 bytes, got {digest!r}")
        keys[row] = np.frombuffer(raw[:16], dtype="<u8")
    return keys


def _token_list(tokens) -> list[int]:
    if isinstance(tokens, np.ndarray):
        return _check_tokens(tokens).tolist()
    return [int(token) for token in tokens]


def vllm_block_hashes(tokens, block_size: int, *, none_hash_seed: str | None = None,
                      cache_salt: str | None = None, parent: bytes | None = None
                      ) -> list[bytes]:
    """vLLM's block hashes (``prefix_caching_hash_algo="sha256"``, v1 KV
    cache manager) of the full blocks of ``tokens``: 32-byte digests.

    The first block's parent is ``NONE_HASH`` = SHA-256 of the pickled
    ``none_hash_seed`` (vLLM: ``PYTHONHASHSEED`` when set, else
    ``"vllm-none-hash"``; the default here follows the same rule), unless
    ``parent`` continues a chain.  ``cache_salt`` enters the first block's
    extra keys, as vLLM does for a request's salt.
    """
    block_size = _check_block_size(block_size)
    tokens = _token_list(tokens)
    if parent is None:
        seed = none_hash_seed if none_hash_seed is not None else \
            os.environ.get("PYTHONHASHSEED", _VLLM_DEFAULT_SEED)
        parent = _vllm_hash(seed)
    digests = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 else None
        parent = _vllm_hash((parent, tuple(tokens[start:start + block_size]), extra))
        digests.append(parent)
    return digests


def _vllm_hash(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sglang_page_keys(tokens, page_size: int, *, prior: str | None = None,
                     extra_key: str | None = None, cache_salt: str | None = None,
                     partial: bool = False) -> list[str]:
    """SGLang's HiCache storage page keys (0.5.x) of ``tokens``: hex SHA-256
    over the prior page's digest and the page's tokens as uint32
    little-endian (uint64 after a 0xFF byte on a page with a token above
    2**32-1).  The first page's prior is ``prior``, else the namespace seed
    of ``extra_key`` / ``cache_salt`` when either is given, else nothing.
    ``partial``: also hash a trailing partial page, as SGLang does."""
    page_size = _check_block_size(page_size)
    tokens = _token_list(tokens)
    if prior is None and (extra_key is not None or cache_salt is not None):
        seed = hashlib.sha256(_SGLANG_NAMESPACE)
        for part in (extra_key, cache_salt):
            if part is None:
                seed.update(b"\0")
            else:
                encoded = part.encode()
                seed.update(b"\1" + struct.pack("<Q", len(encoded)) + encoded)
        prior = seed.hexdigest()
    end = len(tokens) if partial else len(tokens) // page_size * page_size
    keys = []
    for start in range(0, end, page_size):
        page = tokens[start:start + page_size]
        if min(page) < 0:
            raise ValueError(f"token {min(page)} in page {start // page_size} is negative")
        digest = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        if max(page) > 0xFFFFFFFF:
            digest.update(b"\xff" + struct.pack(f"<{len(page)}Q", *page))
        else:
            digest.update(struct.pack(f"<{len(page)}I", *page))
        prior = digest.hexdigest()
        keys.append(prior)
    return keys
