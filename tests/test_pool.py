"""Pool layout and lifecycle: what open refuses, what the CLI shows, and
that nothing outside the mapping is touched by a bad pool."""

import json
import os
import subprocess
import sys

import pytest

from tract.cli import main
from tract.errors import ConfigError, CorruptionError
from tract.pool import _F, LAYOUT_VERSION, NodeLocal, Pool
from tract.region import open_region
from tract.testing.seeds import count, seeds


def _create(path, **options):
    Pool.create(path, options.pop("size", 8 << 20), chunk_size=options.pop("chunk", 1 << 16),
                max_nodes=4, lease_timeout=0.5, **options)


def _poke(path, field, value):
    region = open_region(path)
    region.store_u64(_F[field], value)
    region.flush(_F[field], 8)
    region.fence()
    region.close()


def test_a_truncated_pool_is_refused(pool_path):
    _create(pool_path)
    os.truncate(pool_path, 6 << 20)
    with pytest.raises(CorruptionError, match=r"header says 8388608 bytes, the mapping has "
                                              r"6291456 \(truncated"):
        Pool.open(pool_path, 0)
    os.truncate(pool_path, 100)
    with pytest.raises(CorruptionError, match="smaller than a pool header"):
        Pool.open(pool_path, 0)


def test_another_layout_version_is_refused(pool_path):
    _create(pool_path)
    _poke(pool_path, "version", LAYOUT_VERSION + 1)
    with pytest.raises(CorruptionError, match=f"layout version {LAYOUT_VERSION + 1}, this tract "
                                              f"reads version {LAYOUT_VERSION}"):
        Pool.open(pool_path, 0)


def test_a_random_file_is_refused(pool_path):
    with open(pool_path, "wb") as handle:
        handle.write(os.urandom(1 << 16))
    with pytest.raises(CorruptionError, match="is not a tract pool: magic"):
        Pool.open(pool_path, 0)


@pytest.mark.parametrize("field, value, message", [
    ("objects", 4096, "field objects .* expected"),
    ("heap", 1 << 40, "field heap .* expected"),
    ("chunk_size", 12345, "chunk_size .* expected a power of two"),
    ("max_nodes", 0, "max_nodes .* expected 1..256"),
    ("index_capacity", 3, "index_capacity .* expected a power of two"),
])
def test_areas_that_disagree_are_refused(pool_path, field, value, message):
    _create(pool_path)
    _poke(pool_path, field, value)
    with pytest.raises(CorruptionError, match=message):
        Pool.open(pool_path, 0)


def test_node_beyond_max_nodes_and_bad_parameters(pool_path):
    _create(pool_path)
    with pytest.raises(ConfigError, match=r"node 4 is beyond this pool's max_nodes \(4\)"):
        Pool.open(pool_path, 4)
    for options, message in (({"chunk": 3000}, "chunk_size must be a power of two"),
                             ({"size": 1 << 20, "chunk": 1 << 20}, "needs at least"),
                             ({"max_objects": 0}, "max_objects"),
                             ({"index_capacity": 100}, "index_capacity must be a power"),
                             ({"locks": ("alloc",)}, "needs a lock named 'objects'")):
        with pytest.raises(ConfigError, match=message):
            _create(pool_path + "-bad", **options)
        assert not os.path.exists(pool_path + "-bad")


def test_every_process_of_a_node_shares_its_incarnation(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 1) as first:
        with Pool.open(pool_path, 1) as second:  # another process of the same node
            assert second.epoch == first.epoch
    with Pool.open(pool_path, 1) as later:  # the node restarted: a new incarnation
        assert later.epoch == first.epoch + 1


def test_cli_create_info_fsck_destroy(pool_path, capsys):
    assert main(["pool", "create", pool_path, "--size", "16M", "--chunk-size", "256K",
                 "--max-nodes", "4", "--max-objects", "32", "--lease", "0.5"]) == 0
    with Pool.open(pool_path, 0, manager=True) as pool:
        pool.objects.put("root", pool.alloc(200_000), 200_000)  # more than a slab serves
        capsys.readouterr()
        assert main(["pool", "info", pool_path, "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["chunk_size"] == 256 << 10 and info["objects"] == 1
        assert info["chunks"]["taken"] == 1 and info["max_objects"] == 32
        assert info["nodes"] == [dict(node=0, state="alive", epoch=1, heartbeat="beating")]
        assert info["manager"]["node"] == 0
        assert {lock["name"] for lock in info["locks"]} == {"alloc", "objects", "index"}
        assert main(["pool", "info", pool_path]) == 0
        assert "heap" in capsys.readouterr().out
        assert main(["pool", "fsck", pool_path, "--json", "--no-watch"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and report["chunks"]["referenced"] == 1
    with pytest.raises(SystemExit, match="needs --node|give --node"):
        main(["pool", "fsck", pool_path, "--repair"])
    assert main(["pool", "destroy", pool_path]) == 0
    assert not os.path.exists(pool_path)


def test_fsck_finds_and_repairs_a_corrupted_allocator(pool_path):
    _create(pool_path)
    with Pool.open(pool_path, 0, manager=True) as pool:
        kept = pool.allocator.alloc_chunks(2)
        pool.objects.put("kept", pool.allocator.offset_of(kept), 2 * pool.header.chunk_size)
        layout = pool.alloc_layout
        pool.region.store_u64(layout.bitmap, pool.region.load_u64(layout.bitmap) | 1 << 20)
        pool.region.flush(layout.bitmap, 64)
        stale = layout.owner(30)
        pool.region.store_u64(stale, 1 | 2 << 16)  # an owner record on a free chunk
        pool.region.store_u64(stale + 16, 1)
        pool.region.flush(stale, 64)
        pool.region.fence()
        report = subprocess.run([sys.executable, "-m", "tract.cli", "pool", "fsck", pool_path,
                                 "--json", "--no-watch"], capture_output=True, text=True)
        assert report.returncode == 1
        problems = json.loads(report.stdout)["problems"]
        assert any("chunk 20 is taken in the bitmap with no owner" in p["problem"]
                   for p in problems)
        assert any("chunk 30 is free in the bitmap but" in p["problem"] for p in problems)
        repaired = subprocess.run([sys.executable, "-m", "tract.cli", "pool", "fsck", pool_path,
                                   "--repair", "--node", "1", "--no-watch"],
                                  capture_output=True, text=True)
        assert repaired.returncode == 0, repaired.stdout + repaired.stderr
        assert "returned chunks 20..20" in repaired.stdout
        after = subprocess.run([sys.executable, "-m", "tract.cli", "pool", "fsck", pool_path,
                                "--json", "--no-watch"], capture_output=True, text=True)
        assert json.loads(after.stdout)["ok"]
        assert pool.objects.get("kept").size == 2 * pool.header.chunk_size


# ------------------------------------------------- publishing a pool, simulated

def _published(seed, chaos):
    """Host 0 formats a pool while host 1 polls for its magic: once host 1
    sees it, the header it reads must match host 0's field for field, and
    once `format_pool` has returned host 1 must see it (host 0 touches no
    line after it returns: nothing but `format_pool`'s own flushes and fence
    may have made it visible).  Then host 0 unpublishes it and host 1 must
    find it gone.  Returns the simulator."""
    from tract.pool import Header, format_pool, unpublish
    from tract.testing.incoherent import SimPool, SimulationFailure

    sim = SimPool(64 * 1024, hosts=2, seed=seed, chaos=chaos, max_steps=60_000)
    seen = {}
    done = []

    def fields(header):
        return (header.size, header.max_nodes, header.max_locks, header.chunk_size,
                header.lock_names, header.uuid, header.hash_key, header.heap)

    def formatter(host):
        format_pool(host, max_nodes=2, locks=("alloc", "objects"), max_locks=2,
                    chunk_size=8192, max_objects=16, index_capacity=64, lease_timeout=0.004,
                    hash_key=sim.hash_key)
        done.append("formatted")
        while len(done) < 2:
            sim.clock.sleep(1e-5)
        seen["formatted"] = fields(Header(host))
        unpublish(host)
        done.append("unpublished")

    def opener(host):
        while True:
            returned = bool(done)  # judged before the attempt
            try:
                header = Header(host)
                break
            except CorruptionError as error:
                if "is not a tract pool" not in str(error):
                    raise
                if returned:
                    raise SimulationFailure("host 1 does not see the pool after format_pool "
                                            "returned on host 0", seed) from error
                # not published yet: poll again at once (a magic written back
                # before the header's lines shows for only a few steps)
        seen["opened"] = fields(header)
        done.append("opened")
        while len(done) < 3:
            sim.clock.sleep(1e-5)
        try:
            Header(host)
        except CorruptionError as error:
            if "is not a tract pool" in str(error):
                return
            raise
        raise SimulationFailure("host 1 still opens the pool after host 0 unpublished it", seed)

    sim.run(formatter, opener)
    if seen["opened"] != seen["formatted"]:
        raise SimulationFailure(f"host 1 read a header unlike host 0's: {seen}", seed)
    return sim


@pytest.mark.sim
def test_a_pool_is_published_whole_and_unpublished_for_every_host():
    """R3 (`format_pool`: the header, then the magic; `unpublish`) and R4
    (`Header` reads fresh): under every seed, with and without chaos."""
    for seed in seeds(max(1, count() // 4)):
        _published(seed, chaos=0.3 if seed % 2 else 0.0)


@pytest.mark.sim
def test_a_node_whose_lease_lapsed_allocates_nothing():
    """Self-fencing (R6): a process stalled past half its lease is refused
    an allocation before it touches the allocator's lock (its slabs may be
    another node's already); it rejoins, then allocates."""
    from tract.errors import LeaseLost
    from tract.pool import format_pool
    from tract.testing.incoherent import SimPool

    sim = SimPool(64 * 1024, hosts=1, seed=0, chaos=0.0)
    format_pool(sim.hosts[0], max_nodes=2, locks=("alloc", "objects"), max_locks=2,
                chunk_size=8192, max_objects=16, index_capacity=64, lease_timeout=0.004,
                lock_mode="bakery", hash_key=sim.hash_key)
    handle = Pool(sim.hosts[0], 0, clock=sim.clock, heartbeat=False, local_locks=False,
                  fencing=True)
    handle.free(handle.alloc(3000))
    sim.clock.sleep(0.003)
    request = handle.layout.request_line(0, 0)
    before = sim.memory[request:request + 64].copy()
    for allocate in (lambda: handle.alloc(3000), lambda: handle.alloc_many(3000, 2)):
        with pytest.raises(LeaseLost, match="does not write an allocation"):
            allocate()
    assert (sim.memory[request:request + 64] == before).all()  # not even a lock request
    assert handle.renew()
    kept = handle.alloc(3000)
    sim.clock.sleep(0.003)
    with pytest.raises(LeaseLost, match="does not write a free"):
        handle.free(kept)  # it may be another's allocation by now
    assert handle.renew()
    handle.free(handle.alloc(3000))


def test_destroying_a_pool_with_a_corrupt_header_removes_its_node_local_files(pool_path):
    """The header's uuid names the node-local files: a header corrupt past
    its magic still names them, so destroy leaves nothing in /dev/shm."""
    Pool.create(pool_path, 1 << 20, chunk_size=1 << 16)
    with Pool.open(pool_path, 0) as pool:
        local = NodeLocal.path_of(pool.header, 0)
    assert os.path.exists(local)
    with open(pool_path, "r+b") as raw:  # the layout version: no longer this build's
        raw.seek(_F["version"])
        raw.write((0xDEAD).to_bytes(8, "little"))
    with pytest.raises(CorruptionError):
        Pool.open(pool_path, 0)
    Pool.destroy(pool_path)
    assert not os.path.exists(pool_path) and not os.path.exists(local)
