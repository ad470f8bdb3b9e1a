"""The CUDA path of the transfer engine (DMA between device tensors and
the registered pool).  Runs where torch sees a CUDA device, skips
elsewhere; `tract bench transfer --device cuda` measures it."""

import numpy as np
import pytest

from tract.connector import Connector
from tract.pool import Pool
from tract.transfer import KVLayout, TransferEngine

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

LAYOUT = KVLayout(model="tiny-llama", dtype="bfloat16", num_layers=4, num_kv_heads=2,
                  head_size=64, block_size=16)
SHAPE = (LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_size)


@pytest.fixture
def pool(pool_path):
    Pool.create(pool_path, 64 << 20, chunk_size=1 << 20, max_nodes=4, lease_timeout=2.0)
    with Pool.open(pool_path, 0, manager=True) as pool:
        yield pool


def _blocks(count, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(SHAPE, device="cuda", generator=generator).to(torch.bfloat16)
            for _ in range(count)]


def test_device_blocks_round_trip_with_the_cpu_checksums(pool):
    engine = TransferEngine(pool, LAYOUT)
    blocks = _blocks(4, 1)
    offsets = [pool.alloc(LAYOUT.block_bytes) for _ in blocks]
    sums = engine.store(offsets, blocks)
    outs = [torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda") for _ in blocks]
    assert engine.load(offsets, outs, sums).all()
    assert all(torch.equal(a, b) for a, b in zip(blocks, outs))
    # the same bytes, and the same checksums, as the CPU path
    host = [block.cpu() for block in blocks]
    assert (TransferEngine(pool, LAYOUT).store(offsets, host) == sums).all()
    per_layer = [[layer for layer in torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")]
                 for _ in blocks]
    assert engine.load(offsets, per_layer, sums).all()
    assert all(torch.equal(torch.stack(a), b) for a, b in zip(per_layer, blocks))
    where = offsets[1] + 5
    pool.region.store_u8(where, pool.region.load_u8(where) ^ 1)
    pool.region.flush(where, 1)
    pool.region.fence()
    assert engine.load(offsets, outs, sums).tolist() == [True, False, True, True]
    engine.close()


def test_the_connector_moves_device_blocks(pool):
    connector = Connector(pool, LAYOUT)
    tokens = np.arange(3 * LAYOUT.block_size, dtype=np.int32)
    blocks = _blocks(3, 2)
    assert connector.store(tokens, blocks) == 3
    outs = [torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    assert connector.load(tokens, outs) == 3
    assert all(torch.equal(a, b) for a, b in zip(blocks, outs))
    connector.close()


def test_two_connectors_on_one_pool_share_its_registration(pool):
    """A scheduler-side and a worker-side connector, or a store and a load
    side, in one process: CUDA refuses to register the mapping twice, so
    they share one registration, released by the last to close."""
    from tract.cuda import REGISTRATIONS

    first, second = Connector(pool, LAYOUT), Connector(pool, LAYOUT)
    tokens = np.arange(2 * LAYOUT.block_size, dtype=np.int32)
    blocks = _blocks(2, 3)
    assert first.store(tokens, blocks) == 2
    outs = [torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    assert second.load(tokens, outs) == 2
    assert all(torch.equal(a, b) for a, b in zip(blocks, outs))
    assert REGISTRATIONS.users(pool.region.base) == 2
    first.close()
    assert second.load(tokens, outs) == 2
    second.close()
    assert REGISTRATIONS.users(pool.region.base) == 0


def test_copies_wait_for_the_callers_stream(pool):
    """The blocks a store reads may still be being written by kernels on
    the caller's stream, and the targets of a load still used: tract's copy
    stream waits for them (a long sleep kernel ahead of the last write)."""
    connector = Connector(pool, LAYOUT)
    tokens = np.arange(LAYOUT.block_size, dtype=np.int32)
    side = torch.cuda.Stream()
    block = torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        block.fill_(7)
        assert connector.store(tokens, [block]) == 1
        out = torch.ones(SHAPE, dtype=torch.bfloat16, device="cuda")
        torch.cuda._sleep(50_000_000)
        out.fill_(3)
        assert connector.load(tokens, [out]) == 1
    torch.cuda.synchronize()
    assert bool((out == 7).all()), "the load's DMA ran before the caller's last write"
    connector.close()


def test_a_block_across_a_registration_chunk(pool_path):
    """The mapping is registered in 1 GiB chunks; a block that straddles
    the end of one moves whole, both ways."""
    from tract.cuda import REGISTER_CHUNK

    Pool.create(pool_path, REGISTER_CHUNK + (64 << 20), chunk_size=1 << 20, max_nodes=4,
                lease_timeout=2.0)
    with Pool.open(pool_path, 0, manager=True) as pool:
        engine = TransferEngine(pool, LAYOUT)
        offsets = [REGISTER_CHUNK - LAYOUT.block_bytes // 2 - 64]  # heap space nobody holds
        blocks = _blocks(1, 4)
        sums = engine.store(offsets, blocks)
        out = [torch.zeros(SHAPE, dtype=torch.bfloat16, device="cuda")]
        assert engine.load(offsets, out, sums).all() and torch.equal(out[0], blocks[0])
        cpu = np.zeros(LAYOUT.block_bytes, np.uint8)
        assert TransferEngine(pool, LAYOUT).load(offsets, [cpu], sums).all()
        assert bytes(cpu) == blocks[0].cpu().view(torch.uint8).numpy().tobytes()
        engine.close()


def test_per_layer_blocks_through_the_staging_ring(pool, monkeypatch):
    """Blocks as an engine's per-layer K and V tensors (2 x layers
    segments each), more of them than the staging ring has slots: the same
    bytes and checksums as whole blocks moved from the CPU."""
    import tract.cuda as cuda

    monkeypatch.setattr(cuda, "STAGING_BYTES", 3 * LAYOUT.block_bytes)
    engine = TransferEngine(pool, LAYOUT)
    blocks = _blocks(7, 5)
    split = [[half for layer in block for half in layer] for block in blocks]  # [layer][K|V]
    offsets = [pool.alloc(LAYOUT.block_bytes) for _ in blocks]
    sums = engine.store(offsets, split)
    host = [block.cpu() for block in blocks]
    assert (TransferEngine(pool, LAYOUT).store(offsets, host) == sums).all()
    outs = [[torch.empty_like(half) for half in block] for block in split]
    assert engine.load(offsets, outs, sums).all()
    for block, out in zip(split, outs):
        assert all(torch.equal(a, b) for a, b in zip(block, out))
    engine.close()
