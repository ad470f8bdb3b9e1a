"""asv: the cluster tier (`tract bench tier`): a batch of 16 blocks got
from Mooncake Store into engine buffers, through the tier's staging (the
network call, the header checks and the digest of every byte), next to
the `exists` of the same keys; a Mooncake master and a segment holder are
started on 127.0.0.1 for each parameter and stopped after."""

import numpy as np

BLOCKS = 16


class ClusterTier:
    params = [256 << 10, 2 << 20]
    param_names = ["block_bytes"]

    def setup(self, size):
        try:
            import mooncake.store  # noqa: F401
        except ImportError:
            raise NotImplementedError("mooncake-transfer-engine-non-cuda is not installed")
        from tract.bench.peers import SEGMENT_MAX, MooncakeCluster
        from tract.tier import open_tier

        self.cluster = MooncakeCluster(segment=SEGMENT_MAX).start()
        self.tier = open_tier(self.cluster.url(staging_bytes=2 * BLOCKS * (size + 4096)))
        rng = np.random.default_rng(size)
        self.keys = rng.integers(0, 2**63, (BLOCKS, 2), dtype=np.uint64)
        if not self.tier.put_from(self.keys, [rng.integers(0, 256, size, dtype=np.uint8)
                                              for _ in range(BLOCKS)]).all():
            raise NotImplementedError(f"the tier took no blocks: {self.tier.down}")
        self.out = [np.empty(size, np.uint8) for _ in range(BLOCKS)]

    def teardown(self, size):
        self.tier.close()
        self.cluster.stop()

    def time_get_into(self, size):
        self.tier.get_into(self.keys, self.out)

    def time_exists(self, size):
        self.tier.exists(self.keys)
