"""The transfer engine on the CPU: round trips for every dtype and layout
(one buffer per block, or per-layer / per-layer-and-K/V segments, numpy
or torch), checksums that catch a flipped byte and do not depend on how a
block is split, fresh reads (R4), and bad input."""

import threading

import numpy as np
import pytest

from tract._native._region import digest, xxh64, xxh64_rows
from tract.errors import BoundsError, ConfigError
from tract.pool import Pool
from tract.transfer import DTYPE_BYTES, KVLayout, TransferEngine

xxhash = pytest.importorskip("xxhash")


def _layout(dtype="float16", **fields):
    base = dict(model="tiny-llama", dtype=dtype, num_layers=3, num_kv_heads=2, head_size=8,
                block_size=4)
    return KVLayout(**{**base, **fields})


@pytest.fixture
def pool(pool_path):
    Pool.create(pool_path, 32 << 20, chunk_size=1 << 16, max_nodes=4, lease_timeout=2.0)
    with Pool.open(pool_path, 0, manager=True) as pool:
        yield pool


def _blocks(layout, count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, layout.block_bytes, dtype=np.uint8) for _ in range(count)]


def _split(block, layout, per):
    """A block as the segments of a layout that splits it ``per`` layer
    (K and V together) or per piece (layer and K/V)."""
    size = layout.piece_bytes * (layout.kv_parts if per == "layer" else 1)
    return [block[start:start + size] for start in range(0, block.size, size)]


def test_digests_are_the_reference_hashes():
    rng = np.random.default_rng(0)
    # every count of stripes in a last partial block, odd and even (the
    # vector loop takes them two at a time)
    for size in [0, 1, 7, 8, 31, 32, 33, 100, 240, 241, 256, 1024, 1025, 16384, 16384 + 33,
                 100_003, *range(2048 + 1, 3072 + 65, 64), *range(3072 - 64, 3072 + 130, 31)]:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for seed in (0, 7, 2**64 - 1):
            assert xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)
            want = xxhash.xxh3_64_intdigest(data, seed) if size > 240 else \
                xxhash.xxh64_intdigest(data, seed)
            assert digest(data, seed) == want, size


@pytest.mark.parametrize("misaligned", [0, 8, 24])
def test_copies_hash_what_they_move(pool, misaligned):
    """Each piece's digest from the copy is the digest of its bytes, the
    copy in lands whole (aligned or not), and the copy out too."""
    region = pool.region
    rng = np.random.default_rng(misaligned)
    base = pool.alloc(1 << 16) + misaligned
    for piece in (64, 240, 248, 1024, 4160):
        data = rng.integers(0, 256, piece * 3, dtype=np.uint8)
        sums = np.zeros(3, np.uint64)
        region.copy_in_blocks(np.array([base]), [data], sums, 5, piece)
        assert sums.tolist() == [digest(data[i * piece:(i + 1) * piece], 5) for i in range(3)]
        assert region.read(base, data.size) == data.tobytes()
        out, again = np.zeros_like(data), np.zeros(3, np.uint64)
        region.copy_out_blocks(np.array([base]), [out], again, 5, piece)
        assert (out == data).all() and (again == sums).all()


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
@pytest.mark.parametrize("split", ["whole", "layer", "piece"])
def test_round_trips_are_byte_exact(pool, dtype, split):
    layout = _layout(dtype)
    engine = TransferEngine(pool, layout)
    blocks = _blocks(layout, 5, hash((dtype, split)) % 1000)
    offsets = [pool.alloc(layout.block_bytes) for _ in blocks]
    given = blocks if split == "whole" else [_split(b, layout, split) for b in blocks]
    sums = engine.store(offsets, given)
    outs = [np.zeros(layout.block_bytes, np.uint8) for _ in blocks]
    targets = outs if split == "whole" else [_split(o, layout, split) for o in outs]
    assert engine.load(offsets, targets, sums).all()
    for block, out in zip(blocks, outs):
        np.testing.assert_array_equal(block, out)
    # the same checksum however the block was split
    assert (TransferEngine(pool, layout).store(offsets, blocks) == sums).all()


def test_torch_tensors_round_trip(pool):
    torch = pytest.importorskip("torch")
    layout = _layout("bfloat16")
    engine = TransferEngine(pool, layout)
    shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_size)
    blocks = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
              for i in range(3)]
    offsets = [pool.alloc(layout.block_bytes) for _ in blocks]
    sums = engine.store(offsets, blocks)
    outs = [torch.empty(shape, dtype=torch.bfloat16) for _ in blocks]
    assert engine.load(offsets, outs, sums).all()
    assert all(torch.equal(a, b) for a, b in zip(blocks, outs))
    per_layer = [[block[layer] for layer in range(layout.num_layers)] for block in blocks]
    assert (engine.store(offsets, per_layer) == sums).all()


def test_a_flipped_byte_is_a_miss_for_that_block_only(pool):
    layout = _layout()
    engine = TransferEngine(pool, layout)
    blocks = _blocks(layout, 4, 1)
    offsets = [pool.alloc(layout.block_bytes) for _ in blocks]
    sums = engine.store(offsets, blocks)
    rng = np.random.default_rng(2)
    for _ in range(20):
        row, at = int(rng.integers(4)), int(rng.integers(layout.block_bytes))
        where = offsets[row] + at
        byte = pool.region.load_u8(where)
        pool.region.store_u8(where, byte ^ (1 << int(rng.integers(8))))
        pool.region.flush(where, 1)
        pool.region.fence()
        outs = [np.zeros(layout.block_bytes, np.uint8) for _ in blocks]
        assert engine.load(offsets, outs, sums).tolist() == [i != row for i in range(4)]
        pool.region.store_u8(where, byte)
    unchecked = TransferEngine(pool, layout, checksum=False)
    assert (unchecked.store(offsets, blocks) == 0).all()


def _load_threads():
    return {thread for thread in threading.enumerate() if thread.name.startswith("tract-load")}


@pytest.mark.parametrize("split", ["whole", "layer", "piece"])
def test_a_load_spread_over_threads_is_the_one_thread_load(pool, split):
    """A load of `SPLIT_LOAD_BYTES` or more on 1, 2 and 3 threads: the same
    bytes and the same verdicts (a flipped byte is a miss for its block
    only, wherever the threads' shares were cut); below the size, and while
    a cache-control trace is on, the caller copies alone (the trace shows
    every range dropped, then one fence, then nothing more)."""
    from tract.transfer import SPLIT_LOAD_BYTES

    layout = _layout("float32", num_layers=4, num_kv_heads=4, head_size=64, block_size=32)
    count = -(-SPLIT_LOAD_BYTES // layout.block_bytes) + 3
    blocks = _blocks(layout, count, 3)
    offsets = [pool.alloc(layout.block_bytes) for _ in blocks]
    sums = TransferEngine(pool, layout, load_threads=1).store(offsets, blocks)
    row = count // 2  # where two threads' shares meet
    where = offsets[row] + layout.block_bytes - 1
    byte = pool.region.load_u8(where)
    pool.region.store_u8(where, byte ^ 1)
    pool.region.flush(where, 1)
    pool.region.fence()
    results, others = [], _load_threads()  # other engines' (not closed by their tests)
    for threads in (1, 2, 3):
        engine = TransferEngine(pool, layout, load_threads=threads)
        outs = [np.zeros(layout.block_bytes, np.uint8) for _ in blocks]
        good = engine.load(offsets, [_split(out, layout, split) if split != "whole" else out
                                     for out in outs], sums)
        results.append((good.tolist(), b"".join(out.tobytes() for out in outs)))
        # an idle helper takes the next share, so a pool of k may have started fewer than k
        assert (threads == 1) == (not _load_threads() - others)
        assert len(_load_threads() - others) <= threads - 1
        engine.close()
        assert not _load_threads() - others
    assert results[0][0] == [i != row for i in range(count)]
    assert results[1] == results[0] and results[2] == results[0]
    engine = TransferEngine(pool, layout, load_threads=2)
    outs = [np.zeros(layout.block_bytes, np.uint8) for _ in blocks]
    pool.region.trace_start(1 << 20)
    try:
        engine.load(offsets, outs, sums)
    finally:
        trace = pool.region.trace_stop()
    assert not _load_threads() - others
    fences = np.flatnonzero(trace[:, 1] == -1)
    assert len(fences) >= 1 and trace[fences[0]:, 1].tolist() == [-1] * (len(trace) - fences[0])
    lines = trace[:fences[0], 1]
    assert len(lines) == count * layout.block_bytes // 64
    engine.close()
    for threads in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="load_threads must be a positive int"):
            TransferEngine(pool, layout, load_threads=threads)


def test_layouts_name_every_field():
    layout = _layout()
    assert layout.block_bytes == 3 * 2 * 2 * 8 * 4 * 2 and layout.pieces == 6
    others = [_layout(dtype="bfloat16"), _layout(block_size=8), _layout(tp_rank=1, tp_size=2),
              _layout(engine_layout="LBHNC"), _layout(variant="avx512"), _layout(model="other")]
    prints = {layout.fingerprint()} | {other.fingerprint() for other in others}
    assert len(prints) == 1 + len(others)
    assert layout.namespace() == f"kv:tiny-llama:{layout.fingerprint()}"
    for bad, match in [(dict(dtype="float64"), "dtype"), (dict(num_layers=0), "num_layers"),
                       (dict(tp_rank=2, tp_size=2), "tp_rank"), (dict(model=""), "model")]:
        with pytest.raises(ConfigError, match=match):
            _layout(**bad)


def test_bad_blocks_are_refused_before_a_byte_moves(pool):
    layout = _layout()
    engine = TransferEngine(pool, layout)
    offset = pool.alloc(layout.block_bytes)
    good = _blocks(layout, 1, 3)[0]
    with pytest.raises(ValueError, match="block 0 has 640 bytes; .* blocks have 768"):
        engine.store([offset], [good[:-128]])
    with pytest.raises(ValueError, match="767 bytes is not a whole number of 128-byte pieces"):
        engine.store([offset], [good[:-1]])
    with pytest.raises(ValueError, match="C-contiguous"):
        engine.store([offset], [np.zeros((layout.block_bytes, 2), np.uint8)[:, 0]])
    with pytest.raises(ValueError, match="10 bytes is not a whole number"):
        engine.store([offset], [[good[:10], good[10:]]])
    typed = good.view(np.float16)  # the layout's type: taken as segments, whole or not
    half = typed.size // 2
    for segment, match in [(typed.astype(np.float32), "a float32 buffer, but layout"),
                           (typed.astype(">f2"), "a >f2 buffer, but layout"),
                           (np.repeat(typed, 2)[::2], "C-contiguous")]:
        with pytest.raises(ValueError, match=match):
            engine.store([offset], [[typed[:half], segment[half:]]])
    with pytest.raises(ValueError, match="1 offsets but 2 blocks"):
        engine.store([offset], [good, good])
    with pytest.raises(BoundsError):
        engine.store([pool.region.size - 8], [good])
    out = np.zeros(layout.block_bytes, np.uint8)
    with pytest.raises(BufferError, match="writable"):
        engine.load([offset], [bytes(layout.block_bytes)])
    out.flags.writeable = False  # a whole one-array block, refused all the same
    with pytest.raises((BufferError, ValueError), match="writable|read-only"):
        engine.load([offset], [out])
    assert not out.any()


def _spans(views) -> list[tuple[int, int]]:
    """Where each view's bytes lie, and how many: what a copy would move."""
    spans = []
    for view in views:
        flat = np.frombuffer(view, np.uint8)
        spans.append((flat.ctypes.data, flat.size))
    return spans


def test_the_native_walk_is_the_python_walk_where_it_answers(pool):
    """`flat_segments` (the walk of thousands of segments a load makes)
    answers the common cases with exactly the offsets and bytes of the
    engine's Python walk, and hands every other case to it (None): there
    each refusal is explained as before."""
    torch = pytest.importorskip("torch")
    from tract._native._region import flat_segments

    layout = _layout()
    engine = TransferEngine(pool, layout)
    piece, size = layout.piece_bytes, layout.block_bytes
    raw = _blocks(layout, 3, 8)
    typed = [block.view(np.float16) for block in raw]
    offsets = np.array([0, size, 5 * size], np.int64)
    answered = {
        "whole blocks": raw,
        "pieces": [_split(block, layout, "piece") for block in raw],
        "layers, as tuples": [tuple(_split(block, layout, "layer")) for block in raw],
        "typed pieces": [[p.view(np.float16) for p in _split(block, layout, "piece")]
                         for block in raw],
        "typed whole": typed,
        "raw and typed": [[block[:piece], block[piece:].view(np.float16)] for block in raw],
        "bytearrays": [[bytearray(p) for p in _split(block, layout, "layer")] for block in raw],
        "none": [],
    }
    handed_back = {
        "another type": [[p.view(np.float16).astype(np.float32) for p in _split(b, layout, "layer")]
                         for b in raw],
        "big-endian": [t.astype(">f2") for t in typed],
        "strided": [np.repeat(block, 2)[::2] for block in raw],
        "short": [block[:-piece] for block in raw],
        "a split piece": [[block[:10], block[10:]] for block in raw],
        "an empty segment": [[block[:0], block] for block in raw],
        "tensors": [torch.from_numpy(t) for t in typed],
        "too few": raw[:2],
    }
    for name, blocks in {**answered, **handed_back}.items():
        where = offsets[:len(blocks)] if name != "too few" else offsets
        fast = flat_segments(where, blocks, size, piece, b"e")
        if name in handed_back:
            assert fast is None, name
            continue
        assert fast is not None, name
        reference = engine._walk(where, blocks)
        assert fast[0].dtype == np.int64 and fast[0].tolist() == reference[0].tolist(), name
        assert _spans(fast[1]) == _spans(reference[1]), name
    assert flat_segments(offsets, raw, size, 0, b"e") is None  # no piece size: the walk decides


def test_block_checksums_are_xxh64_of_piece_digests():
    rng = np.random.default_rng(4)
    rows = rng.integers(0, 2**64, size=(5, 6), dtype=np.uint64)
    assert xxh64_rows(rows, 99).tolist() == [xxh64(row, 99) for row in rows]
    with pytest.raises(ValueError, match="at least one digest"):
        xxh64_rows(np.zeros((2, 0), np.uint64))


def test_bench_transfer_reports_every_figure_against_its_baseline():
    """Every figure with its same-run baseline and the median, lowest and
    highest of the paired rounds' ratios; each sample moves at least 64 MiB."""
    from tract.bench import transfer as bench

    assert all(size * count >= bench.SAMPLE_BYTES for size, count in bench.shapes(False))
    results = bench.run(quick=True, peers=False)
    by_name = {(r.name, r.baseline): r for r in results}
    for label in ("256KiBx256", "2MiBx32", "16MiBx4"):
        for kind, baseline in [("put", "nt_copy"), ("get", "memcpy"), ("get", "memcpy_cached"),
                               ("put,no-checksum", "nt_copy"), ("get,no-checksum", "memcpy"),
                               ("get,1-thread", "memcpy"),
                               ("handoff", "two_copy_best"), ("handoff", "two_copy_memcpy"),
                               ("handoff", "tcp_loopback"),
                               ("two_copy_best", "tcp_loopback")]:
            result = by_name[(f"transfer[{kind},{label}]", baseline)].as_dict()
            assert result["value"] > 0 and result["baseline_value"] > 0
            assert 0 < result["ratio_min"] <= result["ratio"] <= result["ratio_max"]


# ------------------------------------------- the CUDA path's cache rules, simulated

class _HostDma:
    """`tract.cuda.CudaDma`'s copies done by this host's CPU through its
    cache: what DMA into (and out of) a host's last-level cache amounts to."""

    def __init__(self, host):
        self.host = host

    def to_pool(self, plans, landed=None):
        for index, (offset, flat) in enumerate(plans):
            for segment in flat:
                self.host.copy_in(offset, segment.numpy(), nontemporal=False)
                offset += segment.numel()
            if landed is not None:
                landed(index)

    def from_pool(self, plans, meanwhile=None):
        for offset, flat in plans:
            for segment in flat:
                self.host.copy_out(offset, segment.numpy())
                offset += segment.numel()
        if meanwhile is not None:
            meanwhile()

    def close(self):
        pass


@pytest.mark.sim
@pytest.mark.parametrize("checksum", [True, False])
def test_cuda_stores_reach_another_host_and_loads_read_fresh(checksum):
    """`tract.cuda.CudaTransfer`'s write-back after a store (R3) and drop
    before a load (R4), with its DMA done through a simulated host's cache:
    node 1 reads what node 0 stored, having read the ranges before."""
    import types

    import torch

    from tract.cuda import CudaTransfer
    from tract.testing.incoherent import SimPool

    layout = KVLayout("sim", "bfloat16", 2, 1, 16, 4)
    offsets = [4096, 4096 + layout.block_bytes]
    for seed in range(40):
        sim = SimPool(16384, hosts=2, seed=seed, chaos=0.3 if seed % 4 else 0.0)
        engines, pools = [], []
        for host in sim.hosts:
            pools.append(types.SimpleNamespace(region=host,
                                               header=types.SimpleNamespace(hash_key=bytes(16))))
            engine = TransferEngine(pools[-1], layout, checksum=checksum)
            engines.append(CudaTransfer(engine, dma=_HostDma(host), threads=0))
        generator = torch.Generator().manual_seed(seed)
        blocks = [torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8,
                                generator=generator) for _ in offsets]
        outs = [torch.zeros(layout.block_bytes, dtype=torch.uint8) for _ in offsets]
        engines[1].load(offsets, outs)  # node 1 has the old bytes in its cache
        sums = engines[0].store(offsets, blocks)
        good = engines[1].load(offsets, outs, sums)
        assert good.all(), f"seed {seed}: a block failed its checksum"
        for block, out in zip(blocks, outs):
            assert torch.equal(block, out), f"seed {seed}: node 1 read stale bytes"
        # the checksums of the CPU path's copies of the same blocks
        cpu = TransferEngine(pools[0], layout, checksum=checksum).store(
            offsets, [block.numpy() for block in blocks])
        assert (cpu == sums).all() and (cpu != 0).all() == checksum


class _Runtime:
    """torch's CUDA runtime bindings as `HostRegistrations` calls them:
    registrations recorded, ``taken`` addresses answered 712 (already
    registered by someone else), ``fail`` ones another error."""

    def __init__(self, taken=(), fail=()):
        self.taken, self.fail, self.pinned = set(taken), set(fail), []

    def cudaHostRegister(self, address, size, flags):
        if address in self.fail:
            return 2
        if address in self.taken:
            return 712
        assert address not in self.pinned, "registered twice"
        self.pinned.append(address)
        return 0

    def cudaHostUnregister(self, address):
        self.pinned.remove(address)
        return 0

    def cudaGetErrorString(self, code):
        return "cudaErrorMemoryAllocation" if code == 2 else "other"


def test_a_mapping_is_registered_once_however_many_engines_use_it():
    """Two engines (or connectors) on one pool in one process share its
    registration (CUDA answers a second one with error 712); the last
    release unregisters; chunks registered by someone else are used and
    left to them; a failure undoes the chunks done and names the call."""
    from tract.cuda import REGISTER_CHUNK, HostRegistrations
    from tract.errors import CudaError

    registry, runtime = HostRegistrations(), _Runtime()
    base, size = 1 << 40, 2 * REGISTER_CHUNK + 4096
    registry.acquire(runtime, base, size)
    registry.acquire(runtime, base, size)
    assert runtime.pinned == [base, base + REGISTER_CHUNK, base + 2 * REGISTER_CHUNK]
    assert registry.users(base) == 2
    registry.release(runtime, base)
    assert len(runtime.pinned) == 3
    registry.release(runtime, base)
    assert runtime.pinned == [] and registry.users(base) == 0
    registry.release(runtime, base)  # a second close is harmless

    runtime = _Runtime(taken=[base + REGISTER_CHUNK])
    registry.acquire(runtime, base, size)
    assert runtime.pinned == [base, base + 2 * REGISTER_CHUNK]
    registry.release(runtime, base)
    assert runtime.pinned == []

    runtime = _Runtime(fail=[base + 2 * REGISTER_CHUNK])
    with pytest.raises(CudaError, match=r"cudaHostRegister\(offset 2147483648, 4096 bytes\) "
                                        r"failed: CUDA error 2 \(cudaErrorMemoryAllocation\)"):
        registry.acquire(runtime, base, size)
    assert runtime.pinned == [] and registry.users(base) == 0


def test_dma_ranges_are_cut_at_registration_chunks():
    """A block that straddles the end of a registration chunk is copied in
    two DMAs (one may not span two registrations)."""
    from tract.cuda import REGISTER_CHUNK, spans

    assert list(spans(0, 4096)) == [(0, 4096)]
    assert list(spans(REGISTER_CHUNK - 100, 300)) == [(REGISTER_CHUNK - 100, 100),
                                                       (REGISTER_CHUNK, 200)]
    assert list(spans(10, 25, chunk=10)) == [(10, 10), (20, 10), (30, 5)]
    assert list(spans(5, 0)) == []


def test_blocks_of_many_segments_go_through_the_staging_ring(monkeypatch):
    """`CudaDma`'s plans, run on CPU tensors (torch's stream calls made
    no-ops, as its copies are synchronous here): a block of several
    segments is gathered into a slot of the ring and moved whole, a block
    of one moves directly, and the ring wraps; the same bytes land and
    come back either way, and each block is reported landed in order."""
    import contextlib

    import torch

    import tract.cuda as cuda
    from tract.region import scratch_region

    class Stream:
        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    class Event:
        def record(self, stream):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(cuda, "STAGING_BYTES", 3 * 4096)
    rng = np.random.default_rng(8)
    blocks = [[torch.from_numpy(rng.integers(0, 256, 1024, dtype=np.uint8)) for _ in range(4)]
              for _ in range(7)]
    blocks[2] = [torch.from_numpy(rng.integers(0, 256, 4096, dtype=np.uint8))]
    plans = [(8192 * i + 64, block) for i, block in enumerate(blocks)]
    with scratch_region(1 << 20, name="staging") as region:
        dma = cuda.CudaDma.__new__(cuda.CudaDma)  # the copies alone: no registration
        dma.torch, dma.staging, dma.stream = torch, None, Stream()
        dma.host = torch.from_numpy(region.view())
        landed = []
        dma.to_pool(plans, landed.append)
        assert landed == list(range(7)) and tuple(dma.staging.shape) == (3, 4096)
        for offset, block in plans:
            assert region.read(offset, 4096) == b"".join(bytes(s.numpy()) for s in block)
        outs = [[torch.zeros(s.numel(), dtype=torch.uint8) for s in block] for block in blocks]
        meanwhile = []
        dma.from_pool([(offset, out) for (offset, _), out in zip(plans, outs)],
                      lambda: meanwhile.append(True))
        assert meanwhile == [True]
        for block, out in zip(blocks, outs):
            assert all(torch.equal(a, b) for a, b in zip(block, out))
        dma.host = dma.staging = None


class _CopyDma(_HostDma):
    """`CudaDma`'s copies done by this CPU on a real mapping, each block
    reported landed once copied (hashing threads then run beside the
    copies of the blocks after it)."""

    def to_pool(self, plans, landed=None):
        for index, (offset, flat) in enumerate(plans):
            for segment in flat:
                self.host.copy_in(offset, segment.numpy(), nontemporal=False)
                offset += segment.numel()
            if landed is not None:
                landed(index)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_cuda_checksums_hashed_on_threads_match_the_cpu_path(pool_path, threads):
    """`CudaTransfer`'s checksums, hashed by ``threads`` threads that only
    read while the calling thread writes back: those the CPU path's copies
    compute for the same blocks; a corrupted byte fails its block only."""
    import torch

    from tract.cuda import CudaTransfer

    layout = KVLayout("threads", "uint8", num_layers=4, num_kv_heads=2, head_size=256,
                      block_size=16)
    Pool.create(pool_path, 32 << 20, chunk_size=1 << 20, max_nodes=2)
    with Pool.open(pool_path, 0, manager=True) as pool:
        engine = TransferEngine(pool, layout)
        transfer = CudaTransfer(engine, dma=_CopyDma(pool.region), threads=threads)
        generator = torch.Generator().manual_seed(threads)
        blocks = [torch.randint(0, 256, (layout.block_bytes,), dtype=torch.uint8,
                                generator=generator) for _ in range(9)]
        offsets = [pool.alloc(layout.block_bytes) for _ in blocks]
        sums = transfer.store(offsets, blocks)
        assert (TransferEngine(pool, layout).store(offsets, [b.numpy() for b in blocks])
                == sums).all()
        where = offsets[4] + 100
        pool.region.store_u8(where, pool.region.load_u8(where) ^ 1)
        outs = [torch.zeros(layout.block_bytes, dtype=torch.uint8) for _ in blocks]
        assert transfer.load(offsets, outs, sums).tolist() == [i != 4 for i in range(9)]
        transfer.close()
