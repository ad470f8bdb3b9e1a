"""Chained block hashes of token arrays (`tract.hashing` is the public layer).

Block ``i`` of ``block_size`` tokens hashes to 128 bits,
``h_i = H(tokens_i || h_{i-1})``: the message is the block's tokens as
uint32 little-endian, then the parent digest as two little-endian uint64
(low word first).  The parent comes last so that the work on a block's
tokens does not wait for the previous block: the CPU overlaps consecutive
blocks.  Two functions ``H``:

- ``keyed``: SipHash-1-3 with 128-bit output, keyed by the pool's hash key
  (a PRF: without the key, nobody can craft colliding prompts);
- ``fast``: XXH3-128 seeded with the key's low word, bit-exact with the
  ``xxhash`` package (not a PRF: for trusted single-tenant pools).

Tokens may be int32 or int64; a token outside 0..2**32-1 stops a chain
kernel, which returns that token's block (else -1).  Twins: ``tests/naive.py``
(``siphash``, ``keyed_chain``, ``fast_chain``).
"""

import numpy as np

from tract._kernels.config import kernel

__all__ = ["SECRET", "fast_chain", "fast_chain_odd", "keyed_chain", "secret_table",
           "siphash13_128"]

U64 = np.uint64
M32 = U64(0xFFFFFFFF)
TOKEN_MAX = 0xFFFFFFFF

# ----------------------------------------------------------- SipHash-1-3-128


@kernel(inline="always")
def _rotl(x, b):
    return (x << U64(b)) | (x >> U64(64 - b))


@kernel(inline="always")
def _sipround(v0, v1, v2, v3):
    v0 += v1
    v1 = _rotl(v1, 13)
    v1 ^= v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16)
    v3 ^= v2
    v0 += v3
    v3 = _rotl(v3, 21)
    v3 ^= v0
    v2 += v1
    v1 = _rotl(v1, 17)
    v1 ^= v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@kernel(inline="always")
def _sip_init(k0, k1):
    return (k0 ^ U64(0x736F6D6570736575), k1 ^ U64(0x646F72616E646F6D) ^ U64(0xEE),
            k0 ^ U64(0x6C7967656E657261), k1 ^ U64(0x7465646279746573))


@kernel(inline="always")
def _sip_word(v0, v1, v2, v3, m):
    v3 ^= m
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= m
    return v0, v1, v2, v3


@kernel(inline="always")
def _sip_final(v0, v1, v2, v3):
    v2 ^= U64(0xEE)
    for _ in range(3):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    low = v0 ^ v1 ^ v2 ^ v3
    v1 ^= U64(0xDD)
    for _ in range(3):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return low, v0 ^ v1 ^ v2 ^ v3


@kernel
def siphash13_128(data, k0, k1):
    """SipHash-1-3-128 of a uint8 array: (low, high)."""
    v0, v1, v2, v3 = _sip_init(k0, k1)
    n = data.size
    whole = n // 8 * 8
    for i in range(0, whole, 8):
        m = U64(0)
        for j in range(8):
            m |= U64(data[i + j]) << U64(8 * j)
        v0, v1, v2, v3 = _sip_word(v0, v1, v2, v3, m)
    m = U64(n & 0xFF) << U64(56)
    for j in range(n - whole):
        m |= U64(data[whole + j]) << U64(8 * j)
    v0, v1, v2, v3 = _sip_word(v0, v1, v2, v3, m)
    return _sip_final(v0, v1, v2, v3)


@kernel(inline="always")
def _token_word(tokens, i):
    """Tokens i and i + 1 as one little-endian u64 (two uint32)."""
    return U64(np.uint32(tokens[i])) | U64(np.uint32(tokens[i + 1])) << U64(32)


@kernel(inline="always")
def _sip_tokens(tokens, base, count, k0, k1):
    """SipHash state after ``count`` (even) tokens from ``base``, and the
    OR of the tokens (bits above 32: one outside 0..2**32-1)."""
    v0, v1, v2, v3 = _sip_init(k0, k1)
    seen = np.int64(0)
    for j in range(base, base + count, 2):
        seen |= np.int64(tokens[j]) | np.int64(tokens[j + 1])
        v0, v1, v2, v3 = _sip_word(v0, v1, v2, v3, _token_word(tokens, j))
    return v0, v1, v2, v3, seen


@kernel
def keyed_chain(tokens, block_size, k0, k1, p0, p1, out):
    """SipHash-1-3-128 chain over the first ``out.shape[0]`` blocks; -1, or
    the first block with a token outside 0..2**32-1 (nothing hashed from it
    on).  A block's tokens come before its parent in the message, so the
    next block's tokens are compressed while this block's tail (which waits
    for the parent) is: the two chains of work run side by side."""
    length_word = U64((4 * block_size + 16) & 0xFF) << U64(56)
    odd = block_size % 2
    pairs = block_size - odd
    count = out.shape[0]
    if count == 0:
        return -1
    v0, v1, v2, v3, seen = _sip_tokens(tokens, 0, pairs, k0, k1)
    for block in range(count):
        last = np.int64(tokens[block * block_size + pairs]) if odd else np.int64(0)
        if (seen | last) >> 32 != 0:
            return block
        if odd:  # the last token shares a word with the parent's low half
            a0, a1, a2, a3 = _sip_word(v0, v1, v2, v3, U64(last) | p0 << U64(32))
            a0, a1, a2, a3 = _sip_word(a0, a1, a2, a3, p0 >> U64(32) | p1 << U64(32))
            a0, a1, a2, a3 = _sip_word(a0, a1, a2, a3, p1 >> U64(32) | length_word)
        else:
            a0, a1, a2, a3 = _sip_word(v0, v1, v2, v3, p0)
            a0, a1, a2, a3 = _sip_word(a0, a1, a2, a3, p1)
            a0, a1, a2, a3 = _sip_word(a0, a1, a2, a3, length_word)
        if block + 1 < count:
            v0, v1, v2, v3, seen = _sip_tokens(tokens, (block + 1) * block_size, pairs, k0, k1)
        p0, p1 = _sip_final(a0, a1, a2, a3)
        out[block, 0] = p0
        out[block, 1] = p1
    return -1


# ------------------------------------------------------------------ XXH3-128

SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
SECRET_SIZE = 192
P32_1, P32_2, P32_3 = U64(0x9E3779B1), U64(0x85EBCA77), U64(0xC2B2AE3D)
P64_1, P64_2, P64_3 = U64(0x9E3779B185EBCA87), U64(0xC2B2AE3D27D4EB4F), U64(0x165667B19E3779F9)
P64_4, P64_5 = U64(0x85EBCA77C2B2AE63), U64(0x27D4EB2F165667C5)
PMX1 = U64(0x165667919E3779F9)


def secret_table(seed: int, length: int) -> np.ndarray:
    """The secret as little-endian uint64 read at every byte offset, for a
    message of ``length`` bytes hashed with ``seed``: the default secret up
    to 240 bytes (the seed enters the formulas), above that the secret
    derived from the seed (XXH3's custom secret)."""
    secret = bytearray(SECRET)
    if length > 240 and seed:
        for i in range(0, SECRET_SIZE, 16):
            low = (int.from_bytes(secret[i:i + 8], "little") + seed) % 2**64
            high = (int.from_bytes(secret[i + 8:i + 16], "little") - seed) % 2**64
            secret[i:i + 16] = low.to_bytes(8, "little") + high.to_bytes(8, "little")
    return np.array([int.from_bytes(secret[o:o + 8], "little") for o in range(SECRET_SIZE - 7)],
                    dtype=np.uint64)


@kernel(inline="always")
def _fold64(a, b):
    """Low xor high of the 128-bit product."""
    a_lo, a_hi, b_lo, b_hi = a & M32, a >> U64(32), b & M32, b >> U64(32)
    lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    cross = (lo_lo >> U64(32)) + (hi_lo & M32) + lo_hi
    upper = (hi_lo >> U64(32)) + (cross >> U64(32)) + hi_hi
    return ((cross << U64(32)) | (lo_lo & M32)) ^ upper


@kernel(inline="always")
def _avalanche(h):
    h ^= h >> U64(37)
    h *= PMX1
    return h ^ (h >> U64(32))


@kernel(inline="always")
def _read64(message, offset):
    """Little-endian u64 at byte ``offset`` (a multiple of 4) of a message
    held in u64 words.  The words are written whole (a load that straddles
    two narrower stores would wait for both to reach the cache)."""
    word = offset >> 3
    if offset & 7 == 0:
        return message[word]
    return (message[word] >> U64(32)) | (message[word + 1] << U64(32))


@kernel(inline="always")
def _mix16(message, offset, secret, s, seed):
    return _fold64(_read64(message, offset) ^ (secret[s] + seed),
                   _read64(message, offset + 8) ^ (secret[s + 8] - seed))


@kernel(inline="always")
def _mix32(low, high, message, o1, o2, secret, s, seed):
    low += _mix16(message, o1, secret, s, seed)
    low ^= _read64(message, o2) + _read64(message, o2 + 8)
    high += _mix16(message, o2, secret, s + 16, seed)
    high ^= _read64(message, o1) + _read64(message, o1 + 8)
    return low, high


@kernel(inline="always")
def _finish(low, high, length, seed):
    h_low = low + high
    h_high = low * P64_1 + high * P64_4 + (U64(length) - seed) * P64_2
    return _avalanche(h_low), U64(0) - _avalanche(h_high)


@kernel(inline="always")
def _accumulate(acc, message, offset, secret, s):
    for i in range(8):
        value = _read64(message, offset + 8 * i)
        key = value ^ secret[s + 8 * i]
        acc[i ^ 1] += value
        acc[i] += (key & M32) * (key >> U64(32))


@kernel(inline="always")
def _xxh3_long(message, length, secret, acc):
    acc[0], acc[1], acc[2], acc[3] = P32_3, P64_1, P64_2, P64_3
    acc[4], acc[5], acc[6], acc[7] = P64_4, P32_2, P64_5, P32_1
    stripes_per_block = (SECRET_SIZE - 64) // 8
    block_length = 64 * stripes_per_block
    blocks = (length - 1) // block_length
    for n in range(blocks):
        for stripe in range(stripes_per_block):
            _accumulate(acc, message, n * block_length + stripe * 64, secret, stripe * 8)
        for i in range(8):
            value = acc[i]
            value ^= value >> U64(47)
            value ^= secret[SECRET_SIZE - 64 + 8 * i]
            acc[i] = value * P32_1
    stripes = ((length - 1) - block_length * blocks) // 64
    for stripe in range(stripes):
        _accumulate(acc, message, blocks * block_length + stripe * 64, secret, stripe * 8)
    _accumulate(acc, message, length - 64, secret, SECRET_SIZE - 64 - 7)
    low = U64(length) * P64_1
    high = ~(U64(length) * P64_2)
    for i in range(4):
        low += _fold64(acc[2 * i] ^ secret[11 + 16 * i], acc[2 * i + 1] ^ secret[19 + 16 * i])
        high += _fold64(acc[2 * i] ^ secret[SECRET_SIZE - 64 - 11 + 16 * i],
                        acc[2 * i + 1] ^ secret[SECRET_SIZE - 64 - 3 + 16 * i])
    return _avalanche(low), _avalanche(high)


@kernel(inline="always")
def _xxh3_upto128(message, length, secret, seed):
    """XXH3-128 of a 17..128-byte message."""
    low, high = U64(length) * P64_1, U64(0)
    if length > 32:
        if length > 64:
            if length > 96:
                low, high = _mix32(low, high, message, 48, length - 64, secret, 96, seed)
            low, high = _mix32(low, high, message, 32, length - 48, secret, 64, seed)
        low, high = _mix32(low, high, message, 16, length - 32, secret, 32, seed)
    low, high = _mix32(low, high, message, 0, length - 16, secret, 0, seed)
    return _finish(low, high, length, seed)


@kernel(inline="always")
def _xxh3_upto240(message, length, secret, seed):
    """XXH3-128 of a 129..240-byte message."""
    low, high = U64(length) * P64_1, U64(0)
    for i in range(4):
        low, high = _mix32(low, high, message, 32 * i, 32 * i + 16, secret, 32 * i, seed)
    low, high = _avalanche(low), _avalanche(high)
    for i in range(4, length // 32):
        low, high = _mix32(low, high, message, 32 * i, 32 * i + 16, secret, 3 + 32 * (i - 4),
                           seed)
    low, high = _mix32(low, high, message, length - 16, length - 32, secret, 136 - 17 - 16,
                       U64(0) - seed)
    return _finish(low, high, length, seed)


@kernel
def fast_chain(tokens, block_size, seed, secret, p0, p1, out):
    """XXH3-128 chain over the first ``out.shape[0]`` blocks of an even
    ``block_size`` (``secret`` from `secret_table` for this seed and message
    length); -1, or the first block with a token outside 0..2**32-1.  The
    message is the block's token pairs, then the parent, as u64 words
    written whole (a load that straddles narrower stores waits for them)."""
    half = block_size // 2
    message = np.empty(half + 2, dtype=np.uint64)
    acc = np.empty(8, dtype=np.uint64)
    length = 4 * block_size + 16
    for block in range(out.shape[0]):
        base = block * block_size
        seen = np.int64(0)
        for j in range(half):
            seen |= np.int64(tokens[base + 2 * j]) | np.int64(tokens[base + 2 * j + 1])
            message[j] = _token_word(tokens, base + 2 * j)
        message[half] = p0
        message[half + 1] = p1
        if seen >> 32 != 0:
            return block
        if length <= 128:  # written out here: a helper with three returns is slower
            p0, p1 = _xxh3_upto128(message, length, secret, seed)
        elif length <= 240:
            p0, p1 = _xxh3_upto240(message, length, secret, seed)
        else:
            p0, p1 = _xxh3_long(message, length, secret, acc)
        out[block, 0] = p0
        out[block, 1] = p1
    return -1


@kernel
def fast_chain_odd(tokens, block_size, seed, secret, p0, p1, out):
    """`fast_chain` for an odd ``block_size``: the last token shares a word
    with the parent's low half."""
    half = block_size // 2
    message = np.empty(half + 3, dtype=np.uint64)
    acc = np.empty(8, dtype=np.uint64)
    length = 4 * block_size + 16
    for block in range(out.shape[0]):
        base = block * block_size
        seen = np.int64(0)
        for j in range(half):
            seen |= np.int64(tokens[base + 2 * j]) | np.int64(tokens[base + 2 * j + 1])
            message[j] = _token_word(tokens, base + 2 * j)
        last = np.int64(tokens[base + block_size - 1])
        seen |= last
        message[half] = U64(last & 0xFFFFFFFF) | p0 << U64(32)
        message[half + 1] = p0 >> U64(32) | p1 << U64(32)
        message[half + 2] = p1 >> U64(32)
        if seen >> 32 != 0:
            return block
        if length <= 128:  # written out here: a helper with three returns is slower
            p0, p1 = _xxh3_upto128(message, length, secret, seed)
        elif length <= 240:
            p0, p1 = _xxh3_upto240(message, length, secret, seed)
        else:
            p0, p1 = _xxh3_long(message, length, secret, acc)
        out[block, 0] = p0
        out[block, 1] = p1
    return -1
