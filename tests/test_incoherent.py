"""The non-coherent memory simulator, proven on the mailbox protocol.

Tests marked ``sim`` are the mailbox module's simulated suite, which the
mutation harness runs against each mutant (TRACT_SIM_SEEDS sets the seeds).
"""

import json
import os
import time

import numpy
import pytest

from tract.errors import BoundsError, CorruptionError
from tract.testing import mailbox, mutants
from tract.testing.incoherent import LINE, SimPool, SimulationFailure
from tract.testing.seeds import count, seeds

SEEDS = count()
MESSAGES = 6
SLOTS = 2
PAYLOAD = 40


def _payload(seq: int) -> bytes:
    return bytes((seq * 37 + i) & 0xFF for i in range(PAYLOAD - 8)) + seq.to_bytes(8, "little")


def exercise(protocol, seed: int, chaos: float, packed: bool = False) -> SimPool:
    """Send MESSAGES through a ring between two simulated hosts; raise
    SimulationFailure (with the seed) on any wrong or lost byte.  Stale reads
    are not failures here: a poll racing a publication reads the old value
    and polls again, which the protocol allows."""
    ring = protocol.Ring(SLOTS, PAYLOAD, packed=packed)
    pool = SimPool(ring.nbytes, hosts=2, seed=seed, chaos=chaos, max_steps=4000)

    def producer(region):
        for seq in range(MESSAGES):
            protocol.send(region, ring, seq, _payload(seq))

    def consumer(region):
        return [protocol.receive(region, ring, seq) for seq in range(MESSAGES)]

    _, received = pool.run(producer, consumer)
    problems = [f"message {seq} arrived as {message[:12]!r}..." for seq, message in enumerate(received)
                if message != _payload(seq)]
    problems += [f"lost update at {u.line_offset} by host {u.host} over host "
                 f"{u.overwritten_host}" for u in pool.lost_updates[:2]]
    for seq in range(SLOTS):
        flag = ring.flag(seq)
        if int.from_bytes(pool.memory[flag:flag + 8].tobytes(), "little"):
            problems.append(f"slot {seq}'s flag is still set in memory after the run")
    if problems:
        raise SimulationFailure("; ".join(problems), seed)
    return pool


# ----------------------------------------------- the simulated mailbox suite

@pytest.mark.sim
@pytest.mark.parametrize("chaos", [0.0, 0.3], ids=["no-chaos", "chaos"])
def test_mailbox_holds_under_every_seed(chaos):
    for seed in seeds(SEEDS):
        exercise(mailbox, seed, chaos)


@pytest.mark.sim
def test_a_flag_read_once_sees_the_last_publication():
    """R4 for one poll, not only for a loop: a flag published (stored,
    flushed, fenced) by host 1 before host 0 reads it once is what host 0
    reads, though host 0 holds a stale copy of its line (a read whose fence
    comes before its invalidate returns that copy: a poll would only catch up
    one poll later)."""
    ring = mailbox.Ring(SLOTS, PAYLOAD)
    flag = ring.flag(0)
    for seed in seeds(max(1, SEEDS // 20)):
        pool = SimPool(ring.nbytes, hosts=2, seed=seed, chaos=0.0, max_steps=4000)
        published = []

        def reader(region):
            region.load_u64(flag)  # the line is in this host's cache, as 0
            published.append("cached")
            while len(published) < 2:
                pool.clock.sleep(1e-6)
            return mailbox._read_flag(region, ring, flag, 0)

        def writer(region):
            while not published:
                pool.clock.sleep(1e-6)
            region.store_u64(flag, 1)
            region.flush(flag, 8)
            region.fence()
            published.append("published")

        seen, _ = pool.run(reader, writer)
        if seen != 1:
            raise SimulationFailure(f"host 0 read the flag as {seen} after its publication", seed)


# ------------------------------------------------------- broken variants

def _variant(function: str, kind: str):
    """The mailbox without the first ``kind`` call in ``function``."""
    site = next(s for s in mutants.sites("tract.testing.mailbox")
                if s.function == function and s.kind == kind)
    return mutants.mutate(site)


def _first_failing_seed(protocol, packed=False, chaos=0.3):
    for seed in seeds(SEEDS):
        try:
            exercise(protocol, seed, chaos, packed)
        except SimulationFailure as failure:
            return seed, str(failure)
    return None, None


@pytest.mark.parametrize("variant", ["publish flush removed", "reader invalidate removed",
                                     "flag inside the payload's line"])
def test_broken_variants_fail_deterministically_for_a_printed_seed(variant):
    protocol, packed = mailbox, False
    if variant == "publish flush removed":
        protocol = _variant("send", "flush")
    elif variant == "reader invalidate removed":
        protocol = _variant("receive", "invalidate")
    else:
        packed = True
    seed, message = _first_failing_seed(protocol, packed)
    assert seed is not None, f"{variant}: no seed out of {SEEDS} caught it"
    print(f"{variant}: fails with seed {seed}: {message}")
    assert f"seed={seed}" in message
    for _ in range(2):  # the same seed replays the same failure, bit for bit
        with pytest.raises(SimulationFailure) as again:
            exercise(protocol, seed, 0.3, packed)
        assert str(again.value) == message


def test_packed_layout_is_caught_as_a_lost_update():
    ring = mailbox.Ring(SLOTS, PAYLOAD, packed=True)
    assert ring.flag(0) // LINE == ring.payload(1) // LINE  # shares a line, by design
    for seed in seeds(SEEDS):
        try:
            exercise(mailbox, seed, 0.3, packed=True)
        except SimulationFailure as failure:
            if "lost update" in str(failure):
                return
    pytest.fail("no seed showed the lost update of the packed layout")


def test_every_mailbox_mutant_is_killed_in_process():
    """The mutation harness removes each flush/invalidate/fence of the
    mailbox in turn: the two broken variants above are among its mutants,
    and none of its mutants survives the simulated suite."""
    every = mutants.sites("tract.testing.mailbox")
    kinds = {(s.function, s.kind) for s in every}
    assert {("send", "flush"), ("receive", "invalidate"), ("_read_flag", "invalidate"),
            ("send", "fence"), ("receive", "fence")} <= kinds
    for site in every:
        if mutants.equivalent(site):
            continue
        protocol = mutants.mutate(site)
        caught = any(_fails(protocol, seed, chaos) for chaos in (0.0, 0.3)
                     for seed in seeds(min(SEEDS, 60)))
        assert caught, f"mutant {site} survived"


def _fails(protocol, seed, chaos):
    try:
        exercise(protocol, seed, chaos)
    except SimulationFailure:
        return True
    return False


# ---------------------------------------------------- simulator semantics

def test_flush_is_needed_for_another_host_to_see_a_store():
    pool = SimPool(4 * LINE, hosts=2, chaos=0)
    writer, reader = pool.hosts
    writer.store_u64(0, 7)
    reader.invalidate(0, 8)
    reader.fence()
    assert reader.load_u64(0) == 0
    writer.flush(0, 8)
    reader.invalidate(0, 8)
    reader.fence()
    assert reader.load_u64(0) == 0  # the flush is queued until the writer fences
    writer.fence()
    assert reader.load_u64(0) == 0  # the reader's copy is stale ...
    assert pool.stale_reads and pool.stale_reads[-1].writer == 0  # ... and that is recorded
    reader.invalidate(0, 8)
    reader.fence()
    assert reader.load_u64(0) == 7


def test_a_store_after_its_flush_is_not_carried_by_it():
    """A flush carries the line as it was when it ran: a store between the
    flush and its fence stays dirty in the writer's cache (the flush may
    complete at once on hardware), so the fence publishes the older bytes;
    the next flush carries the store."""
    pool = SimPool(4 * LINE, hosts=2, chaos=0)
    writer, reader = pool.hosts
    writer.store_u64(0, 7)
    writer.flush(0, 8)
    writer.store_u64(8, 9)
    writer.fence()
    assert pool.memory[:16].view(numpy.uint64).tolist() == [7, 0]
    assert writer.load_u64(8) == 9
    writer.invalidate(0, 8)  # dropping a dirty line writes it back first (clflush)
    writer.fence()
    reader.invalidate(0, 16)
    reader.fence()
    assert (reader.load_u64(0), reader.load_u64(8)) == (7, 9)


def test_lost_update_when_two_hosts_write_one_line():
    pool = SimPool(2 * LINE, hosts=2, chaos=0)
    a, b = pool.hosts
    a.store_u64(0, 1)
    b.store_u64(8, 2)  # another field of the same line: R2 broken
    a.flush(0, 8)
    a.fence()
    b.flush(8, 8)
    b.fence()
    (lost,) = pool.lost_updates
    assert (lost.host, lost.overwritten_host, lost.offsets) == (1, 0, [0])
    assert lost.trace and int.from_bytes(pool.memory[:8].tobytes(), "little") == 0
    strict = SimPool(2 * LINE, hosts=2, chaos=0, raise_on_lost_update=True)
    a, b = strict.hosts
    a.store_u64(0, 1)
    b.store_u64(8, 2)
    a.flush(0, 8)
    a.fence()
    b.flush(8, 8)
    with pytest.raises(Exception, match="over bytes \\[0\\] written by host 0"):
        b.fence()


def test_a_line_written_whole_without_reading_it_replaces_memory():
    pool = SimPool(2 * LINE, hosts=2, chaos=0)
    a, b = pool.hosts
    a.store_u64(0, 1)
    a.flush(0, 8)
    a.fence()
    b.copy_in(0, bytes(range(64)), nontemporal=False)  # b's copy predates a's store
    b.flush(0, LINE)
    b.fence()
    assert not pool.lost_updates and pool.memory[:64].tobytes() == bytes(range(64))


def test_a_stale_line_read_then_written_whole_is_a_lost_update():
    pool = SimPool(2 * LINE, hosts=2, chaos=0)
    a, b = pool.hosts
    a.store_u64(0, 1)
    a.flush(0, 8)
    a.fence()
    words = [b.load_u64(8 * index) | 2 for index in range(8)]  # read-modify-write, stale
    for index, word in enumerate(words):
        b.store_u64(8 * index, word)
    b.flush(0, LINE)
    b.fence()
    (lost,) = pool.lost_updates
    assert (lost.host, lost.overwritten_host, lost.offsets) == (1, 0, [0])


def test_writes_through_a_view_are_written_back():
    pool = SimPool(2 * LINE, hosts=2, chaos=0)
    a, b = pool.hosts
    a.view(64, 4)[:] = 9
    a.writeback(64, 4)
    a.fence()
    assert a.view(64, 1)[0] == 9  # write-back keeps the line
    b.invalidate(64, 4)
    b.fence()
    assert b.read(64, 4) == b"\x09" * 4


def test_nontemporal_copy_is_in_memory_on_return():
    pool = SimPool(4 * LINE, hosts=2, chaos=0)
    a, b = pool.hosts
    a.copy_in(3, b"streamed", nontemporal=True)
    b.invalidate(0, LINE)
    b.fence()
    assert b.read(3, 8) == b"streamed"
    out = bytearray(8)
    b.copy_out(3, out)
    assert bytes(out) == b"streamed"


def test_same_seed_same_run_bit_for_bit():
    first = exercise(mailbox, 11, 0.5)
    second = exercise(mailbox, 11, 0.5)
    assert first.steps == second.steps and list(first.trace) == list(second.trace)
    assert numpy.array_equal(first.memory, second.memory)
    assert exercise(mailbox, 12, 0.5).steps != first.steps or \
        list(exercise(mailbox, 12, 0.5).trace) != list(first.trace)


def test_livelock_is_reported_with_its_seed():
    pool = SimPool(LINE, hosts=1, seed=5, chaos=0, max_steps=100)

    def spin(region):
        while True:
            region.invalidate(0, 8)
            region.fence()
            region.load_u64(0)

    with pytest.raises(SimulationFailure, match=r"no progress after 100 operations.*seed=5"):
        pool.run(spin)


def test_simulated_host_checks_bounds_like_a_region():
    host = SimPool(2 * LINE, hosts=1).hosts[0]
    with pytest.raises(BoundsError, match="outside region"):
        host.load_u64(2 * LINE)
    with pytest.raises(BoundsError, match="not aligned to 8 bytes"):
        host.store_u64(4, 1)
    with pytest.raises(OverflowError, match="does not fit in u8"):
        host.store_u8(0, 256)
    with pytest.raises(BoundsError):
        host.flush(LINE, 2 * LINE)


def test_corrupt_flag_is_refused():
    pool = SimPool(mailbox.Ring(SLOTS, PAYLOAD).nbytes, hosts=1, chaos=0)
    ring = mailbox.Ring(SLOTS, PAYLOAD)
    pool.memory[ring.flag(0):ring.flag(0) + 8] = 0xFF
    with pytest.raises(CorruptionError, match=f"flag at offset {ring.flag(0)}"):
        mailbox.receive(pool.hosts[0], ring, 0)


def test_cost_per_operation_is_reported(record_property):
    start = time.perf_counter()
    steps = sum(exercise(mailbox, seed, 0.3).steps for seed in range(20))
    per_op = (time.perf_counter() - start) / steps
    record_property("simulated_op_us", per_op * 1e6)
    print(f"simulator: {per_op * 1e6:.1f} us per simulated operation over {steps} operations")
    assert steps > 0


def test_harness_reports_a_surviving_mutant(tmp_path, monkeypatch, capsys):
    """A protocol with a call its tests cannot see fail is reported, and the
    harness exits non-zero."""
    (tmp_path / "redundant_protocol.py").write_text(
        "def publish(region):\n"
        "    region.store_u64(0, 1)\n"
        "    region.flush(0, 8)\n"
        "    region.fence()\n"
        "    region.fence()\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_redundant.py").write_text(
        "import pytest\n"
        "import redundant_protocol\n"
        "from tract.testing.incoherent import SimPool\n\n"
        "@pytest.mark.sim\n"
        "def test_publish_reaches_memory():\n"
        "    pool = SimPool(64, hosts=1, chaos=0)\n"
        "    redundant_protocol.publish(pool.hosts[0])\n"
        "    assert pool.memory[0] == 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get(
        "PYTHONPATH", "")]))
    monkeypatch.setitem(mutants.SUITES, "redundant_protocol", ["tests/test_redundant.py"])
    code = mutants.main(["--module", "redundant_protocol", "--json", "--root", str(tmp_path),
                         "--seeds", "1"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["sites"] == 4 and report["killed"] == 2  # the flush, deleted or too early
    assert report["survivors"] == [  # either fence alone suffices
        {"module": "redundant_protocol", "file": "redundant_protocol.py", "line": line,
         "kind": "fence", "function": "publish", "mutation": "delete"}
        for line in (4, 5)]


def test_simulated_host_offers_the_native_region_interface():
    """Protocol code runs unchanged on either: every public method of the
    native Region exists on SimHost with the same parameters (the timing
    helpers of `tract bench` excepted)."""
    import inspect

    from tract.region import Region
    from tract.testing.incoherent import SimHost

    names = {n for n in dir(Region) if not n.startswith("_") and not n.startswith("time_")}
    host = SimPool(LINE, hosts=1).hosts[0]
    missing = sorted(n for n in names if not hasattr(host, n))
    assert not missing, f"SimHost lacks {missing}"
    for name in names:
        native = getattr(Region, name)
        if not callable(native) or isinstance(native, property):
            continue
        simulated = inspect.signature(getattr(SimHost, name))
        assert list(inspect.signature(native).parameters)[1:] == \
            list(simulated.parameters)[1:], name


def _protocol_with_tests(tmp_path, monkeypatch, name, test_source):
    """A one-function protocol module ``name`` (publish: store, flush, fence)
    and its simulated test file, registered as a suite of the harness."""
    (tmp_path / f"{name}.py").write_text(
        "def publish(region):\n"
        "    region.store_u64(0, 1)\n"
        "    region.flush(0, 8)\n"
        "    region.fence()\n")
    tests = tmp_path / "tests"
    tests.mkdir(exist_ok=True)
    (tests / f"test_{name}.py").write_text(test_source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get(
        "PYTHONPATH", "")]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(mutants.SUITES, name, [f"tests/test_{name}.py"])


def test_a_killed_mutant_names_its_seed_and_runs_it_first_next_time(tmp_path, monkeypatch):
    """The seed a mutant's test failed at is reported with the test's whole
    id (tract.testing.seeds), and a run given it walks that seed first, then
    every other."""
    visits = tmp_path / "visits"
    _protocol_with_tests(tmp_path, monkeypatch, "seeded_protocol", (
        "import pytest\n"
        "import seeded_protocol\n"
        "from tract.testing.incoherent import SimPool\n"
        "from tract.testing.seeds import seeds\n\n"
        "@pytest.mark.sim\n"
        "@pytest.mark.parametrize('case', ['a case'])\n"  # an id with a space in it
        "def test_publish_reaches_memory(case):\n"
        "    for seed in seeds(6):\n"
        f"        open({str(visits)!r}, 'a').write(f'{{seed}} ')\n"
        "        pool = SimPool(64, hosts=1, chaos=0, seed=seed)\n"
        "        seeded_protocol.publish(pool.hosts[0])\n"
        "        assert seed < 3 or pool.memory[0] == 1\n"))
    flush = next(site for site in mutants.sites("seeded_protocol") if site.kind == "flush")
    test = "tests/test_seeded_protocol.py::test_publish_reaches_memory[a case]"
    assert mutants.run_mutant(flush, "seeded_protocol", tmp_path, 6, tests=[test]) == \
        f"failed by {test} at seed 3"
    assert visits.read_text() == "0 1 2 3 "
    visits.unlink()
    assert mutants.run_mutant(flush, "seeded_protocol", tmp_path, 6, tests=[test],
                              first_seed=3).endswith("at seed 3")
    assert visits.read_text() == "3 "
    visits.unlink()
    assert mutants.run_mutant(None, "seeded_protocol", tmp_path, 6, tests=[test],
                              first_seed=4) == "passed"
    assert visits.read_text() == "4 0 1 2 3 5 "  # every seed, the first one first


def test_runs_sharing_the_mutants_run_each_once(tmp_path, monkeypatch, capsys):
    """Two runs given one --share directory split the mutants: each runs and
    reports only those it claimed, and together they run every one once."""
    _protocol_with_tests(tmp_path, monkeypatch, "shared_protocol", (
        "import pytest\n"
        "import shared_protocol\n"
        "from tract.testing.incoherent import SimPool\n\n"
        "@pytest.mark.sim\n"
        "def test_publish_reaches_memory():\n"
        "    pool = SimPool(64, hosts=1, chaos=0)\n"
        "    shared_protocol.publish(pool.hosts[0])\n"
        "    assert pool.memory[0] == 1\n"))
    arguments = ["--module", "shared_protocol", "--json", "--root", str(tmp_path),
                 "--seeds", "1", "--share", str(tmp_path / "claims")]
    reports = []
    for narrowed in (["--mutation", "delete"], []):  # the first claims the deletions only
        mutants.main([*arguments, *narrowed])
        reports.append(json.loads(capsys.readouterr().out))
    every = mutants.sites("shared_protocol")
    assert [report["sites"] for report in reports] == \
        [sum(site.mutation == "delete" for site in every),
         sum(site.mutation != "delete" for site in every)]
    assert all(report["killed"] == report["sites"] - len(report["survivors"])
               for report in reports)


def test_a_mutant_that_survives_its_covering_tests_meets_its_whole_suite(
        tmp_path, monkeypatch, capsys):
    """The coverage map is recorded at fewer seeds than the mutants run
    (COVERAGE_SEEDS): a test that reaches a site only past them is not in
    its selection, so a survivor of the selection runs the whole suite
    before it is reported."""
    late = mutants.COVERAGE_SEEDS
    _protocol_with_tests(tmp_path, monkeypatch, "late_protocol", (
        "import pytest\n"
        "import late_protocol\n"
        "from tract.testing.incoherent import SimPool\n"
        "from tract.testing.seeds import count, seeds\n\n"
        "@pytest.mark.sim\n"
        "def test_a_publish_that_checks_nothing():\n"
        "    late_protocol.publish(SimPool(64, hosts=1, chaos=0).hosts[0])\n\n"
        "@pytest.mark.sim\n"
        "def test_late_seeds_check_the_publish():\n"
        "    for seed in seeds(count()):\n"
        f"        if seed >= {late}:\n"
        "            pool = SimPool(64, hosts=1, chaos=0, seed=seed)\n"
        "            late_protocol.publish(pool.hosts[0])\n"
        "            assert pool.memory[0] == 1\n"))
    code = mutants.main(["--module", "late_protocol", "--json", "--root", str(tmp_path),
                         "--seeds", str(late + 1), "--mutation", "delete"])
    report = json.loads(capsys.readouterr().out)
    assert report["uncovered"] == []  # the map's selection: the test that checks nothing
    flush = [site for site in report["slowest"] if site["kind"] == "flush"]
    assert flush and flush[0]["result"] == \
        "failed by tests/test_late_protocol.py::test_late_seeds_check_the_publish " \
        f"at seed {late}"
    assert code == 0 and report["survivors"] == [] and report["killed"] == report["sites"]
