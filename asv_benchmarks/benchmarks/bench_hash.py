"""asv: chained block hashing (`tract bench hash`): 1 M int32 tokens in
16-token blocks, keyed (SipHash-1-3-128) and fast (XXH3-128), next to the
vLLM-style SHA-256-of-pickle per block they are judged against."""

from tract.bench import hash as bench
from tract.hashing import BlockHasher, vllm_block_hashes


class ChainedHash:
    """Hash every full block of 1 M tokens (throughput: 4 MB of token bytes)."""

    params = ["keyed", "fast"]
    param_names = ["mode"]

    def setup(self, mode):
        self.tokens = bench.tokens(1 << 20)
        self.hasher = BlockHasher(bench.KEY, bench.BLOCK_SIZE, mode=mode)
        self.hasher(self.tokens[:bench.BLOCK_SIZE])

    def time_hash(self, mode):
        self.hasher(self.tokens)


class VllmBaseline:
    """The baseline on 16 K tokens (1/64 of the above): SHA-256 of the pickle per block."""

    def setup(self):
        self.tokens = bench.tokens(1 << 14)

    def time_sha256_pickle(self):
        vllm_block_hashes(self.tokens, bench.BLOCK_SIZE, none_hash_seed="0")
