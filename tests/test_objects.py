"""The object store: whole records or none under the non-coherent simulator,
names and ranges checked, and natively across processes.

Tests marked ``sim`` are the suite the mutation harness runs against every
mutant of tract.objects (TRACT_SIM_SEEDS sets the seeds).
"""

import random

import pytest

from tract.errors import CorruptionError, PoolFull
from tract.fsck import fsck
from tract.objects import RECORD_BYTES
from tract.pool import Pool, format_pool
from tract.testing.incoherent import SimPool, SimulationFailure
from tract.testing.seeds import count, seeds

SEEDS = count()
SIM_LEASE = 0.004
NAMES = ("kv/a", "kv/b", "index-root", "c")


def _sim_pool(seed, nodes, chaos=0.3):
    pool = SimPool(128 * 1024, hosts=nodes, seed=seed, chaos=chaos, max_steps=400_000)
    format_pool(pool.hosts[0], max_nodes=nodes, locks=("alloc", "objects"), max_locks=2,
                chunk_size=8192, max_objects=8, index_capacity=64, lock_mode="bakery",
                lease_timeout=SIM_LEASE, hash_key=pool.hash_key)
    for host in pool.hosts:
        host.invalidate(0, pool.size)
        host.fence()
    return pool


def run_objects(seed, rounds=6, chaos=0.3):
    """Two writers put and delete records (each its own names, sharing the
    directory's slots and probe chains) whose fields agree with each other (size and kind derive from the offset) while a reader on a third
    host looks them up: it sees whole records or none, never a mix; the
    final directory matches the writers' model."""
    pool = _sim_pool(seed, 3, chaos)
    rng = random.Random(seed)
    model: dict[str, tuple[int, int, int]] = {}
    handles = [Pool(host, node, clock=pool.clock, heartbeat=False, local_locks=False)
               for node, host in enumerate(pool.hosts)]
    heap = handles[0].header.heap
    done = []

    def writer(node):
        def body(host):
            objects = handles[node].objects
            for _ in range(rounds):
                name = rng.choice(NAMES[2 * node:2 * node + 2])  # its own names
                if name in model and rng.random() < 0.4:
                    objects.delete(name, timeout=50 * SIM_LEASE)
                    del model[name]
                else:
                    slot = rng.randrange(1, 40)
                    offset, size, kind = heap + 64 * slot, 64 * slot, slot * 7
                    objects.put(name, offset, size, kind, timeout=50 * SIM_LEASE)
                    model[name] = (offset, size, kind)
            done.append(node)
        return body

    def reader(host):
        objects = handles[2].objects
        while len(done) < 2:
            for name in NAMES:
                record = objects.get(name)
                if record is not None and (record.size != record.offset - heap
                                           or record.kind != record.size // 64 * 7
                                           or record.name != name):
                    raise AssertionError(f"a mixed record: {record}")
            pool.clock.sleep(1e-5)

    pool.run(writer(0), writer(1), reader)
    if pool.lost_updates:
        raise SimulationFailure(f"lost update at {pool.lost_updates[0].line_offset}", seed)
    final = {}

    def listing(host):
        final.update({r.name: (r.offset, r.size, r.kind) for r in handles[2].objects.list()})

    pool.run((2, listing))
    if final != model:
        raise SimulationFailure(f"directory {final} != model {model}", seed)


@pytest.mark.sim
def test_readers_see_whole_records_under_every_seed():
    for seed in seeds(SEEDS):
        run_objects(seed)


# ------------------------------------------------------------- native runs

@pytest.fixture
def pool(pool_path):
    Pool.create(pool_path, 8 << 20, chunk_size=1 << 16, max_nodes=4, max_objects=8,
                lease_timeout=0.5)
    with Pool.open(pool_path, 0, manager=True) as handle:
        yield handle


def test_put_get_replace_delete_list(pool):
    objects = pool.objects
    offset = pool.alloc(10_000)
    first = objects.put("kv/root", offset, 10_000, kind=3)
    assert objects.get("kv/root") == first and first.version == 1 and first.writer == 0
    second = objects.put("kv/root", offset, 5_000, kind=4)
    assert second.version == 2 and objects.get("kv/root").size == 5_000
    assert [r.name for r in objects.list()] == ["kv/root"]
    assert objects.delete("kv/root") == second
    assert objects.get("kv/root") is None and objects.list() == []
    with pytest.raises(KeyError, match="no object named 'kv/root'"):
        objects.delete("kv/root")
    again = objects.put("kv/root", offset, 1, kind=0)  # a tombstone is reused
    assert again.version == 1 or again.version > second.version


@pytest.mark.parametrize("name", ["", "a" * 65, "has space", "naïve", "tab\t", 7])
def test_bad_names_are_refused(pool, name):
    with pytest.raises(ValueError, match="object name"):
        pool.objects.put(name, pool.header.heap, 64)


def test_ranges_outside_the_heap_are_refused(pool):
    heap, end = pool.header.heap, pool.header.heap_end
    for offset, size in ((0, 64), (heap - 64, 64), (end - 64, 128), (heap, 0), (heap, -1)):
        with pytest.raises(ValueError, match="is not inside the heap"):
            pool.objects.put("x", offset, size)
    with pytest.raises(ValueError, match="kind"):
        pool.objects.put("x", heap, 64, kind=-1)


def test_a_full_directory_says_so(pool):
    for index in range(8):
        pool.objects.put(f"o{index}", pool.header.heap, 64)
    with pytest.raises(PoolFull, match="object directory of 8 records is full"):
        pool.objects.put("one-more", pool.header.heap, 64)
    pool.objects.put("o3", pool.header.heap, 128)  # replacing still works


def test_a_torn_record_is_reported_then_repaired(pool_path):
    Pool.create(pool_path, 8 << 20, chunk_size=1 << 16, max_nodes=4, lease_timeout=0.2)
    with Pool.open(pool_path, 0, manager=True) as pool:
        offset = pool.alloc(4096)
        pool.objects.put("victim", offset, 4096)
        index = next(i for i in range(pool.header.max_objects)
                     if pool.region.load_u64(pool.header.objects + i * RECORD_BYTES))
        line = pool.header.objects + index * RECORD_BYTES
        pool.region.store_u64(line + 16, 12345)  # size changed, check word not
        pool.region.flush(line, 64)
        pool.region.fence()
        with pytest.raises(CorruptionError, match="stays torn"):
            pool.objects.get("victim")
        report = fsck(pool_path, repair=True, node=1, watch=False)
        assert report["repaired"] and report["ok"]
        assert pool.objects.get("victim") is None
        pool.free(offset)
