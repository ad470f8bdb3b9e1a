"""Instruction choice, its overrides, and the sysfs readers (NUMA, DAX)."""

import json
import os
import subprocess
import sys

import pytest

from tract import platform
from tract.errors import ConfigError
from tract.region import create_region

AVAILABLE = [name for name in platform.FLUSH_CHOICES if platform.cpu_features()[name]]

# Every primitive under one TRACT_FLUSH choice, in a fresh process, the way
# PMDK re-runs its tests under each override: the choice is made at import.
OVERRIDE_CHECK = r"""
import json, tract
from tract.region import scratch_region
control = tract.default_cache_control()
region = scratch_region(1 << 16, name="test-override")
region.store_u64(0, 42)
region.flush(0, 64)
region.fence()
region.writeback(0, 4096)
region.store_fence()
region.invalidate(0, 1 << 16)
region.invalidate(0, 1 << 16, payload=True)
region.flush(0, 1 << 16, payload=True)
region.load_fence()
region.fence()
assert region.load_u64(0) == 42
region.copy_in(1, bytes(range(200)))
assert region.read(1, 200) == bytes(range(200))
print(json.dumps({"control": control.as_dict(), "round_trip": region.time_round_trip(0, 100)}))
"""


def _run_with_env(env_value):
    env = dict(os.environ)
    env.pop("TRACT_FLUSH", None)
    if env_value is not None:
        env["TRACT_FLUSH"] = env_value
    return subprocess.run([sys.executable, "-c", OVERRIDE_CHECK], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("instruction", AVAILABLE)
def test_every_flush_override_runs_on_this_cpu(instruction):
    done = _run_with_env(instruction)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    control = report["control"]
    assert control["chosen"] == instruction and control["flush"] == instruction
    assert control["source"] == "env TRACT_FLUSH"
    assert control["invalidate"] != "clwb"  # clwb may keep the line: never an invalidate
    assert report["round_trip"] > 0


def test_default_is_clflush_for_metadata():
    done = _run_with_env(None)
    assert done.returncode == 0, done.stderr
    control = json.loads(done.stdout)["control"]
    assert (control["chosen"], control["flush"], control["invalidate"], control["source"]) == \
        ("clflush", "clflush", "clflush", "default")
    assert control["coherence"] == "none"


def test_bad_override_is_refused_at_import():
    done = _run_with_env("wbinvd")
    assert done.returncode != 0
    assert "TRACT_FLUSH='wbinvd' is not one of" in done.stderr


@pytest.mark.parametrize("instruction", AVAILABLE)
def test_pool_configuration_overrides_the_process_choice(instruction, pool_path):
    region = create_region(pool_path, 4096, flush=instruction)
    assert region.cache_control.flush == instruction
    assert region.cache_control.source == "pool"
    expected_invalidate = instruction if instruction != "clwb" else \
        ("clflushopt" if "clflushopt" in AVAILABLE else "clflush")
    assert region.cache_control.invalidate == expected_invalidate
    region.close()


def test_hardware_coherence_makes_every_action_a_no_op():
    control = platform.cache_control("clflush", "hardware")
    assert (control.flush, control.invalidate, control.writeback, control.payload) == \
        ("none",) * 4


def test_unsupported_instruction_names_the_cpu(monkeypatch):
    features = dict(platform._FEATURES, clwb=False)
    monkeypatch.setattr(platform, "_FEATURES", features)
    with pytest.raises(ConfigError, match=r"'clwb' is not supported by this CPU .*available"):
        platform.cache_control("clwb")


def _fake_node(root, node, cpus, mem_kb, distance):
    entry = root / "devices/system/node" / f"node{node}"
    entry.mkdir(parents=True)
    (entry / "cpulist").write_text(cpus + "\n")
    (entry / "meminfo").write_text(f"Node {node} MemTotal:       {mem_kb} kB\n")
    (entry / "distance").write_text(distance + "\n")


@pytest.fixture
def fake_sysfs(tmp_path):
    _fake_node(tmp_path, 0, "0-1,4", 1024, "10 20 30")
    _fake_node(tmp_path, 1, "2-3", 2048, "20 10 25")
    _fake_node(tmp_path, 2, "", 4096, "30 25 10")  # CXL memory: no CPUs
    dax = tmp_path / "bus/dax/devices/dax0.0"
    dax.mkdir(parents=True)
    (dax / "size").write_text(str(8 << 30) + "\n")
    (dax / "align").write_text(str(2 << 20) + "\n")
    (dax / "numa_node").write_text("0\n")
    (dax / "target_node").write_text("2\n")
    return tmp_path


def test_numa_nodes_from_sysfs(fake_sysfs):
    nodes = platform.numa_nodes(str(fake_sysfs))
    assert [n["node"] for n in nodes] == [0, 1, 2]
    assert nodes[0]["cpus"] == [0, 1, 4]
    assert nodes[2]["cpus"] == [] and nodes[2]["mem_bytes"] == 4096 * 1024
    assert nodes[1]["distance"] == [20, 10, 25]


def test_dax_devices_and_their_numa_node(fake_sysfs):
    (devices,) = platform.dax_devices(str(fake_sysfs))
    assert devices == {"name": "dax0.0", "path": "/dev/dax0.0", "size": 8 << 30,
                       "align": 2 << 20, "numa_node": 0, "target_node": 2}
    assert platform.device_numa_node("/dev/dax0.0", str(fake_sysfs)) == 2
    assert platform.device_numa_node("/dev/shm/pool", str(fake_sysfs)) is None


def test_pin_to_a_cpu_less_node_picks_the_nearest_node_with_cpus(fake_sysfs, monkeypatch):
    pinned = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(list(cpus)))
    assert platform.pin_to_numa_node(2, str(fake_sysfs)) == [2, 3]
    assert platform.pin_to_numa_node(0, str(fake_sysfs)) == [0, 1, 4]
    assert pinned == [[2, 3], [0, 1, 4]]
    with pytest.raises(ConfigError, match="NUMA node 7 does not exist"):
        platform.pin_to_numa_node(7, str(fake_sysfs))


def test_pin_on_this_machine_really_pins():
    node = platform.numa_nodes()[0]["node"]
    before = os.sched_getaffinity(0)
    try:
        cpus = platform.pin_to_numa_node(node)
        assert os.sched_getaffinity(0) == set(cpus)
    finally:
        os.sched_setaffinity(0, before)


def test_info_reports_the_choice():
    report = platform.info()
    assert report["cache_control"]["chosen"] in platform.FLUSH_CHOICES
    assert report["default_coherence"] == "none"
    assert set(report["cpu_features"]) >= {"clflush", "clflushopt", "clwb", "avx2", "avx512f"}
    assert report["line_size"] == 64
