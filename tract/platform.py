"""What this machine offers tract, decided once at import and reported by `tract info`.

Cache control (DESIGN.md §1).  The CPU is asked once which of clflush,
clflushopt and clwb it has.  The default instruction for every action is
clflush: on a real CXL device the TraCT authors saw ``clflushopt + mfence``
fail to make a lock-protected update visible to another host.  The variable
``TRACT_FLUSH=clflush|clflushopt|clwb`` overrides that at import, and a
pool's configuration overrides it per pool.  Per chosen instruction:

    chosen       flush        invalidate               write-back
    clflush      clflush      clflush                  clflush
    clflushopt   clflushopt   clflushopt               clflushopt
    clwb         clwb         clflushopt (or clflush)  clwb

clwb may leave a line cached, so it never serves to invalidate.  Payload
ranges (``payload=True``) are flushed and invalidated with clflushopt when the
CPU has it, whatever the choice: clflush serialises every line (about 150 ns
a line here against 2–5 ns), and a payload's publication is ordered anyway by
the fence and the metadata flush that follow it (R3).  A pool
declared ``coherence="hardware"`` uses no instruction at all; the default for
every pool is ``coherence="none"``.

NUMA and device DAX are read from sysfs.  Every reader takes the sysfs root
as an argument so tests can point it at a fake tree.
"""

from __future__ import annotations

import dataclasses
import os
import platform as _platform
import re
from pathlib import Path

from tract._native import _region
from tract.errors import ConfigError

__all__ = [
    "COHERENCE_MODES",
    "FLUSH_CHOICES",
    "CacheControl",
    "cache_control",
    "cpu_features",
    "cpu_model",
    "dax_devices",
    "default_cache_control",
    "device_numa_node",
    "info",
    "numa_nodes",
    "pin_to_numa_node",
]

COHERENCE_MODES = ("none", "hardware")
FLUSH_CHOICES = ("clflush", "clflushopt", "clwb")
FLUSH_ENV = "TRACT_FLUSH"

_FEATURES = _region.cpu_features()


def cpu_features() -> dict[str, bool]:
    """Cache-control and vector features of this CPU (and OS), by name."""
    return dict(_FEATURES)


def cpu_model() -> str:
    """The CPU's marketing name, or the architecture when none is exposed."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware"):
                    return value.strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


@dataclasses.dataclass(frozen=True)
class CacheControl:
    """The instructions one pool uses, decided when it is mapped.

    Attributes name instructions as `tract info` prints them: ``chosen`` is
    the flush instruction asked for and ``flush``/``invalidate``/``writeback``
    what each action runs; ``source`` says where the choice came from
    (``default``, ``env TRACT_FLUSH``, ``pool``).  ``payload`` is what
    flushes and invalidates bulk data whose publication a later fence and
    metadata write order (clflushopt where it exists: clflush serialises
    every line, about 60x slower per line on a range).
    """

    coherence: str
    chosen: str
    flush: str
    invalidate: str
    writeback: str
    payload: str
    fence: str
    nontemporal: str
    source: str

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def _fences() -> str:
    return {"x86": "mfence", "aarch64": "dsb sy"}.get(_region.BUILD_PATH, "compiler fence")


def _nontemporal() -> str:
    if _region.BUILD_PATH != "x86":
        return "none"
    for feature, name in (("avx512f", "avx512"), ("avx2", "avx2"), ("sse2", "sse2")):
        if _FEATURES[feature]:
            return name
    return "none"


def cache_control(flush: str | None = None, coherence: str = "none", *,
                  source: str = "pool") -> CacheControl:
    """Resolve the instructions for one pool.

    Parameters
    ----------
    flush : {"clflush", "clflushopt", "clwb"} or None
        Instruction to flush with; None takes the process default (see
        `default_cache_control`).
    coherence : {"none", "hardware"}
        ``"hardware"`` declares the pool coherent: no cache maintenance.
    """
    if coherence not in COHERENCE_MODES:
        raise ConfigError(f"coherence must be one of {COHERENCE_MODES}, got {coherence!r}")
    if flush is None:
        base = default_cache_control()
        flush, source = base.chosen, base.source
    fence, nontemporal = _fences(), _nontemporal()
    if _region.BUILD_PATH == "x86" and flush not in FLUSH_CHOICES:
        raise ConfigError(f"flush instruction must be one of {FLUSH_CHOICES}, got {flush!r}")
    if coherence == "hardware":
        return CacheControl(coherence, flush, "none", "none", "none", "none", fence, nontemporal, source)
    # Off x86 the build has one choice; an x86 name asked for is ignored.
    if _region.BUILD_PATH == "aarch64":
        return CacheControl(coherence, "dc civac", "dc civac", "dc civac", "dc cvac", "dc civac",
                            fence, nontemporal, source)
    if _region.BUILD_PATH == "portable":
        # No cache-maintenance instruction is known for this CPU: only a
        # coherent device is safe, and `tract info` says so.
        return CacheControl(coherence, "none", "none", "none", "none", "none", fence, nontemporal,
                            source)
    if not _FEATURES[flush]:
        available = [name for name in FLUSH_CHOICES if _FEATURES[name]]
        raise ConfigError(f"flush instruction {flush!r} is not supported by this CPU "
                          f"({cpu_model()}); available: {available}")
    if flush == "clwb":
        invalidate = "clflushopt" if _FEATURES["clflushopt"] else "clflush"
    else:
        invalidate = flush
    payload = "clflushopt" if _FEATURES["clflushopt"] else "clflush"
    return CacheControl(coherence, flush, flush, invalidate, flush, payload, fence, nontemporal,
                        source)


def _default_from_env() -> CacheControl:
    requested = os.environ.get(FLUSH_ENV)
    if requested is None:
        return cache_control("clflush", source="default")
    requested = requested.strip().lower()
    if requested not in FLUSH_CHOICES:
        raise ConfigError(f"{FLUSH_ENV}={requested!r} is not one of {FLUSH_CHOICES}")
    return cache_control(requested, source=f"env {FLUSH_ENV}")


_DEFAULT = _default_from_env()


def default_cache_control() -> CacheControl:
    """The choice made at import: clflush, or ``TRACT_FLUSH`` when set."""
    return _DEFAULT


# ------------------------------------------------------------------- NUMA

def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cpulist(text: str | None) -> list[int]:
    cpus: list[int] = []
    for part in (text or "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def numa_nodes(sysfs: str = "/sys") -> list[dict]:
    """NUMA nodes with their CPUs and memory; CXL memory shows as CPU-less nodes."""
    root = Path(sysfs, "devices/system/node")
    nodes = []
    for entry in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = _read(entry / "meminfo") or ""
        match = re.search(r"MemTotal:\s+(\d+) kB", meminfo)
        distance = _read(entry / "distance")
        nodes.append({
            "node": int(entry.name[4:]),
            "cpus": _cpulist(_read(entry / "cpulist")),
            "mem_bytes": int(match.group(1)) * 1024 if match else None,
            "distance": [int(d) for d in distance.split()] if distance else [],
        })
    return nodes


def pin_to_numa_node(node: int, sysfs: str = "/sys") -> list[int]:
    """Pin the calling thread to the CPUs of ``node``, or of the nearest node
    with CPUs when ``node`` has none (a CXL memory node).  Returns the CPUs."""
    nodes = {entry["node"]: entry for entry in numa_nodes(sysfs)}
    if node not in nodes:
        raise ConfigError(f"NUMA node {node} does not exist; nodes: {sorted(nodes)}")
    target = nodes[node]
    if not target["cpus"]:
        with_cpus = [n for n in nodes.values() if n["cpus"]]
        if not with_cpus:
            raise ConfigError("no NUMA node has CPUs")
        by_distance = {n["node"]: target["distance"][i] if i < len(target["distance"]) else 255
                       for i, n in enumerate(sorted(nodes.values(), key=lambda n: n["node"]))}
        target = min(with_cpus, key=lambda n: (by_distance.get(n["node"], 255), n["node"]))
    os.sched_setaffinity(0, target["cpus"])
    return list(target["cpus"])


# ------------------------------------------------------------- device DAX

_DAX_NAME = re.compile(r"dax\d+\.\d+$")


def dax_devices(sysfs: str = "/sys", dev: str = "/dev") -> list[dict]:
    """Device-DAX instances known to sysfs, with size, alignment and NUMA node."""
    devices = []
    root = Path(sysfs, "bus/dax/devices")
    for entry in sorted(root.glob("dax*")):
        if not _DAX_NAME.match(entry.name):
            continue
        size = _read(entry / "size")
        align = _read(entry / "align")
        devices.append({
            "name": entry.name,
            "path": str(Path(dev, entry.name)),
            "size": int(size) if size and size.isdigit() else None,
            "align": int(align) if align and align.isdigit() else None,
            "numa_node": _int_or_none(_read(entry / "numa_node")),
            "target_node": _int_or_none(_read(entry / "target_node")),
        })
    return devices


def _int_or_none(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return None if value is None or value < 0 else value


def device_numa_node(path: str, sysfs: str = "/sys") -> int | None:
    """NUMA node of the memory behind a DAX device (its target node), if known."""
    name = Path(path).name
    if not _DAX_NAME.match(name):
        return None
    entry = Path(sysfs, "bus/dax/devices", name)
    for field in ("target_node", "numa_node"):
        value = _int_or_none(_read(entry / field))
        if value is not None:
            return value
    return None


# ------------------------------------------------------------------- info

def info(sysfs: str = "/sys") -> dict:
    """Everything `tract info` reports, as plain data."""
    chosen = default_cache_control()
    return {
        "cpu_model": cpu_model(),
        "machine": _platform.machine(),
        "build_path": _region.BUILD_PATH,
        "cpu_features": cpu_features(),
        "flush_available": [name for name in FLUSH_CHOICES if _FEATURES[name]],
        "cache_control": chosen.as_dict(),
        "nontemporal_copy": chosen.nontemporal,
        "default_coherence": "none",
        "line_size": _region.LINE,
        "numa_nodes": numa_nodes(sysfs),
        "dax_devices": dax_devices(sysfs),
    }
