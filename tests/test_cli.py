"""The `tract` command: info, bench (JSON schema), the demo, and one-line
errors on bad pool files."""

import collections
import json
import os
import statistics
import subprocess
import sys

import pytest

from tract import bench
from tract.cli import main
from tract.errors import ConfigError


def _tract(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "tract.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_info_json_reports_the_instruction_choice():
    done = _tract("info", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    control = report["cache_control"]
    assert {"chosen", "flush", "invalidate", "writeback", "payload", "fence", "source"} <= set(control)
    assert report["default_coherence"] == "none"
    assert "numa_nodes" in report and "dax_devices" in report and report["cpu_model"]


def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "chosen" in out and "coherence      none" in out


def test_the_index_floor_replays_a_traces_traffic_alone():
    """`tract bench index`'s floor: lines dropped are read after the next
    fence, lines written back are stored to first, other mappings' ops and
    fences are as traced."""
    import numpy as np

    from tract._native._region import INSTRUCTIONS, TRACE_FENCE
    from tract.bench import index
    from tract.region import scratch_region

    region = scratch_region(4096, name="test-floor")
    try:
        region.store_u64(64, 5)
        region.store_u64(128, 7)
        flush, fresh = INSTRUCTIONS["clflush"], INSTRUCTIONS["clflushopt"]
        ops = np.array([fresh, fresh, TRACE_FENCE, flush, TRACE_FENCE, fresh], np.int64)
        offsets = np.array([64, 128, -1, 192, -1, 64], np.int64)
        reads = np.empty(ops.size, np.int64)
        # the last drop has no fence after it: never read
        assert index.replay(region.base, ops, offsets, flush, fresh, TRACE_FENCE, reads) == 12
        assert region.load_u64(192) == 3  # stored to (its op's position) before its write-back
        assert region.load_u64(64) == 5 and region.load_u64(128) == 7
    finally:
        region.close()


@pytest.mark.multiprocess  # the bench's lock manager
def test_bench_index_reports_each_steps_floor():
    done = _tract("bench", "index", "--json", "--quick")
    assert done.returncode == 0, done.stderr
    results = {result["name"]: result for result in json.loads(done.stdout)["results"]}
    for step in ("lookup+pin+validate+unpin", "reserve+publish"):
        floor = results[f"index[{step},floor]"]
        assert floor["baseline"] == "store_flush_fence" and floor["value"] > 0
        against = results[f"index[{step}] vs floor"]
        assert against["baseline_value"] == floor["value"]
        timed = f"index[{step},hit]" if "pin" in step else f"index[{step}]"
        assert against["value"] == results[timed]["value"]


def test_bench_list_and_unknown(capsys):
    assert main(["bench", "--list"]) == 0
    assert "region" in capsys.readouterr().out.split()
    assert main(["bench", "no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err
    assert main(["bench"]) == 2


def test_bench_on_a_cuda_device_needs_one(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device (tests/cuda/check.sh runs the bench)")
    assert main(["bench", "transfer", "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert main(["bench", "region", "--device", "cuda"]) == 2
    assert "--device applies to transfer only" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_region_json_schema():
    done = _tract("bench", "region", "--json", "--quick")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["bench"] == "region"
    assert {"cpu_model", "cores", "cache_control"} <= set(report["machine"])
    names = set()
    for result in report["results"]:
        assert set(result) == {"name", "value", "unit", "baseline", "baseline_value", "ratio",
                               "ratio_min", "ratio_max"}
        assert isinstance(result["value"], float) and result["value"] > 0
        assert "is better" in result["unit"]
        if result["baseline"] is None:
            assert result["ratio"] is None and result["baseline_value"] is None
        else:
            assert result["ratio"] == pytest.approx(
                result["value"] / result["baseline_value"] if "higher" in result["unit"]
                else result["baseline_value"] / result["value"])
        names.add(result["name"])
    for size in ("256KiB", "2MiB", "16MiB"):
        assert f"copy_in_nt[{size}]" in names and f"copy_out[{size}]" in names
    assert "store_flush_fence[clflush]" in names and "flush_dirty_line[clflush]" in names


@pytest.mark.multiprocess
def test_bench_churn_reports_each_operation_alone_and_under_churn():
    """Each timed operation's p50, p99 and p99.9, alone and under churn,
    against its p50 alone (same run), and how many were timed; and the
    control (a copy of the same bytes that touches no pool)."""
    done = _tract("bench", "churn", "--json", "--quick")
    assert done.returncode == 0, done.stderr
    results = {result["name"]: result for result in json.loads(done.stdout)["results"]}
    for op in ("store", "load", "take", "copy"):
        alone = results[f"churn[{op}] alone p50"]
        assert alone["ratio"] == pytest.approx(1.0)
        for phase in ("alone", "churn"):
            figures = [results[f"churn[{op}] {phase} {label}"] for label in ("p50", "p99", "p99.9")]
            assert 0 < figures[0]["value"] <= figures[1]["value"] <= figures[2]["value"]
            assert all(figure["baseline_value"] == alone["value"] for figure in figures)
        assert results[f"churn[{op}] samples"]["value"] > 0
    assert {f"churn lock waits[{role}]" for role in ("writer", "evictor", "producer")} \
        <= set(results)


def test_result_ratio_orientation():
    rate = bench.Result("r", 20.0, "GB/s", True, "base", 10.0)
    cost = bench.Result("c", 20.0, "ns", False, "base", 10.0)
    assert rate.ratio == 2.0 and cost.ratio == 0.5
    assert bench.Result("x", 1.0, "ns", False).ratio is None


def test_paired_ratios_are_taken_round_by_round():
    """Each round's ratio is its baseline's seconds over tract's: the
    median, lowest and highest of them (not a ratio of two medians)."""
    assert bench.paired([1.0, 2.0, 4.0], [2.0, 2.0, 2.0]) == (1.0, 0.5, 2.0)
    result = bench.Result("r", 1.0, "GB/s", True, "base", 3.0, bench.paired([1.0], [1.5]))
    assert result.as_dict()["ratio"] == result.ratio == 1.5
    assert (result.as_dict()["ratio_min"], result.as_dict()["ratio_max"]) == (1.5, 1.5)
    with pytest.raises(ValueError, match="as many rounds"):
        bench.paired([1.0], [])


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_demo_paths_take_turns_in_a_balanced_order(count):
    """Over a square's prompts (twice as many for an odd count of paths),
    every path arrives at each place equally often, and right after each
    other path equally often: a cheap request before another eases its
    queue, and that favour must fall on no path more than another."""
    from tract.demo import _turns

    paths = [f"p{k}" for k in range(count)]
    rows = [_turns(paths, i) for i in range(count * (2 if count % 2 else 1))]
    assert all(sorted(row) == paths for row in rows)
    places = collections.Counter((path, k) for row in rows for k, path in enumerate(row))
    assert len(set(places.values())) == 1 and len(places) == count * count
    follows = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) <= 1


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_hands_kv_through_the_pool_token_exact(tmp_path):
    """Every path runs (Mooncake's too: the test extra installs it), token-exact;
    requests arrive at the stated share of the service rate measured first;
    each KV load stands beside a cold memcpy of the same bytes, timed after it
    in its worker, and their paired ratios; nothing is
    printed but the progress bar.  The quick preset with a 2-layer model,
    shorter prompts and 4 output tokens: every path, a quarter of the time."""
    from tract.demo import PATHS

    done = _tract("demo", "--quick", "--layers", "2", "--input-tokens", "256",
                  "--output-tokens", "4", "--json", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["token_exact"] is True
    assert report["unavailable"] == {}, report["unavailable"]
    assert report["service_rate_rps"] > 0
    assert report["arrival_rate_rps"] == pytest.approx(0.7 * report["service_rate_rps"])
    noise = [line for line in done.stderr.splitlines() if "tract demo" not in line and line]
    assert noise == [], noise[:5]
    assert set(report["workloads"]) == {"hit25", "hit50", "hit75"}
    for paths in report["workloads"].values():
        assert set(paths) == set(PATHS)
        for row in paths.values():
            assert row["mismatched"] == [] and row["requests"] == 4
            assert set(row["ttft_s"]) == {"mean", "p50", "p99"} and row["kv_load_s"]["mean"] > 0
            pairs = row["kv_load_pairs_s"]  # (load, memcpy, +drop) of each request
            assert len(pairs) == row["requests"] and min(min(p) for p in pairs) > 0
            for name, column in (("kv_load_of_bound", 1), ("kv_load_of_floor", 2)):
                ratios = [pair[column] / pair[0] for pair in pairs]
                assert row[name] == pytest.approx(statistics.median(ratios))
                assert row[f"{name}_range"] == pytest.approx([min(ratios), max(ratios)])
        assert paths["tract"]["hit_rate"] > 0 and paths["tcp"]["hit_rate"] == 0
    for workload, paths in report["workloads"].items():  # the paths took turns in one phase
        assert report["throughput_rps"][workload] > 0
        for name, row in paths.items():  # TTFTs paired by prompt with tcp's
            if name == "tcp":
                continue
            ratios = [a / b for a, b in zip(row["ttft_samples_s"],
                                            paths["tcp"]["ttft_samples_s"])]
            paired = report["ttft_of_tcp"][workload][name]
            assert paired["median"] == pytest.approx(statistics.median(ratios))
            assert paired["range"] == pytest.approx([min(ratios), max(ratios)])
    assert report["workloads"]["hit75"]["tract"]["hit_rate"] > \
        report["workloads"]["hit25"]["tract"]["hit_rate"]
    counters = report["pool_counters"]
    assert sum(c["offers"] for c in counters.values()) == \
        sum(c["takes"] for c in counters.values()) > 0
    for plot in report["plots"]:
        with open(plot, "rb") as image:
            assert image.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(report["json"]) as saved:
        assert json.load(saved)["token_exact"] is True


@pytest.mark.multiprocess
@pytest.mark.slow
def test_demo_static_experiment_times_each_length_with_the_prefix_cache_off(tmp_path):
    """Fig. 5's shape: fixed input lengths, 3 output tokens, the pool
    without its prefix cache against TCP and Mooncake, token-exact; a
    TTFT CDF per length, its title naming the machine and the load."""
    done = _tract("demo", "--quick", "--experiment", "static", "--layers", "2", "--json",
                  "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["token_exact"] is True and report["experiment"] == "static"
    assert set(report["workloads"]) == {"len512", "len1024"}
    for paths in report["workloads"].values():
        assert set(paths) == {"tract_no_prefix_cache", "tcp", "mooncake_tcp"}
        for row in paths.values():
            assert row["hit_rate"] == 0 and row["mismatched"] == []
    assert report["workloads"]["len1024"]["tcp"]["kv_bytes_per_request"] == \
        2 * report["workloads"]["len512"]["tcp"]["kv_bytes_per_request"]
    assert sorted(os.path.basename(plot) for plot in report["plots"]) == \
        ["ttft_cdf_static_len1024.png", "ttft_cdf_static_len512.png"]
    assert os.path.basename(report["json"]) == "demo_static.json"


def test_the_demos_sizes_are_checked_by_name(capsys, tmp_path):
    for flags, message in ((["--layers", "0"], "layers must be a whole number of at least 1"),
                           (["--input-tokens", "8"], "input tokens must be a whole number of "
                                                     "at least 32"),
                           (["--experiment", "static", "--input-tokens", "512"],
                            "static experiment's input lengths are fixed"),
                           (["--output-tokens", "1"], "at least 2 output tokens"),
                           (["--engine", "vllm", "--requests", "2"], "the tract engine's")):
        assert main(["demo", "--out", str(tmp_path), *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    assert os.listdir(tmp_path) == []  # refused before anything ran


def test_bench_incoherent_reports_a_ratio(capsys):
    report = bench.run("incoherent", quick=True)
    (result,) = report["results"]
    assert result["name"] == "simulated_operation" and result["ratio"] > 0


@pytest.mark.multiprocess
def test_manager_command_grants_and_stops_on_sigterm(pool_path):
    import signal

    from tract.pool import Pool

    assert main(["pool", "create", pool_path, "--size", "1M", "--chunk-size", "64K", "--max-nodes", "4",
                 "--lease", "0.5"]) == 0
    manager = subprocess.Popen([sys.executable, "-m", "tract.cli", "manager", pool_path,
                                "--node", "3"], stdout=subprocess.PIPE, text=True)
    try:
        assert "grants the locks" in manager.stdout.readline()
        with Pool.open(pool_path, 0) as pool:
            with pool.lock("alloc")(timeout=10):
                pool.region.invalidate(pool.layout.manager_line, 64)
                pool.region.fence()
                assert pool.region.load_u64(pool.layout.manager_line) == 4  # node 3 + 1
        manager.send_signal(signal.SIGTERM)
        assert manager.wait(timeout=10) == 0
        assert "stopped" in manager.stdout.read()
    finally:
        if manager.poll() is None:
            manager.kill()


def test_pool_create_refuses_a_bad_size(pool_path):
    with pytest.raises(SystemExit, match="is not a number of bytes"):
        main(["pool", "create", pool_path, "--size", "lots"])


def test_pools_created_with_one_hash_key_make_the_same_keys(tmp_path, capsys):
    """Two pools (two racks) created from one key file key the same tokens
    and checksum the same bytes alike; a pool of its own random key does
    not; a file that holds no 16-byte key is refused by name."""
    import numpy as np

    from tract.connector import Connector
    from tract.pool import Pool
    from tract.transfer import KVLayout

    key = tmp_path / "key"
    key.write_text("00112233445566778899aabbccddeeff\n")
    paths = [str(tmp_path / name) for name in ("a", "b", "c")]
    for path in paths[:2]:
        main(["pool", "create", path, "--size", "8M", "--max-nodes", "2", "--hash-key-file",
              str(key)])
    main(["pool", "create", paths[2], "--size", "8M", "--max-nodes", "2"])
    layout = KVLayout(model="m", dtype="uint8", num_layers=1, num_kv_heads=1, head_size=64,
                      block_size=4)
    tokens = np.arange(16, dtype=np.int64)
    made = []
    try:
        for path in paths:
            with Pool.open(path, 0) as pool:
                connector = Connector(pool, layout)
                made.append((pool.header.hash_key, connector.keys(tokens).tolist(),
                             connector.transfer.seed))
                connector.close()
    finally:  # with their node-local files in /dev/shm
        for path in paths:
            Pool.destroy(path)
    assert made[0] == made[1] and made[0][0] == bytes.fromhex("00112233445566778899aabbccddeeff")
    assert made[2][1] != made[0][1] and made[2][2] != made[0][2]
    key.write_text("0011")
    assert main(["pool", "create", str(tmp_path / "d"), "--size", "8M", "--hash-key-file",
                 str(key)]) != 0
    assert "a hash key is 32 hex digits" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    with pytest.raises(ConfigError, match="hash_key must be 16 bytes"):
        Pool.create(str(tmp_path / "e"), 8 << 20, hash_key=b"short")


def test_stat_prints_and_exports_a_pools_counters(tmp_path):
    import socket
    import time
    import urllib.request

    from tract.pool import Pool

    path = str(tmp_path / "pool")
    Pool.create(path, 32 << 20, max_nodes=4)
    with Pool.open(path, 2) as pool:
        pool.stats.add(hit_blocks=5, lock_wait_ns=2_000_000_000)
    report = json.loads(_tract("stat", path, "--json").stdout)
    assert report["nodes"]["2"]["hit_blocks"] == 5 and list(report["nodes"]) == ["2"]
    assert "hit_blocks" in _tract("stat", path).stdout
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tract.cli", "stat", path,
                               "--prometheus-port", str(port)])
    try:
        for _ in range(100):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert 'tract_hit_blocks_total{node="2"} 5.0' in text
        assert 'tract_lock_wait_seconds_total{node="2"} 2.0' in text
    finally:
        server.terminate()
        server.wait(10)
    Pool.destroy(path)


def _bad_pool_files(directory, pool_path):
    """name -> path of a missing file, an empty file, random bytes, a
    truncated pool and a directory."""
    from tract.pool import Pool

    Pool.create(pool_path, 8 << 20, chunk_size=256 << 10)
    with open(pool_path, "rb") as whole:
        head = whole.read(3 << 20)
    files = {"missing": directory / "missing", "empty": directory / "empty",
             "random": directory / "random", "truncated": directory / "truncated",
             "directory": directory / "subdir"}
    files["empty"].write_bytes(b"")
    files["random"].write_bytes(bytes(range(256)) * 400)
    files["truncated"].write_bytes(head)
    files["directory"].mkdir()
    return {name: str(path) for name, path in files.items()}


COMMANDS = [("pool", "info"), ("pool", "fsck", "--no-watch"), ("pool", "destroy"),
            ("stat",), ("manager", "--node", "0")]
EXPECTED = {"missing": "No such file or directory", "empty": "must be a positive number of bytes",
            "random": "is not a tract pool", "truncated": "truncated",
            "directory": "Is a directory"}


def test_every_pool_command_gives_one_line_on_a_bad_file(tmp_path, pool_path, capsys):
    for name, path in _bad_pool_files(tmp_path, pool_path).items():
        for command in COMMANDS:
            assert main([*command, path]) == 2, (command, name)
            out, err = capsys.readouterr()
            assert out == "" and err.count("\n") == 1, (command, name, err)
            named = command[:2] if command[0] == "pool" else command[:1]
            assert err.startswith(f"tract {' '.join(named)}: "), (command, name, err)
            assert EXPECTED[name] in err and "Traceback" not in err, (command, name, err)
        for command in [("pool", "info", "--json"), ("pool", "fsck", "--no-watch", "--json"),
                        ("stat", "--json")]:
            assert main([*command, path]) == 2
            out, err = capsys.readouterr()
            report = json.loads(out)
            assert EXPECTED[name] in report["error"] and report["path"] == path, (command, name)
    assert (tmp_path / "random").exists()  # destroy refused a file that is no pool


def test_a_bad_pool_file_gives_no_traceback_from_the_command_line(tmp_path):
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x01" * 8192)
    done = _tract("pool", "fsck", str(junk), "--json")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "is not a tract pool" in json.loads(done.stdout)["error"]
