"""asv: moving KV blocks (`tract bench transfer`, the tract side): put
(reserve, copy, checksum, publish) and get (pin, fresh copy, checksum
check, unpin) of 8 blocks, next to memcpy and the non-temporal copy of the
same bytes, their baselines."""

import numpy as np

from tract.bench import transfer as bench
from tract.connector import Connector


class Blocks:
    params = [[256 << 10, 2 << 20], [True, False]]
    param_names = ["block_bytes", "checksum"]

    def setup(self, size, checksum):
        self.harness = bench._Pool(size * 16)
        self.pool = self.harness.pool
        self.connector = Connector(self.pool, bench.layout_of(size), checksum=checksum)
        self.blocks = bench._blocks(size, 8, 1)
        self.outs = [np.empty(size, np.uint8) for _ in range(8)]
        self.present = np.arange(16, dtype=np.uint64).reshape(8, 2)
        self.connector.store(self.present, self.blocks)
        self.offsets = np.array([self.pool.alloc(size) for _ in range(8)], dtype=np.int64)
        self.rng = np.random.default_rng(2)

    def teardown(self, size, checksum):
        self.harness.close()

    def time_put(self, size, checksum):
        keys = self.rng.integers(0, 2**63, size=(8, 2), dtype=np.uint64)
        self.connector.store(keys, self.blocks)  # allocation pressure evicts

    def time_get(self, size, checksum):
        self.connector.load(self.present, self.outs)

    def time_memcpy(self, size, checksum):
        for a, b in zip(self.blocks, self.outs):
            np.copyto(b, a)

    def time_nontemporal_copy(self, size, checksum):
        self.pool.region.copy_in_blocks(self.offsets, self.blocks)
