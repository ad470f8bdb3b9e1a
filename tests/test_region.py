"""The native mapping: shared bytes across processes, bounds, modes, copies."""

import mmap
import multiprocessing
import os
import stat

import numpy
import pytest

import tract
from tract import platform
from tract._native._region import (INSTRUCTIONS, TRACE_FENCE, TRACE_LOAD_FENCE,
                                   TRACE_STORE_FENCE, digest, map_fd)
from tract.errors import BoundsError, ConfigError
from tract.region import create_region, open_region

MIB = 1 << 20


def _child_writes(path, queue):
    # Map something first so this process's mapping lands at another address.
    spacer = mmap.mmap(-1, 64 * MIB)
    region = open_region(path)
    region.store_u64(4096, 0x1122334455667788)
    region.copy_in(8192, b"written by the child", nontemporal=True)
    region.flush(4096, 64)
    region.fence()
    queue.put((region.base, region.read(0, 16)))
    region.close()
    spacer.close()


@pytest.mark.multiprocess
def test_two_processes_see_the_same_bytes_at_different_addresses(pool_path):
    region = create_region(pool_path, 4 * MIB)
    region.copy_in(0, b"parent header---")
    region.flush(0, 16)
    region.fence()
    queue = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(target=_child_writes,
                                                         args=(pool_path, queue))
    child.start()
    child_base, child_saw = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert child_saw == b"parent header---"
    assert child_base != region.base
    region.invalidate(4096, 8192)
    region.fence()
    assert region.load_u64(4096) == 0x1122334455667788
    assert region.read(8192, 20) == b"written by the child"
    region.close()


@pytest.mark.parametrize("call", [
    lambda r: r.load_u8(r.size),
    lambda r: r.load_u64(r.size - 4),
    lambda r: r.load_u32(-4),
    lambda r: r.store_u16(r.size, 1),
    lambda r: r.read(r.size - 10, 11),
    lambda r: r.read(5, -1),
    lambda r: r.flush(0, r.size + 1),
    lambda r: r.invalidate(r.size, 1),
    lambda r: r.writeback(-64, 64),
    lambda r: r.copy_in(r.size - 3, b"four"),
    lambda r: r.copy_out(r.size - 3, bytearray(4)),
    lambda r: r.view(r.size - 3, 4),
    lambda r: r.fill(r.size - 1, 2),
    lambda r: r.address(r.size + 1),
    lambda r: r.offset_of(r.base - 1),
    lambda r: r.offset_of(r.base + r.size + 1),
    lambda r: r.time_flush_lines(r.size - 64, 2, True),
])
def test_bounds_violations_raise_and_touch_nothing(region, call):
    region.fill(0, region.size, 0xAB)
    with pytest.raises(BoundsError) as error:
        call(region)
    assert "outside region" in str(error.value)
    assert str(region.size) in str(error.value) or "mapped at" in str(error.value)
    assert (region.view() == 0xAB).all()


def test_bounds_error_names_offset_length_and_size(region):
    with pytest.raises(BoundsError, match=rf"offset {region.size - 3} \+ length 4 is outside "
                                          rf"region .* of size {region.size}"):
        region.read(region.size - 3, 4)
    assert isinstance(BoundsError("x"), IndexError)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_typed_access_must_be_aligned(region, width):
    load = getattr(region, f"load_u{width * 8}")
    store = getattr(region, f"store_u{width * 8}")
    with pytest.raises(BoundsError, match=f"not aligned to {width} bytes"):
        load(1)
    with pytest.raises(BoundsError, match=f"not aligned to {width} bytes"):
        store(width + 1, 0)


@pytest.mark.parametrize("width", [8, 16, 32, 64])
def test_typed_loads_and_stores_round_trip_little_endian(region, width):
    top = (1 << width) - 1
    store, load = getattr(region, f"store_u{width}"), getattr(region, f"load_u{width}")
    store(64, top)
    assert load(64) == top
    value = 0x0102030405060708 & top
    store(128, value)
    assert load(128) == value
    assert int.from_bytes(region.read(128, width // 8), "little") == value
    with pytest.raises(OverflowError, match=f"value {top + 1} does not fit in u{width}"):
        store(64, top + 1)
    with pytest.raises(OverflowError, match="value -1 does not fit"):
        store(64, -1)
    assert load(64) == top


def test_view_is_zero_copy_and_pins_the_mapping(region):
    view = region.view(4096, 64)
    view[:] = 7
    assert region.load_u8(4096) == 7 and region.load_u8(4096 + 63) == 7
    region.store_u8(4100, 9)
    assert view[4] == 9
    with pytest.raises(BufferError, match="1 buffer view"):
        region.close()
    del view
    region.close()
    assert region.closed
    with pytest.raises(ValueError, match="is closed"):
        region.load_u8(0)
    region.close()  # closing twice is harmless


def test_memoryview_and_address_helpers(region):
    with memoryview(region) as view:
        assert view.nbytes == region.size and not view.readonly
    assert region.address(0) == region.base
    assert region.offset_of(region.address(12345)) == 12345
    assert region.address(region.size) == region.base + region.size


def test_create_applies_mode_exactly_despite_umask(pool_path):
    old = os.umask(0o077)
    try:
        create_region(pool_path, 4096, mode=0o640).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o640
    os.unlink(pool_path)
    create_region(pool_path, 4096).close()
    assert stat.S_IMODE(os.stat(pool_path).st_mode) == 0o600


def test_create_with_group(pool_path):
    gid = os.getgroups()[0] if os.getgroups() else os.getgid()
    create_region(pool_path, 4096, mode=0o660, group=gid).close()
    assert os.stat(pool_path).st_gid == gid
    with pytest.raises(ConfigError, match="group 'no-such-group-tract' does not exist"):
        create_region(pool_path + "x", 4096, group="no-such-group-tract")
    assert not os.path.exists(pool_path + "x")


def test_create_refuses_existing_and_bad_sizes(pool_path):
    create_region(pool_path, 4096).close()
    with pytest.raises(FileExistsError):
        create_region(pool_path, 4096)
    for size in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="positive number of bytes"):
            create_region(pool_path + ".new", size)
    with pytest.raises(ConfigError, match="not a permission mode"):
        create_region(pool_path + ".new", 4096, mode=0o17777)


def test_open_refuses_a_file_of_the_wrong_size(pool_path):
    create_region(pool_path, 8192).close()
    with pytest.raises(ConfigError, match=r"has 8192 bytes, expected 4096"):
        open_region(pool_path, size=4096)
    open_region(pool_path, size=8192).close()
    with pytest.raises(ConfigError, match="only DAX devices take an offset"):
        open_region(pool_path, offset=4096)


def test_open_refuses_empty_files_directories_and_missing_paths(pool_path, tmp_path):
    open(pool_path, "w").close()
    with pytest.raises(ConfigError, match="positive number of bytes, got 0"):
        open_region(pool_path)
    with pytest.raises(IsADirectoryError):
        open_region(tmp_path)
    with pytest.raises(FileNotFoundError):
        open_region(tmp_path / "missing")


def test_coherence_and_flush_configuration_is_checked(pool_path):
    with pytest.raises(ConfigError, match="coherence must be one of"):
        create_region(pool_path, 4096, coherence="sometimes")
    with pytest.raises(ConfigError, match="flush instruction must be one of"):
        create_region(pool_path, 4096, flush="wbinvd")
    assert not os.path.exists(pool_path)
    region = create_region(pool_path, 4096, coherence="hardware")
    assert region.cache_control.flush == "none"
    region.store_u64(0, 5)
    region.flush(0, 64)
    region.invalidate(0, 64)
    region.fence()
    assert region.load_u64(0) == 5
    region.close()


SIZES = [0, 1, 63, 64, 65, 4095, 4096, 2 * MIB - 1, 2 * MIB, 2 * MIB + 1]


def _kinds():
    names = ["none"] + [k for k, f in (("sse2", "sse2"), ("avx2", "avx2"), ("avx512", "avx512f"))
                        if platform.cpu_features()[f]]
    return names


@pytest.fixture(scope="module")
def copy_regions():
    path = f"/dev/shm/tract-test-copies-{os.getpid()}"
    size = 4 * MIB + 8192
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    regions = {kind: map_fd(fd, size, 0, path, "file", _with_nt(kind)) for kind in _kinds()}
    os.close(fd)
    os.unlink(path)
    yield regions
    for region in regions.values():
        region.close()


def _with_nt(kind):
    import dataclasses
    return dataclasses.replace(platform.default_cache_control(), nontemporal=kind)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", [0, 64, 1, 7, 63, 4095])
def test_nontemporal_and_plain_copies_give_identical_bytes(copy_regions, size, offset):
    source = numpy.random.default_rng(size + offset).integers(0, 256, size, dtype=numpy.uint8)
    guard = 8192 + size + offset
    for kind, region in copy_regions.items():
        for nontemporal in (True, False):
            region.fill(0, guard + 64, 0x5A)
            region.copy_in(offset, source, nontemporal=nontemporal)
            out = numpy.zeros(size, dtype=numpy.uint8)
            region.copy_out(offset, out)
            assert numpy.array_equal(out, source), (kind, nontemporal)
            around = region.view(0, guard + 64)
            assert (around[:offset] == 0x5A).all(), (kind, nontemporal, "before")
            assert (around[offset + size:] == 0x5A).all(), (kind, nontemporal, "after")
            del around


@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "digests"])
@pytest.mark.parametrize("piece", [0, 256, 4160])
def test_block_copies_move_exactly_their_bytes(copy_regions, checksums, piece):
    """`copy_in_blocks` and `copy_out_blocks`, with and without digests, for
    every copy kind, several buffers of whole pieces, at aligned and
    unaligned offsets: the bytes land where a reference copy puts them,
    nothing around them changes, and the copy out delivers them (a copy
    replaced by a fill, or a partial line lost, fails here)."""
    rng = numpy.random.default_rng(piece * 2 + checksums)
    unit = piece or 1000
    offsets = numpy.array([64, 70_007, 300_063], dtype=numpy.int64)
    for kind, region in copy_regions.items():
        sources = [rng.integers(0, 256, unit * n, dtype=numpy.uint8) for n in (1, 3, 2)]
        region.fill(0, region.size, 0x5A)
        expected = numpy.full(region.size, 0x5A, dtype=numpy.uint8)
        for at, source in zip(offsets, sources):
            expected[at:at + source.size] = source
        count = sum(source.size // unit for source in sources) if piece else len(sources)
        sums_in = numpy.zeros(count, numpy.uint64) if checksums else None
        region.copy_in_blocks(offsets, sources, sums_in, 9, piece)
        whole = region.view(0, region.size)
        assert numpy.array_equal(whole, expected), kind
        del whole
        targets = [numpy.zeros_like(source) for source in sources]
        sums_out = numpy.zeros(count, numpy.uint64) if checksums else None
        region.copy_out_blocks(offsets, targets, sums_out, 9, piece)
        for target, source in zip(targets, sources):
            assert numpy.array_equal(target, source), kind
        if checksums:
            assert numpy.array_equal(sums_in, sums_out), kind
            assert int(sums_in[0]) == digest(sources[0][:unit], 9), kind


@pytest.mark.parametrize("checksums", [False, True], ids=["plain", "digests"])
def test_a_big_copy_out_streams_exactly_its_bytes(copy_regions, checksums):
    """A `copy_out_blocks` batch of `STREAM_OUT_BYTES` or more goes into its
    targets by streaming stores: for every copy kind, into line-aligned and
    unaligned targets of whole and partial lines, each target gets exactly
    its bytes and nothing beside them changes, the digests are those of the
    bytes, and the trace is the reference's: each range dropped, one fence
    (the fence that makes the targets' streaming stores visible is no
    protocol step, so it is not traced)."""
    from tract._native._region import STREAM_OUT_BYTES

    rng = numpy.random.default_rng(checksums)
    piece = 4100  # no whole number of lines: every target ends mid-line
    sizes = [piece * 210, piece * 160, piece * 150]  # 2.1 MB in all
    assert sum(sizes) >= STREAM_OUT_BYTES
    offsets = numpy.array([0, sizes[0] + 64, sizes[0] + sizes[1] + 192], dtype=numpy.int64)
    sources = [rng.integers(0, 256, size, dtype=numpy.uint8) for size in sizes]
    for kind, region in copy_regions.items():
        region.copy_in_blocks(offsets, sources)
        for shift in (0, 8, 24):  # targets at a line, and off it
            backing = [numpy.full(size + 128, 0x5A, dtype=numpy.uint8) for size in sizes]
            starts = [(-b.ctypes.data % 64) + shift for b in backing]
            targets = [b[start:start + size] for b, start, size in zip(backing, starts, sizes)]
            count = sum(size // piece for size in sizes)
            sums = numpy.zeros(count, numpy.uint64) if checksums else None
            region.trace_start(1 << 16)
            region.copy_out_blocks(offsets, targets, sums, 9, piece)
            big = region.trace_stop()
            for b, start, size, source in zip(backing, starts, sizes, sources):
                assert numpy.array_equal(b[start:start + size], source), (kind, shift)
                assert (b[:start] == 0x5A).all() and (b[start + size:] == 0x5A).all(), \
                    (kind, shift)
            if checksums:
                want = [digest(source[at:at + piece], 9) for source in sources
                        for at in range(0, source.size, piece)]
                assert sums.tolist() == want, (kind, shift)
            region.trace_start(1 << 16)  # the reference: each range dropped, one fence
            for offset, size in zip(offsets.tolist(), sizes):
                region.invalidate(offset, size, payload=True)
            region.fence()
            assert big.tolist() == region.trace_stop().tolist(), (kind, shift)


def test_the_trace_records_each_primitive_of_its_own_thread(region):
    """Every line a flush, invalidate or write-back touches, with its
    instruction, and every fence, in order; nothing of another thread,
    nothing while off; an overflow is an error, not a short trace."""
    control = region.cache_control
    flush, invalidate, payload, writeback = (
        INSTRUCTIONS[name] for name in
        (control.flush, control.invalidate, control.payload, control.writeback))
    region.flush(0, 64)  # off: nothing recorded
    region.trace_start(64)
    with pytest.raises(RuntimeError, match="already on"):
        region.trace_start()
    region.flush(70, 100)
    region.fence()
    region.invalidate(4096, 1, payload=True)
    region.invalidate_lines(numpy.array([128, 64], dtype=numpy.int64))
    region.store_fence()
    import threading
    other = threading.Thread(target=lambda: (region.flush(0, 4096), region.fence()))
    other.start()
    other.join()
    region.flush_lines(numpy.array([192], dtype=numpy.int64))
    region.writeback(260, 10)
    region.load_fence()
    region.flush(0, 0)
    assert region.trace_stop().tolist() == [
        [flush, 64], [flush, 128], [TRACE_FENCE, -1], [payload, 4096],
        [invalidate, 128], [invalidate, 64], [TRACE_STORE_FENCE, -1], [flush, 192],
        [writeback, 256], [TRACE_LOAD_FENCE, -1]]
    with pytest.raises(RuntimeError, match="no cache-control trace is on"):
        region.trace_stop()
    region.trace_start(3)
    region.flush(0, 256)
    with pytest.raises(OverflowError, match="held 3 entries and 4 were made"):
        region.trace_stop()
    with pytest.raises(ValueError, match="capacity must be positive"):
        region.trace_start(0)


def test_native_copies_trace_what_the_simulator_models(copy_regions):
    """Each copy kind, plain and checksummed, of whole blocks and pieces, at
    random offsets and sizes: the write-backs and store fences the native
    copy issues are those `SimHost` models for it (the lines it does not
    stream whole, one store fence per batch), and so the simulated proofs
    of the protocol steps hold for the native copies."""
    from tract.testing.incoherent import SimPool

    rng = numpy.random.default_rng(12)
    for kind, region in copy_regions.items():
        for _ in range(40):
            piece = int(rng.choice([0, 64, 200, 241, 256, 1000, 4160]))
            count = int(rng.integers(1, 4))
            sizes = [piece * int(rng.integers(1, 4)) if piece else int(rng.integers(1, 9000))
                     for _ in range(count)]
            offsets = numpy.cumsum([int(rng.integers(0, 200)) + (0 if i == 0 else sizes[i - 1])
                                    for i in range(count)]).astype(numpy.int64)
            sources = [rng.integers(0, 256, size, dtype=numpy.uint8) for size in sizes]
            checksums = bool(rng.integers(2))
            digests = sum(size // piece if piece else 1 for size in sizes)
            traces = []
            simulated = SimPool(region.size, hosts=1, seed=0, chaos=0.0)
            for target in (region, simulated.hosts[0]):
                def step(target=target):
                    sums = numpy.zeros(digests, numpy.uint64) if checksums else None
                    target.copy_in_blocks(offsets, sources, sums, 3, piece)
                    target.copy_in(int(offsets[0]), sources[0])
                    outs = [numpy.zeros_like(source) for source in sources]
                    target.copy_out_blocks(offsets, outs, sums, 3, piece)
                if target is region:
                    target.trace_start(4096)
                    step()
                else:
                    target.trace_control = region.cache_control
                    target.trace_start(4096)
                    simulated.run(lambda host: step())
                traces.append(target.trace_stop().tolist())
            assert traces[0] == traces[1], (kind, piece, sizes, offsets.tolist(), checksums)
            assert traces[0].count([TRACE_STORE_FENCE, -1]) == 2


def test_digest_blocks_hash_what_the_simulator_hashes(copy_regions):
    """`digest_blocks` (the digests of bytes a DMA engine moved): the same
    digests as `digest` of each piece, as `SimHost` computes them, and no
    cache control; bad shapes are refused before anything is read."""
    from tract._native._region import digest
    from tract.testing.incoherent import SimPool

    rng = numpy.random.default_rng(13)
    region = copy_regions["none"]
    region.copy_in(0, rng.integers(0, 256, 1 << 16, dtype=numpy.uint8))
    for _ in range(40):
        piece = int(rng.choice([0, 64, 200, 241, 256, 1000, 4160]))
        length = piece * int(rng.integers(1, 4)) if piece else int(rng.integers(1, 9000))
        count = int(rng.integers(1, 4))
        offsets = (numpy.arange(count) * (length + int(rng.integers(0, 200)))
                   + int(rng.integers(0, 200))).astype(numpy.int64)
        size = piece or length
        want = [digest(region.view(int(offset) + at, size), 5)
                for offset in offsets for at in range(0, length, size)]
        simulated = SimPool(region.size, hosts=1, seed=0, chaos=0.0)
        simulated.hosts[0].copy_in(0, region.read(0, 1 << 16), nontemporal=False)
        for target in (region, simulated.hosts[0]):
            sums = numpy.zeros(len(want), numpy.uint64)
            target.trace_start(4096)
            target.digest_blocks(offsets, length, sums, 5, piece)
            assert target.trace_stop().tolist() == []
            assert sums.tolist() == want, (piece, length, offsets.tolist())
    sums = numpy.zeros(2, numpy.uint64)
    with pytest.raises(ValueError, match="not a whole number of 64-byte pieces"):
        region.digest_blocks(numpy.zeros(1, numpy.int64), 100, sums, 0, 64)
    with pytest.raises(ValueError, match="sums must hold 1 digests, got 2"):
        region.digest_blocks(numpy.zeros(1, numpy.int64), 100, sums)
    with pytest.raises(BoundsError):
        region.digest_blocks(numpy.array([0, region.size - 10], numpy.int64), 100, sums)


def test_copy_accepts_any_contiguous_buffer_and_refuses_others(region):
    region.copy_in(0, bytearray(b"abc"))
    region.copy_in(3, memoryview(b"def"))
    region.copy_in(6, numpy.arange(2, dtype=numpy.uint16))
    assert region.read(0, 10) == b"abcdef\x00\x00\x01\x00"
    strided = numpy.arange(16, dtype=numpy.uint8)[::2]
    with pytest.raises(ValueError, match="copy_in source must be a C-contiguous buffer"):
        region.copy_in(0, strided)
    with pytest.raises(BufferError, match="copy_out target must be a writable"):
        region.copy_out(0, b"read-only")
    with pytest.raises(TypeError, match=r"copy_in source must be .* \(got int\)"):
        region.copy_in(0, 5)


def test_fill_checks_its_byte(region):
    with pytest.raises(ValueError, match="fill byte 256"):
        region.fill(0, 4, 256)


def test_public_api_is_explicit():
    for name in tract.__all__:
        assert hasattr(tract, name), name


def test_load_u64s_reads_a_line_of_fields(region):
    for index in range(8):
        region.store_u64(64 + 8 * index, index * 3)
    assert region.load_u64s(64, 8) == tuple(index * 3 for index in range(8))
    assert region.load_u64s(64, 0) == ()
    with pytest.raises(BoundsError, match="not aligned to 8"):
        region.load_u64s(4, 1)
    with pytest.raises(BoundsError, match="outside region"):
        region.load_u64s(region.size - 8, 2)


# ------------------------------------------------------------ shadow memory

SHADOW = 16 * 1024


@pytest.fixture(scope="module")
def shadow_regions():
    """A 64 KiB region per (flush instruction, streaming kind) this CPU has."""
    import dataclasses
    path = f"/dev/shm/tract-test-shadow-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, 64 * 1024)
    regions = {}
    for flush in platform.FLUSH_CHOICES:
        if not platform.cpu_features()[flush]:
            continue
        for kind in _kinds():
            control = dataclasses.replace(platform.cache_control(flush), nontemporal=kind)
            regions[flush, kind] = map_fd(fd, 64 * 1024, 0, path, "file", control)
    os.close(fd)
    os.unlink(path)
    yield regions
    for region in regions.values():
        region.close()


def _lines_of(offset, length):
    return range(offset // 64 * 64, offset + length, 64) if length else range(0)


def _shadowed(region, rng):
    """Random bytes in the cache and other random bytes in memory, the
    shadow on; (memory, the cache's bytes at the start)."""
    cache = rng.integers(0, 256, SHADOW, dtype=numpy.uint8)
    region.copy_in(0, cache, nontemporal=False)
    memory = rng.integers(0, 256, SHADOW, dtype=numpy.uint8)
    region.trace_start(1 << 14, memory=memory)
    return memory, cache


def test_the_shadow_moves_exactly_the_lines_a_fence_completes(shadow_regions):
    """Under the shadow memory each write-back primitive carries to memory
    exactly the lines of its range that the cache holds dirty, as they were
    when it ran, once a fence completes it; an invalidation refetches
    exactly its lines, at the fence; what no fence completed moved nothing.
    The expectations are drawn here, line by line, not from a reference
    that runs the same primitives."""
    rng = numpy.random.default_rng(50)
    for (flush, kind), region in shadow_regions.items():
        for trial in range(40):
            offset = int(rng.integers(0, SHADOW - 2048))
            length = int(rng.integers(0, 1500))
            data = rng.integers(0, 256, length, dtype=numpy.uint8)
            how = ["flush", "writeback", "flush_lines", "unfenced"][trial % 4]
            memory, cache = _shadowed(region, rng)
            region.copy_in(offset, data, nontemporal=False)
            cache[offset:offset + length] = data
            if how == "flush_lines":
                offsets = numpy.array(list(_lines_of(offset, length)), dtype=numpy.int64)
                region.flush_lines(offsets)
            else:
                getattr(region, "writeback" if how == "writeback" else "flush")(offset, length)
            stored_after = offset + length < SHADOW and how != "unfenced"
            if stored_after:  # a store after the write-back: not carried
                region.store_u8(offset + length, int(cache[offset + length]) ^ 0xFF)
            before = memory.copy()
            if how != "unfenced":
                region.fence()
            region.trace_stop()
            expected = before.copy()
            if how != "unfenced":
                for line in _lines_of(offset, length):
                    expected[line:line + 64] = cache[line:line + 64]
            at = (flush, kind, trial, how, offset, length)
            assert numpy.array_equal(memory, expected), at
            if stored_after:
                region.store_u8(offset + length, int(cache[offset + length]))

            memory, cache = _shadowed(region, rng)
            region.invalidate(offset, length)
            stale = numpy.frombuffer(region.read(0, SHADOW), dtype=numpy.uint8).copy()
            assert numpy.array_equal(stale, cache), at  # not before the fence
            region.fence()
            region.trace_stop()
            fresh = numpy.frombuffer(region.read(0, SHADOW), dtype=numpy.uint8)
            expected = cache.copy()
            for line in _lines_of(offset, length):
                expected[line:line + 64] = memory[line:line + 64]
            assert numpy.array_equal(fresh, expected), at


def test_the_shadow_sees_every_copy_reach_memory(shadow_regions):
    """Under the shadow memory, a non-temporal copy in (streaming stores,
    the partial end lines written back, the store fence), a batch of block
    copies, plain or checksummed, each leave in memory exactly their bytes
    and, on the partial end lines, the cache's own; and a copy out after an
    invalidation and its fence reads memory, before the fence the cache."""
    rng = numpy.random.default_rng(51)
    for (flush, kind), region in shadow_regions.items():
        for trial in range(30):
            sizes = [int(rng.integers(1, 3000)) for _ in range(int(rng.integers(1, 4)))]
            offsets, at = [], int(rng.integers(0, 200))
            for size in sizes:
                offsets.append(at)
                at += size + int(rng.integers(0, 300))
            sources = [rng.integers(0, 256, size, dtype=numpy.uint8) for size in sizes]
            how = ["copy_in", "blocks", "digests"][trial % 3]
            memory, cache = _shadowed(region, rng)
            if how == "copy_in":
                for offset, source in zip(offsets, sources):
                    region.copy_in(offset, source)
            else:
                sums = numpy.zeros(len(sizes), numpy.uint64) if how == "digests" else None
                region.copy_in_blocks(numpy.array(offsets, numpy.int64), sources, sums)
            region.trace_stop()
            expected = memory.copy()
            for offset, source in zip(offsets, sources):
                for line in _lines_of(offset, source.size):
                    expected[line:line + 64] = cache[line:line + 64]
            for offset, source in zip(offsets, sources):
                expected[offset:offset + source.size] = source
            assert numpy.array_equal(memory, expected), (flush, kind, trial, how)

            memory, cache = _shadowed(region, rng)
            early = numpy.zeros(sizes[0], numpy.uint8)
            region.invalidate(offsets[0], sizes[0])
            region.copy_out(offsets[0], early)
            region.fence()
            targets = [numpy.zeros(size, numpy.uint8) for size in sizes]
            region.copy_out_blocks(numpy.array(offsets, numpy.int64), targets)
            region.trace_stop()
            assert numpy.array_equal(early, cache[offsets[0]:offsets[0] + sizes[0]])
            for offset, target in zip(offsets, targets):
                assert numpy.array_equal(target, memory[offset:offset + target.size])


def test_the_shadow_is_refused_when_it_does_not_fit(region):
    with pytest.raises(ValueError, match="whole 64-byte lines"):
        region.trace_start(memory=numpy.zeros(100, numpy.uint8))
    with pytest.raises(ValueError, match="at most the mapping's"):
        region.trace_start(memory=numpy.zeros(region.size + 64, numpy.uint8))
