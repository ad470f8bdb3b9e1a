"""The machine code of the cache-control primitives (DESIGN.md §1, §5).

The cache-control trace records what a primitive was asked to do, through
a hook of its own, not what the CPU was told: a compiler barrier where a
fence belongs, or a dispatch case that emits nothing, leaves the trace,
and so every twin test, unchanged.  These tests read the built machine
code instead (``objdump -d``; Numba's ``inspect_asm`` for kernels):

- each entry point of the mapping (the `Region` methods, the ``cdef api``
  functions kernels call) reaches the instructions it stands for: the
  full, store and load fences are ``mfence``, ``sfence`` and ``lfence``; a
  range dispatch reaches ``clflush``, ``clflushopt`` and ``clwb``; a copy
  into the pool reaches each kind's streaming store, the write-back of its
  partial lines and ``sfence``;
- in every extension that includes ``_cachectl.h``, each function that
  records a fence in the trace emits that fence itself, and each that
  records a range's lines reaches the three flush instructions, so a new
  native step is held without being listed here;
- run under gdb, each flush instruction and streaming store of the mapping
  touches exactly the lines of the range it was given, no more, no fewer;
- the portable build keeps what it promises (stated above its test);
- a kernel's cache control is a call of the mapping's entry points.

Inlining moves code between functions, so an entry point is held to what
it reaches: its own code and that of the functions it calls or jumps to,
two levels deep.
"""

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform as machine
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy
import pytest

from tract._native import _region
from tract._native._region import (INSTRUCTIONS, LINE, TRACE_FENCE, TRACE_LOAD_FENCE,
                                   TRACE_STORE_FENCE, TRACE_STREAM)

NATIVE = Path(_region.__file__).resolve().parent  # the built extensions and their sources
OBJDUMP = shutil.which("objdump")
GDB = shutil.which("gdb")
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = [
    pytest.mark.skipif(OBJDUMP is None, reason="objdump not found: these tests read machine "
                       "code with GNU binutils (Debian: apt-get install binutils)"),
    pytest.mark.skipif(machine.machine() != "x86_64",
                       reason=f"the instructions checked are x86's; this is {machine.machine()}"),
]

FLUSHES = ("clflush", "clflushopt", "clwb")
#: the streaming store of each non-temporal kind (`tract.platform`)
STREAMS = {"sse2": "movntdq", "avx2": "vmovntdq ymm", "avx512": "vmovntdq zmm"}
#: the instruction of each fence the trace records
FENCES = {TRACE_FENCE: "mfence", TRACE_STORE_FENCE: "sfence", TRACE_LOAD_FENCE: "lfence"}
#: what a function that records each code must itself emit: its fence, its
#: flush instruction, for a streamed line a streaming store
RECORDED = {**{code: (name,) for code, name in FENCES.items()},
            **{INSTRUCTIONS[name]: (name,) for name in FLUSHES},
            TRACE_STREAM: (*STREAMS.values(), "movnti")}

#: what each entry point of the mapping reaches on x86
ENTRIES = {
    "tract_api_fence": ("mfence",),
    "tract_api_lines": FLUSHES,
    "Region.flush": FLUSHES,
    "Region.invalidate": FLUSHES,
    "Region.writeback": FLUSHES,
    "Region.flush_lines": FLUSHES,
    "Region.invalidate_lines": FLUSHES,
    "Region.fence": ("mfence",),
    "Region.store_fence": ("sfence",),
    "Region.load_fence": ("lfence",),
    "Region.copy_in": (*FLUSHES, *STREAMS.values(), "sfence"),
    "Region.copy_in_blocks": (*FLUSHES, *STREAMS.values(), "movnti", "sfence"),
    "tract_stream_avx2": (STREAMS["avx2"],),
    "tract_stream_avx512": (STREAMS["avx512"],),
}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a disassembly, its prefixes but ``lock`` dropped."""

    mnemonic: str
    operands: str
    locked: bool

    @property
    def name(self) -> str:
        """The mnemonic; for a vector streaming store with its register
        width (``vmovntdq ymm``), which tells the kinds apart."""
        if self.mnemonic.startswith("vmovnt"):
            return f"{self.mnemonic} {self.operands[1:4]}"
        return self.mnemonic

    @property
    def target(self) -> str | None:
        """The function a call or jump enters at its start (not a place
        inside one, not the PLT)."""
        if self.mnemonic.startswith(("call", "j")):
            found = re.fullmatch(r"[0-9a-f]+ <([^>+@]+)>", self.operands)
            return found and found[1]
        return None


_HEADER = re.compile(r"[0-9a-f]+ <(?P<name>[^>]+)>:")
_CODE = re.compile(r"\s*[0-9a-f]+:\t(?P<text>.*)")
_PREFIXES = {"lock", "rep", "repz", "repnz", "notrack", "bnd", "data16", "cs", "ds"}


@functools.cache
def _functions(library: str) -> dict[str, list[tuple[int, Instruction]]]:
    """Each function of a shared library: its (address, instruction) pairs."""
    listing = subprocess.run([OBJDUMP, "-d", "-w", "--no-show-raw-insn", library],
                             check=True, capture_output=True, text=True).stdout
    functions, body = {}, None
    for line in listing.splitlines():
        if header := _HEADER.fullmatch(line):  # a part gcc moved out is its function's
            body = functions.setdefault(header["name"].removesuffix(".cold"), [])
        elif (code := _CODE.fullmatch(line)) and body is not None:
            words = code["text"].partition("#")[0].split()
            prefixes = []
            while len(words) > 1 and words[0] in _PREFIXES:
                prefixes.append(words.pop(0))
            if words:
                body.append((int(line.split(":")[0], 16),
                             Instruction(words[0], " ".join(words[1:]), "lock" in prefixes)))
    return functions


def _code(library: str, name: str) -> list[Instruction]:
    return [instruction for _, instruction in _functions(library)[name]]


def _reach(library: str, names: list[str], depth: int) -> list[Instruction]:
    """The code of ``names`` and of the functions they call or jump to,
    ``depth`` levels deep."""
    functions, seen, code = _functions(library), set(), []
    for _ in range(depth + 1):
        callees = []
        for name in names:
            if name in seen or name not in functions:
                continue
            seen.add(name)
            code += _code(library, name)
            callees += [i.target for i in _code(library, name) if i.target]
        names = callees
    return code


def _entry(library: str, entry: str) -> list[str]:
    """The functions of an entry point: a method's Cython wrapper and
    implementation (``Region.flush``), or a C function (with the suffixes
    gcc gives its clones)."""
    owner, _, name = entry.rpartition(".")
    if owner:
        pattern = rf"__pyx_p[fw]_\w+_{len(owner)}{owner}_\d+{name}(\.\w+)*"
    else:
        pattern = rf"(__pyx_f_\w+_)?{name}(\.\w+)*"
    names = [function for function in _functions(library) if re.fullmatch(pattern, function)]
    assert names, f"{entry} is not in {library}"
    return names


def _trace_sites(library: str) -> list[tuple[str, int | None]]:
    """(function, op) of each call of the trace hook in the library: op is
    the code the call passes as a constant (a fence, an instruction, a
    streamed line), None when it is a variable (the dispatch's default: an
    instruction this build cannot issue)."""
    sites = []
    for name in _functions(library):
        code = _code(library, name)
        for at, instruction in enumerate(code):
            if (instruction.target or "").startswith("tract_trace_record"):
                codes = [int(found[1], 16) for before in code[max(0, at - 4):at]
                         if before.mnemonic == "mov"
                         and (found := re.fullmatch(r"\$(0x[0-9a-f]+),%edi", before.operands))
                         and int(found[1], 16) in RECORDED]
                sites.append((name, codes[-1] if codes else None))
    return sites


def _extensions() -> list[str]:
    """The extensions of ``tract._native`` built with the primitives."""
    return sorted(path.stem for path in NATIVE.glob("*.pyx")
                  if '"_cachectl.h"' in path.read_text())


def _built(extension: str) -> str:
    """The path of an extension as this process loaded it."""
    return os.path.realpath(importlib.import_module(f"tract._native.{extension}").__file__)


# ------------------------------------------------------------ this machine's build

needs_x86_build = pytest.mark.skipif(
    _region.BUILD_PATH != "x86",
    reason=f"this checkout's build is the {_region.BUILD_PATH} path (the portable tests "
           f"hold it)")


@needs_x86_build
@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_each_entry_point_emits_its_instructions(entry):
    """A fence is its instruction, not a compiler barrier; a range dispatch
    reaches every flush instruction it may be asked for; a copy into the
    pool reaches the streaming store of every kind."""
    library = _built("_region")
    reached = {instruction.name for instruction in _reach(library, _entry(library, entry), 2)}
    missing = [name for name in ENTRIES[entry] if name not in reached]
    assert not missing, f"{entry} emits no {missing} in {library}"


@needs_x86_build
@pytest.mark.parametrize("extension", _extensions())
def test_every_traced_primitive_emits_its_instruction(extension):
    """Each function that records a fence, a flush instruction's line or a
    streamed line emits that fence, that instruction, a streaming store in
    its own code: the hook sits in the loop that issues what it records
    (`_cachectl.h`), so neither can change without the other."""
    library = _built(extension)
    sites = _trace_sites(library)
    assert any(op in FENCES for _, op in sites) and \
        any(op in (INSTRUCTIONS[name] for name in FLUSHES) for _, op in sites), \
        f"no inlined primitive found in {library}: the test would hold nothing"
    for function, op in sites:
        if op is None:
            continue  # no instruction to issue: recorded so that traces agree
        emitted = {instruction.name for instruction in _code(library, function)}
        assert any(name in emitted for name in RECORDED[op]), \
            f"{function} records {op} and emits none of {RECORDED[op]}"


# ------------------------------------------------------------- executed under gdb

# The process gdb runs: it maps one file once per flush instruction and
# streaming kind this CPU has, makes each call on each range with the trace
# on, and stops itself (SIGUSR1) after each so that gdb can tell the calls'
# instructions apart; then it writes down the calls it made.
_CHILD = """
import dataclasses, json, os, signal, sys
from tract import platform
from tract._native._region import INSTRUCTIONS, map_fd

features = platform.cpu_features()
flushes = [name for name in platform.FLUSH_CHOICES if features[name]]
kinds = ["none"] + [kind for kind, feature in
                    (("sse2", "sse2"), ("avx2", "avx2"), ("avx512", "avx512f"))
                    if features[feature]]
names = {code: name for name, code in INSTRUCTIONS.items()}
ranges, plan = json.loads(sys.argv[1]), sys.argv[2]
size = 1 << 16
path = "/dev/shm/tract-test-instructions-%d" % os.getpid()
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, size)
regions = [map_fd(fd, size, 0, path, "file",
                  dataclasses.replace(platform.cache_control(flush), nontemporal=kind))
           for flush in flushes for kind in kinds]
os.close(fd)
os.unlink(path)
calls = []

def record(region, action, insn, offset, length, call):
    region.trace_start()
    call(offset, length)
    traced = [[names[op], line] for op, line in region.trace_stop().tolist() if op in names]
    calls.append([action, insn, region.nontemporal, region.address(0), offset, length, traced])
    os.kill(os.getpid(), signal.SIGUSR1)

os.kill(os.getpid(), signal.SIGUSR1)  # mapped: gdb sets its breakpoints
for region in regions:
    control = region.cache_control
    for offset, length in ranges:
        if region.nontemporal == "none":
            for payload in (False, True):
                record(region, "lines", control.payload if payload else control.flush,
                       offset, length, lambda o, n: region.flush(o, n, payload))
                record(region, "lines", control.payload if payload else control.invalidate,
                       offset, length, lambda o, n: region.invalidate(o, n, payload))
            record(region, "lines", control.writeback, offset, length, region.writeback)
        record(region, "copy", control.writeback, offset, length,
               lambda o, n: region.copy_in(o, bytes(n)))
with open(plan, "w") as out:
    json.dump(calls, out)
"""

# gdb's script: once the child has mapped its files, a breakpoint on each
# site records the address the site is given, into the list of the call
# under way; each stop of the child starts the next call's list.
_GDB = """
import json
import gdb

library, sites, hits = {library!r}, {sites!r}, {hits!r}
gdb.execute("set pagination off")
gdb.execute("handle SIGUSR1 stop nopass")
calls = []


def value(register):
    return int(gdb.parse_and_eval("$" + register)) & (2 ** 64 - 1) if register else 0


class Site(gdb.Breakpoint):
    def __init__(self, at, name, width, displacement, base, index, scale):
        super().__init__("*%#x" % at, internal=True)
        self.site = name, width, displacement, base, index, scale

    def stop(self):
        name, width, displacement, base, index, scale = self.site
        address = displacement + value(base) + value(index) * scale
        calls[-1].append([name, address & (2 ** 64 - 1), width])
        return False


gdb.execute("run")
maps = open("/proc/%d/maps" % gdb.selected_inferior().pid).read().splitlines()
start = min(int(line.split("-")[0], 16) for line in maps if line.split()[-1] == library)
for at, *site in json.load(open(sites)):
    Site(start + at, *site)
while gdb.selected_inferior().pid:
    calls.append([])
    gdb.execute("continue")
with open(hits, "w") as out:
    json.dump(calls, out)
"""

_MEMORY = re.compile(r"(?P<displacement>-?0x[0-9a-f]+|-?\d+)?"
                     r"\((?:%(?P<base>\w+))?(?:,%(?P<index>\w+),(?P<scale>\d))?\)")


def _store_sites(library: str) -> list[list]:
    """Every flush instruction and streaming store of the library: its
    address, name, bytes written and memory operand."""
    sites = []
    for function in _functions(library).values():
        for at, instruction in function:
            if instruction.name in FLUSHES:
                width = LINE
            elif instruction.name.startswith(("movnt", "vmovnt")):
                register = instruction.operands.split(",")[0]
                width = {"%x": 16, "%y": 32, "%z": 64, "%r": 8, "%e": 4}[register[:2]]
            else:
                continue
            operand = _MEMORY.search(instruction.operands)
            assert operand and operand.end() == len(instruction.operands), instruction
            sites.append([at, instruction.name, width, int(operand["displacement"] or "0", 0),
                          operand["base"], operand["index"], int(operand["scale"] or 1)])
    return sites


def _lines(offset: int, length: int) -> list[int]:
    """The naive model: the offsets of the lines [offset, offset+length) touches."""
    if length == 0:
        return []
    return list(range(offset // LINE * LINE, offset + length, LINE))


@needs_x86_build
@pytest.mark.skipif(GDB is None, reason="gdb not found: this test runs the mapping's "
                    "flushes under it (Debian: apt-get install gdb)")
def test_each_flush_and_streaming_store_touches_exactly_the_range(tmp_path):
    """Executed, not read: every clflush, clflushopt, clwb and streaming
    store the mapping runs is caught at its address, with the address it
    was given, and the cache-control trace of the call must list the same
    lines (the twin tests judge native steps by that trace).  For flush,
    invalidate and write-back (each instruction, payload or not) that is
    exactly the lines of the range, in order, with the instruction the
    pool chose.  For a non-temporal `Region.copy_in`
    (each kind) the range's whole lines are streamed, each byte once, by
    the kind's store, and its partial lines are written back; a range with
    no whole line is written back entire."""
    library = _built("_region")
    rng = numpy.random.default_rng(50)
    ranges = [(0, 0), (70, 0), (0, 1), (63, 1), (63, 2), (64, 64), (1, 127), (5, 640),
              (4032, 4163)] + [(int(o), int(n)) for o, n in zip(rng.integers(0, 8192, 8),
                                                                 rng.integers(1, 1024, 8))]
    files = {name: tmp_path / f"{name}.json" for name in ("sites", "hits", "plan")}
    files["sites"].write_text(json.dumps(_store_sites(library)))
    script = tmp_path / "record.py"
    script.write_text(_GDB.format(library=library, sites=str(files["sites"]),
                                  hits=str(files["hits"])))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(NATIVE.parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([GDB, "-q", "-batch", "-nx", "-x", str(script), "--args",
                           sys.executable, "-c", _CHILD, json.dumps(ranges), str(files["plan"])],
                          capture_output=True, text=True, timeout=300, env=environment)
    if "ptrace: Operation not permitted" in done.stdout + done.stderr:
        pytest.skip("gdb may not trace processes here (ptrace refused)")
    assert files["plan"].exists() and files["hits"].exists(), done.stdout[-2000:] + done.stderr
    calls = json.loads(files["plan"].read_text())
    hits = json.loads(files["hits"].read_text())
    assert len(hits) == len(calls) + 1 and not hits[-1], "calls and their hits out of step"
    for (action, insn, kind, base, offset, length, traced), caught in zip(calls, hits):
        where = f"{action} of ({offset}, {length}) with {insn}, streaming {kind}"
        lines = [[insn, base + line] for line in _lines(offset, length)]
        flushed = [[name, address] for name, address, _ in caught if name in FLUSHES]
        assert [[name, base + line] for name, line in traced] == flushed, \
            f"{where}: the trace is not what ran"
        streamed = sorted((address, width, name) for name, address, width in caught
                          if name not in FLUSHES)
        whole = [line for line in _lines(offset, length)
                 if offset <= line and line + LINE <= offset + length]
        if action == "lines" or kind == "none" or not whole:
            assert (flushed, streamed) == (lines, []), where
            continue
        partial = [[insn, base + line] for line in _lines(offset, length) if line not in whole]
        assert flushed == partial, where
        assert {name for _, _, name in streamed} == {STREAMS[kind]}, where
        assert [address for address, _, _ in streamed] == list(
            range(base + whole[0], base + whole[-1] + LINE, streamed[0][1])), where


# ------------------------------------------------------------------ the portable build
#
# The portable build (TRACT_CACHECTL_PORTABLE, compiled on x86 so the path
# cannot rot) knows no cache-maintenance instruction: it serves only pools
# that need none (`tract.platform.cache_control` resolves every action to
# "none").  What it promises: no clflush, clflushopt, clwb or streaming
# store anywhere, and a full fence that is still a hardware one (mfence or
# a locked read-modify-write), so a coherent pool's store-load order holds.
# Its store and load fences are release and acquire fences, which x86's
# total store order gives for free: they emit no instruction, and none is
# asked of them.

def _build_key(extensions: list[str]) -> str:
    """What the portable build depends on: the native sources, the build
    script and the toolchain."""
    import Cython

    from tract.bench import trace

    digest = hashlib.sha256()
    for part in (*extensions, sys.version, Cython.__version__, numpy.__version__,
                 sysconfig.get_config_var("CC") or "", CC or "", trace.BUILD_SCRIPT):
        digest.update(part.encode() + b"\0")
    for path in sorted(NATIVE.iterdir()):
        if path.suffix in (".pyx", ".pxd", ".h"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


@pytest.fixture(scope="module")
def portable_build() -> dict[str, str]:
    """The extensions built with ``TRACT_CACHECTL_PORTABLE``, by name: this
    checkout's own build when it is the portable path, else built from its
    sources once per source and toolchain version and kept in
    ``${XDG_CACHE_HOME:-~/.cache}/tract/instructions`` (a minute or two
    the first time)."""
    if _region.BUILD_PATH == "portable":
        return {extension: _built(extension) for extension in _extensions()}
    if CC is None:
        pytest.skip("no C compiler: the portable build cannot be made")
    pytest.importorskip("Cython", reason="Cython builds the portable extensions")
    from tract.bench.trace import build_extension

    extensions = _extensions()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    cache = Path(base) / "tract" / "instructions" / _build_key(extensions)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if not all((cache / f"{extension}{suffix}").exists() for extension in extensions):
        with tempfile.TemporaryDirectory(prefix="tract-portable-") as scratch:
            shutil.copytree(NATIVE, Path(scratch, "tract", "_native"),
                            ignore=shutil.ignore_patterns("*.so", "*.c", "__pycache__"))
            for extension in extensions:
                failed = build_extension(Path(scratch), f"tract._native.{extension}",
                                         (("TRACT_CACHECTL_PORTABLE", "1"),))
                assert failed is None, f"the portable {extension} does not build:\n{failed}"
            cache.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=f"{cache.name}.", dir=cache.parent))
            for extension in extensions:
                shutil.copy(Path(scratch, "tract", "_native", f"{extension}{suffix}"), partial)
            try:
                partial.rename(cache)
            except OSError:  # another run cached it first
                shutil.rmtree(partial)
    return {extension: str(cache / f"{extension}{suffix}") for extension in extensions}


def _full_fence(code: list[Instruction]) -> bool:
    return any(i.name == "mfence" or i.locked for i in code)


@pytest.mark.parametrize("extension", _extensions())
def test_the_portable_build_keeps_its_promise(portable_build, extension):
    """The promise stated above: nothing of cache maintenance or streaming
    anywhere, and every full fence recorded in the trace is an ``mfence``
    or a locked instruction in its own function."""
    library = portable_build[extension]
    forbidden = sorted({i.name for name in _functions(library) for i in _code(library, name)
                        if i.name in FLUSHES or i.name.startswith(("movnt", "vmovnt"))})
    assert not forbidden, f"the portable {extension} emits {forbidden}"
    fences = [function for function, op in _trace_sites(library) if op == TRACE_FENCE]
    assert fences, f"no full fence found in the portable {extension}: the test holds nothing"
    if extension == "_region":
        fences += [*_entry(library, "tract_api_fence"), *_entry(library, "Region.fence")]
    for function in fences:
        fenced = _full_fence(_code(library, function))
        assert fenced, f"{function} of the portable {extension} records a full fence and emits none"


# ------------------------------------------------------------------------ kernels

def test_kernels_call_the_mappings_entry_points():
    """A kernel's `cachectl.lines` and `cachectl.fence` are calls of the
    mapping's ``tract_api_lines`` and ``tract_api_fence`` (the code the
    tests above read), in the kernel's order: nothing inlined, dropped or
    swapped by LLVM."""
    numba = pytest.importorskip("numba")
    from tract._kernels import cachectl

    @numba.njit("void(int32, uint64, int64)")
    def publish(insn, address, length):
        cachectl.lines(insn, address, length)
        cachectl.fence()

    assembly = next(iter(publish.inspect_asm().values()))
    loaded, called = {}, []  # a register's symbol (movabsq $symbol, %reg); callees in order
    for words in (line.split() for line in assembly.splitlines()):
        if words[:1] == ["movabsq"] and len(words) == 3:
            loaded[words[2]] = words[1].strip("$,")
        elif words[:1] == ["callq"]:
            called.append(loaded.get(words[1][1:]) if words[1][0] == "*"
                          else words[1].partition("@")[0])
    assert [name for name in called if name and name.startswith("tract_api_")] == \
        ["tract_api_lines", "tract_api_fence"], assembly
