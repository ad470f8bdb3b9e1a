"""Mutation harness: delete each cache-control call in a protocol module in
turn and check that the module's simulated tests notice.

A *site* is one call of ``flush``, ``invalidate``, ``writeback``, ``fence``,
``store_fence`` or ``load_fence`` in the module's source, or of
``self_fence``: the check of a process's own lease before a write that
depends on a claim (R6; `tract.pool.Pool.self_fence`).  A mutant is the
module with one site removed (the statement becomes ``pass``).  Each mutant
runs the module's simulated tests (pytest marker ``sim``) in a fresh
interpreter that imports the package from a copy holding the mutated
module, so no module can keep a reference to the original (forked from a
server that has imported pytest, NumPy and Numba, never tract:
`tract.testing.forkserver`).  A mutant whose
tests still pass *survives*, which means that call is either unneeded or
untested — either way a finding.

    python -m tract.testing.mutants [--json] [--module M] [--kind K] [--seeds N]
                                    [--jobs J] [--full] [--coverage FILE] [--moves]
                                    [--mutation KIND] [--share DIR] [--record]
    python -m tract.testing.mutants --coverage-arguments

exits non-zero when any mutant survives (or a run errs), and with ``--json``
prints ``{"sites": n, "killed": k, "survivors": [{"module", "line", "kind", "mutation"}],
"mutations": {kind: {"sites", "killed"}}, "equivalent": [...]}``.

*Selection.*  An unmutated run of each suite is recorded with coverage.py,
one dynamic context per test, at `COVERAGE_SEEDS` seeds (a tenth of the
runs' 200, with the same tests covering each site), so the harness knows
which simulated tests execute each site's statement.  A mutant then runs only those tests, the one
that killed that site last time first, from the seed it failed at
(`tract.testing.seeds`; ``killers.json`` under
``${XDG_CACHE_HOME:-~/.cache}/tract/mutants``, else the record committed in
``tests/mutant_killers.json``, which ``--record`` rewrites), and stops at the
first failure.  A mutant its killer no longer kills runs every other seed
and covering test: the order only saves time.  A site that no test executes
is listed in the report as *uncovered* and is still run, against its
module's whole suite: it is never skipped, and it fails the run if it
survives.  A mutant that survives its covering tests is run against its
whole suite before it is reported as a survivor: the map, recorded at
fewer seeds, only orders the work.  ``--full`` runs every mutant
against its whole suite, with no selection (``make mutants-full``).
``--share DIR`` lets several runs split the mutants: each claims a mutant (a
file in DIR) before running it, and reports the ones it claimed.
``--coverage FILE`` takes the map from a run that already measured every
simulated test this way (``make test``'s sim-coverage
tier), instead of running the suites unmutated again.

Protocol modules register their simulated test files in `SUITES`; each
protocol issue adds its module there.

*Native sites* (DESIGN.md §5, fast twins).  The same deletions are made in
the fast paths: every call of ``tract_lines``, ``tract_fence``,
``tract_store_fence`` and ``tract_load_fence`` in ``tract/_native/*.pyx``
(the timing helpers of `tract bench` excepted), in the primitives of
``tract/_native/_cachectl.h`` that do more than one instruction (the
streaming and checksummed copies, with their partial-line write-backs), and
every ``lines`` / ``fence`` call in the kernels of `NATIVE_SUITES`.  A
``.pyx`` source's mutants share one build of its schema
(`tract.testing.schemata`: every mutant in the source at once, each chosen
at import by ``TRACT_MUTANT``), unoptimized (`MUTANT_OPTIMIZE`); a mutant
the schema cannot hold, and one that survives or errs in it, is judged on
a build of its own text before it is reported.  A header mutant rebuilds
the extension that uses those primitives.  Each build is kept under
``…/tract/mutants/builds``, keyed by every native source and the
toolchain, so an unchanged source is not compiled twice.  A kernel mutant
is a mutated ``.py``.  Each runs its
native suite (`NATIVE_SUITES`: the twin tests, which hold the fast path to
its reference by result, bytes and cache-control trace), after the test
that killed it last time, alone (a run of its own: pytest runs a file's
tests in file order, whichever is named first).

*Moves.*  Besides deletions, each fence that follows a statement of its
block is moved before that statement (a fence before the flush or store it
should order): always for native sites, and with ``--moves`` for the Python
modules (``make mutants-full``).

*Reorders of the data* (DESIGN.md §5: a trace of cache control alone lets
them pass), Python and native sites alike (`order_sites`):

- ``late-store``: a write-back moved before the statement that stores what
  it should carry (a Region store call; in native code an element assigned
  or a copy): the store now follows its write-back and never reaches
  memory through it;
- ``early-read``: a fence moved after the statement that reads the lines it
  makes fresh (a Region read, a step that reads; natively an element or a
  copy read, past the end of a ``with nogil:`` block when the fence ends
  one): the read now comes before its invalidation completes, or before
  the copies it must precede.

The simulator's flush carries a line as it was when queued, and the native
twins run against the shadow memory (tests/twins.py), so both show.

*Weakened bounds* (``weaken``, native): each guard on a value loaded from
memory that hands a hard case back is removed, loses one ``or`` term, or
has one comparison moved past its edge (R5; `_weakened`).  *Silent
primitives* (``silent``, the header): each fence or flush instruction of
the primitives turned into a compiler barrier, which no trace or result
shows: the instruction tests read the machine code of a build optimized as
shipped (`SILENT_TESTS`).

A mutant no host can tell from the original is declared in `EQUIVALENT`
with the reason, reported as such and not run.  ``--mutation`` narrows a
run to some kinds; the report counts each kind's sites and kills.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import concurrent.futures
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from pathlib import Path

from tract.bench.trace import build_extension
from tract.testing import forkserver, schemata
from tract.testing import seeds as sim_seeds

__all__ = ["EQUIVALENT", "NATIVE_SUITES", "SUITES", "SYNC_CALLS", "Site", "equivalent", "mutate",
           "native_mutant", "native_sites", "order_sites", "record_killers", "run_mutant",
           "site_keys", "sites"]

SYNC_CALLS = ("flush", "invalidate", "writeback", "fence", "store_fence", "load_fence",
              "flush_lines", "invalidate_lines", "self_fence")

# protocol module -> its simulated test files, relative to the repository root
SUITES: dict[str, list[str]] = {
    "tract.testing.mailbox": ["tests/test_incoherent.py"],
    "tract.lock": ["tests/test_lock.py"],
    "tract.lease": ["tests/test_lock.py"],
    "tract.alloc": ["tests/test_alloc.py"],
    "tract.objects": ["tests/test_objects.py"],
    "tract.index": ["tests/test_index.py"],
    "tract.handoff": ["tests/test_connector.py"],
    "tract.connector": ["tests/test_connector.py"],
    "tract.stats": ["tests/test_stats.py"],
    "tract.pool": ["tests/test_pool.py"],
    "tract.cuda": ["tests/test_transfer.py"],
}

REGION_TESTS = ["tests/test_region.py::test_the_shadow_moves_exactly_the_lines_a_fence_completes",
                "tests/test_region.py::test_the_shadow_sees_every_copy_reach_memory",
                "tests/test_region.py::test_the_trace_records_each_primitive_of_its_own_thread",
                "tests/test_region.py::test_native_copies_trace_what_the_simulator_models",
                "tests/test_region.py::test_block_copies_move_exactly_their_bytes"]
# native source -> (the extension a mutant rebuilds or None, its twin tests)
NATIVE_SUITES: dict[str, tuple[str | None, list[str]]] = {
    "tract/_native/_allocfast.pyx": ("tract._native._allocfast",
                                     ["tests/test_alloc_fast.py", "tests/test_twins.py"]),
    "tract/_native/_handofffast.pyx": ("tract._native._handofffast",
                                       ["tests/test_handoff_fast.py"]),
    "tract/_native/_lockfast.pyx": ("tract._native._lockfast", ["tests/test_lock_fast.py"]),
    "tract/_native/_region.pyx": ("tract._native._region",
                                  [*REGION_TESTS, "tests/test_twins.py",
                                   "tests/test_index_fast.py"]),
    "tract/_native/_cachectl.h": ("tract._native._region", REGION_TESTS),
    "tract/_kernels/indexfast.py": (None, ["tests/test_index_fast.py"]),
}
NATIVE_CALLS = ("tract_lines", "tract_fence", "tract_store_fence", "tract_load_fence")
KERNEL_CALLS = ("lines", "fence")
# the primitives of _cachectl.h made of more than one instruction
HEADER_PRIMITIVES = ("tract_stream_in", "tract_copy_in_nt", "tract_xxh3_copy",
                     "tract_digest_copy")
NATIVE_MARKERS = "not multiprocess and not slow"
#: a mutant's extension is compiled unoptimized (a quarter of -O2's time for
#: `_region`): its twin tests judge it by results, bytes and the
#: cache-control trace, which the trace hook records at any optimization
MUTANT_OPTIMIZE = "-O0"
#: the header's instructions of cache control, each in the primitive that
#: issues it; a ``silent`` mutant turns one into a compiler barrier, which
#: leaves every trace, shadow and result as it was: only the machine code
#: tells (tests/test_instructions.py, on a build optimized as shipped)
SILENT_PRIMITIVES = ("tract_lines", "tract_clflushopt_range", "tract_clwb_range",
                     "tract_fence", "tract_store_fence", "tract_load_fence")
SILENT_INSTRUCTIONS = re.compile(r"\b_mm_(?:clflush|clflushopt|clwb|mfence|sfence|lfence)\s*\(")
SILENT_TESTS = ["tests/test_instructions.py::test_each_entry_point_emits_its_instructions",
                "tests/test_instructions.py::test_every_traced_primitive_emits_its_instruction"]
SILENT_OPTIMIZE = "-O2"
BARRIER = '__asm__ volatile("" ::: "memory")'

SEEDS_ENV = sim_seeds.COUNT_ENV
#: mutant runs the report lists as the slowest, with their times
SLOWEST = 12
#: seeds per test of the unmutated runs that map which tests cover a site:
#: at 20 each site is covered by the same test functions as at 200 (every
#: protocol site, measured), for a tenth of the time under coverage.py
COVERAGE_SEEDS = 20


@dataclasses.dataclass(frozen=True)
class Site:
    """One cache-control call: where it is and what it does."""

    module: str
    index: int
    line: int
    col: int
    kind: str
    function: str
    mutation: str = "delete"  # or one of MUTATIONS' other kinds
    detail: str = ""  # a weakened bound: what was changed

    def as_dict(self) -> dict:
        source = self.module if "/" in self.module else \
            self.module.replace(".", "/") + ".py"
        found = {"module": self.module, "file": source, "line": self.line, "kind": self.kind,
                 "function": self.function, "mutation": self.mutation}
        if self.detail:
            found["detail"] = self.detail
        return found


#: mutants no host can tell from the original, each with why: reported as
#: such and not run.  Keyed ``module:function:kind:mutation`` (no line, so
#: an edit elsewhere keeps the entry); each is a claim a reviewer checks.
EQUIVALENT: dict[str, str] = {
    "tract.testing.mailbox:_read_flag:fence:early-read":
        "a poll: a flag read before its fence holds the line as the previous poll's fence "
        "left it, so the loop sees a publication at most one poll late, and the payload it "
        "then reads is invalidated and fenced on its own",
    "tract.index:_pin:flush_lines:late-store":
        "the store it passes is of the access stamps, the high halves of the pin words whose "
        "counts the write-back still carries: a stamp is a recency hint (sampled LRU), and "
        "the unpin that follows every pin writes the same line back with it",
    "tract/_native/_lockfast.pyx:_give_back:tract_fence:early-read":
        "the read it passes is of this node's own request line, which no other host writes "
        "(R2): the cache holds it whatever the fence; the fence still precedes the release's "
        "stores, which it orders after the holder's flushes (R3)",
}


def equivalent(site: Site) -> str | None:
    """Why ``site``'s mutant is equivalent (`EQUIVALENT`), or None."""
    return EQUIVALENT.get(f"{site.module}:{site.function}:{site.kind}:{site.mutation}")


def _source(module: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"{module!r} is not a Python source module")
    return spec.origin, Path(spec.origin).read_text()


def _calls(tree: ast.AST, kernel: bool = False):
    """(call node, enclosing function name) for every sync call, in source
    order: ``region.flush(...)`` and the like, or, with ``kernel``, the
    ``lines(...)`` / ``fence()`` calls of a Numba kernel module."""
    found = []

    def wanted(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        if kernel:
            return isinstance(node.func, ast.Name) and node.func.id in KERNEL_CALLS
        return isinstance(node.func, ast.Attribute) and node.func.attr in SYNC_CALLS

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            if wanted(child):
                found.append((child, function))
            visit(child, name)

    visit(tree, "<module>")
    return sorted(found, key=lambda item: (item[0].lineno, item[0].col_offset))


def sites(module: str, moves: bool = False) -> list[Site]:
    """Every cache-control call site of ``module``, in source order; with
    ``moves``, also each fence that follows a statement in its block, as a
    move of it before that statement; and the reorders of the data against
    the cache control (`order_sites`)."""
    _, source = _source(module)
    tree = ast.parse(source)
    calls = _calls(tree)
    found = [Site(module, index, call.lineno, call.col_offset, call.func.attr, function)
             for index, (call, function) in enumerate(calls)]
    moved = [Site(module, site.index, site.line, site.col, site.kind, site.function, "move")
             for site, (call, _) in zip(found, calls)
             if site.kind in FENCES and _previous_statement(tree, call) is not None]
    return found + (moved if moves else []) + order_sites(tree, found, calls)


FENCES = ("fence", "store_fence", "load_fence", "tract_fence", "tract_store_fence",
          "tract_load_fence")

#: the Region calls that store to the pool, and those that read it (with the
#: protocol modules' own readers of a line they name: an owner record, a
#: lease, an index entry), for the reorders of `order_sites`
STORE_CALLS = ("store_u8", "store_u16", "store_u32", "store_u64", "store_u32s", "copy_in",
               "copy_in_blocks", "scatter_lines", "fill", "local_add_u32s", "local_add_u64s")
READ_CALLS = ("load_u8", "load_u16", "load_u32", "load_u64", "load_u64s", "read", "copy_out",
              "copy_out_blocks", "gather_lines", "digest_blocks", "_read", "owner", "decode")
#: the write-backs among the sync calls (a Python module's, a kernel's: the
#: ``lines`` calls with a flush instruction)
WRITE_BACKS = ("flush", "writeback", "flush_lines")
#: a kernel's views of pool memory (tract._kernels.cachectl)
KERNEL_VIEWS = ("words", "halves")


def order_sites(tree: ast.AST, found: list[Site], calls, kernel: bool = False) -> list[Site]:
    """The reorders of data against cache control (DESIGN.md §5), one site
    each: ``late-store``, a write-back moved before the statement that
    stores what it should carry (the store now after its write-back); and
    ``early-read``, a fence moved after the statement that reads what it
    makes fresh (the read now before its invalidation completes).  A
    write-back or fence alone in a loop's body moves with its loop."""
    out = []
    for site, (call, _) in zip(found, calls):
        unit = _unit(tree, call)
        if unit is None:
            continue
        body, position = unit
        if _write_back(call, kernel) and position and _touches(body[position - 1], kernel,
                                                               store=True):
            out.append(dataclasses.replace(site, mutation="late-store"))
        if site.kind in FENCES + KERNEL_CALLS[1:] and position + 1 < len(body) and \
                _touches(body[position + 1], kernel, store=False):
            out.append(dataclasses.replace(site, mutation="early-read"))
    return out


def _write_back(call: ast.Call, kernel: bool) -> bool:
    if kernel:
        return call.func.id == "lines" and bool(call.args) and \
            isinstance(call.args[0], ast.Name) and "flush" in call.args[0].id
    return call.func.attr in WRITE_BACKS


def _touches(statement: ast.stmt, kernel: bool, store: bool) -> bool:
    """Whether ``statement`` stores to (``store``) or reads the pool: a
    Region call of that kind; in a kernel, a store through a view of the
    pool (an element of ``words(...)``) or any use of such a view."""
    for node in ast.walk(statement):
        if kernel:
            if store and isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(target, ast.Subscript) and isinstance(target.value, ast.Call)
                       and getattr(target.value.func, "id", "") in KERNEL_VIEWS
                       for target in targets):
                    return True
            if not store and isinstance(node, ast.Call) and \
                    getattr(node.func, "id", "") in KERNEL_VIEWS:
                return True
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in (STORE_CALLS if store else READ_CALLS) and \
                getattr(node.func.value, "attr", getattr(node.func.value, "id", "")) != "layout":
            return True  # (a layout's methods compute offsets: they read nothing)
    return False


def _unit(tree: ast.AST, call: ast.Call):
    """(body, position) of the statement that is ``call``, lifted to the
    loop around it while it is that loop's only statement; None when
    ``call`` is no statement of its own."""
    parents = {}
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list):
                for position, statement in enumerate(body):
                    parents[id(statement)] = (node, body, position)
    target = next((statement for statement in ast.walk(tree)
                   if isinstance(statement, ast.Expr) and statement.value is call), None)
    if target is None or id(target) not in parents:
        return None
    node, body, position = parents[id(target)]
    while isinstance(node, (ast.For, ast.While)) and node.body == [body[position]] \
            and not node.orelse and id(node) in parents:
        node, body, position = parents[id(node)]
    return body, position


def _previous_statement(tree: ast.AST, call: ast.Call):
    """(body, position) of the statement before the one that is ``call``,
    in the same block; None when ``call`` is not a statement or is first."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for position, statement in enumerate(body):
                if isinstance(statement, ast.Expr) and statement.value is call:
                    before = body[position - 1] if position else None
                    docstring = isinstance(before, ast.Expr) and \
                        isinstance(before.value, ast.Constant) and isinstance(before.value.value, str)
                    return None if before is None or docstring else (body, position)
    return None


def _mutated(tree: ast.AST, site: Site, call: ast.Call) -> ast.AST:
    """``tree`` with ``site`` applied to ``call``: deleted, or moved up
    (``move``, ``late-store``) or down (``early-read``) one statement."""
    if site.mutation == "move":
        body, position = _previous_statement(tree, call)
        body[position - 1], body[position] = body[position], body[position - 1]
        return tree
    if site.mutation in ("late-store", "early-read"):
        body, position = _unit(tree, call)
        other = position - 1 if site.mutation == "late-store" else position + 1
        body[other], body[position] = body[position], body[other]
        return tree
    return ast.fix_missing_locations(_Remove(call).visit(tree))


class _Remove(ast.NodeTransformer):
    def __init__(self, target: ast.Call):
        self.target = target

    def visit_Expr(self, node: ast.Expr):
        if node.value is self.target:
            return ast.copy_location(ast.Pass(), node)
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        if node is self.target:
            return ast.copy_location(ast.Constant(None), node)
        return self.generic_visit(node)


def mutate(site: Site) -> types.ModuleType:
    """A fresh module object: ``site.module`` with that one call removed."""
    path, source = _source(site.module)
    tree = ast.parse(source)
    call, _ = _calls(tree)[site.index]
    tree = _mutated(tree, site, call)
    module = types.ModuleType(site.module)
    module.__file__ = path
    module.__package__ = site.module.rpartition(".")[0]
    # Decorators such as dataclass look the module up while it executes.
    original = sys.modules.get(site.module)
    sys.modules[site.module] = module
    try:
        exec(compile(tree, path, "exec"), module.__dict__)
    finally:
        if original is not None:
            sys.modules[site.module] = original
        else:
            del sys.modules[site.module]
    return module


def _overlay(site: Site, directory: Path) -> Path:
    """A copy of the top-level package under ``directory`` with ``site``'s
    module replaced by its mutant, so a fresh interpreter imports the mutant
    before anything can hold a reference to the original."""
    top = site.module.split(".")[0]
    path, source = _source(site.module)
    locations = importlib.util.find_spec(top).submodule_search_locations
    if locations:  # a package: copy it whole, extension modules included
        package = Path(locations[0])
        shutil.copytree(package, directory / top,  # compiled modules and kernels kept,
                        ignore=shutil.ignore_patterns("*.c", "*.html"))  # stamped by source
        target = directory / top / Path(path).relative_to(package)
    else:
        target = directory / Path(path).name
    tree = ast.parse(source)
    call, _ = _calls(tree)[site.index]
    target.write_text(ast.unparse(_mutated(tree, site, call)))
    return target


_RUNNER = """
import importlib, sys
sys.path.insert(0, {overlay!r})
module = importlib.import_module({module!r})
if not module.__file__.startswith({overlay!r}):
    raise SystemExit("mutant not in effect: " + module.__file__)
import pytest
raise SystemExit(pytest.main({arguments!r}))
"""


def _statement_lines(site: Site) -> range:
    """The lines of the innermost statement that holds ``site``'s call."""
    _, source = _source(site.module)
    tree = ast.parse(source)
    call, _ = _calls(tree)[site.index]
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.lineno <= call.lineno and node.end_lineno >= call.end_lineno \
                and any(child is call for child in ast.walk(node)):
            if best is None or node.lineno >= best.lineno and node.end_lineno <= best.end_lineno:
                best = node
    best = best or call
    return range(best.lineno, best.end_lineno + 1)


def _repository_file(relative: str) -> Path:
    return Path(importlib.util.find_spec("tract").submodule_search_locations[0]).parent / relative


def _call_span(text: str, start: int) -> int:
    """The end of the call whose name starts at ``start`` (after its ``)``)."""
    depth, at = 0, text.index("(", start)
    while True:
        if text[at] == "(":
            depth += 1
        elif text[at] == ")":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1


def _native_calls(path: str) -> list[tuple[int, int, str, str]]:
    """(start, end, call, enclosing function) of every native site in a
    ``.pyx`` or header, in source order."""
    text = _repository_file(path).read_text()
    header = path.endswith(".h")
    function, found = "<module>", []
    functions = re.compile(r"^\s*(?:cdef\s+|cpdef\s+|def\s+)(?:[\w\s\*]*?\s)?\*?(\w+)\s*\("
                           if not header else r"^static\s[^;]*?\b(\w+)\s*\([^;]*$")
    offset = 0
    for line in text.splitlines(keepends=True):
        match = functions.match(line)
        if match and not line.lstrip().startswith(("void ", "uint", "int ")):
            function = match.group(1)
        stripped = line.lstrip()
        code = line.split("#")[0] if not header else line.split("/*")[0].split("//")[0]
        in_scope = function in HEADER_PRIMITIVES if header else \
            not function.startswith("time_") and not stripped.startswith(("void ", "uint"))
        for match in re.finditer(r"\b(" + "|".join(NATIVE_CALLS) + r")\s*\(", code):
            if in_scope and not code[:match.start()].rstrip().endswith(("def", "void")):
                start = offset + match.start()
                found.append((start, _call_span(text, start), match.group(1), function))
        offset += len(line)
    return found


def native_sites(path: str) -> list[Site]:
    """Every cache-control call site of a native source (``.pyx``, the
    header's multi-instruction primitives) or of a kernel module, in
    source order; ``module`` is the path from the repository root."""
    if path.endswith(".py"):
        tree = ast.parse(_repository_file(path).read_text())
        calls = _calls(tree, kernel=True)
        found = [Site(path, index, call.lineno, call.col_offset, call.func.id, function)
                 for index, (call, function) in enumerate(calls)]
        movable = [_previous_statement(tree, call) is not None for call, _ in calls]
        ordered = order_sites(tree, found, calls, kernel=True)
    else:
        text = _repository_file(path).read_text()
        calls = _native_calls(path)
        found = [Site(path, index, text.count("\n", 0, start) + 1, 0, call, function)
                 for index, (start, _, call, function) in enumerate(calls)]
        movable = [_previous_lines(text, start) is not None for start, _, _, _ in calls]
        ordered = []
        for site, (start, end, call, _) in zip(found, calls):
            before = _previous_lines(text, start)
            if call == "tract_lines" and _NATIVE_WRITE_BACK.search(text[start:end]) and \
                    before and _NATIVE_STORE.search(_code(text[before[0]:before[1]])):
                ordered.append(dataclasses.replace(site, mutation="late-store"))
            if call in ("tract_fence", "tract_load_fence") and _next_lines(text, start):
                ordered.append(dataclasses.replace(site, mutation="early-read"))
        ordered += _weakened(path, text) + _silenced(path, text)
    return found + [dataclasses.replace(site, mutation="move") for site, can in
                    zip(found, movable) if can and site.kind in FENCES] + ordered


#: a native write-back: a `tract_lines` call with no invalidation's or
#: payload's instruction (those drop lines to read them)
_NATIVE_WRITE_BACK = re.compile(r"^(?!.*(?:_invalidate_insn|_payload_insn))", re.S)
#: a native statement that stores to memory: an element assigned, a copy
_NATIVE_STORE = re.compile(
    r"\]\s*=(?!=)|->\w+\s*=(?!=)|\b(?:memcpy|memset|tract_stream_\w+|\w+_copy)\s*\(")
#: a native statement that reads memory: an element or a copy on its right
#: side, or a call of a step that reads the lines just made fresh
_NATIVE_READ = re.compile(
    r"[\w)]\s*\[|\bmemcpy\s*\(|\b\w*(?:_fenced|_mine|_digest_copy|_stream_out)\s*\(")


def _code(text: str) -> str:
    """``text`` without its comments (``#``, ``//`` and ``/* */`` on a line)."""
    return "\n".join(line.split("#")[0].split("//")[0].split("/*")[0]
                     for line in text.splitlines())


def _reads(statement: str) -> bool:
    """Whether a native statement reads memory (`_NATIVE_READ` on what it
    evaluates: its right side when it assigns)."""
    code = _code(statement)
    head = code.splitlines()[0] if code.strip() else ""
    if head.lstrip().startswith(("break", "continue", "pass", "else", "}")):
        return False
    assigned = re.split(r"(?<![=!<>])=(?!=)", code, maxsplit=1)
    return bool(_NATIVE_READ.search(assigned[-1]))


def _statement_end(text: str, start: int) -> int:
    """The end (past its newline) of the statement whose first line starts
    at ``start``: its continuation and block lines (deeper indented), and a
    closing brace at its own indentation."""
    line_end = text.index("\n", start) + 1
    indent = len(text[start:line_end]) - len(text[start:line_end].lstrip())
    at = end = line_end
    depth = 0
    for char in text[start:line_end]:
        depth += char in "([{"
        depth -= char in ")]}"
    while at < len(text):
        next_end = text.index("\n", at) + 1 if "\n" in text[at:] else len(text)
        line = text[at:next_end]
        stripped = line.strip()
        deeper = len(line) - len(line.lstrip()) > indent
        if stripped and not deeper and depth <= 0 and not stripped.startswith("}"):
            break
        for char in line:
            depth += char in "([{"
            depth -= char in ")]}"
        at = next_end
        if stripped:
            end = next_end
        if stripped.startswith("}") and not deeper:
            break
    return end


def _next_lines(text: str, start: int) -> tuple[int, int, int] | None:
    """For the fence whose call starts at ``start`` on a line of its own:
    (its line's start, the start and the end of the first statement after
    it that reads memory).  That statement is in the fence's block or, when
    the fence ends a ``with nogil:`` block, right after that block; a
    declaration without a value is passed over.  None when there is none."""
    line_start = text.rfind("\n", 0, start) + 1
    indent = start - line_start
    if text[line_start:start].strip():
        return None
    at = text.index("\n", start) + 1
    while at < len(text):
        line_end = text.index("\n", at) + 1
        line = text[at:line_end]
        stripped = line.strip()
        depth = len(line) - len(line.lstrip())
        if not stripped or stripped.startswith(("#", "/*", "*", "//")):
            at = line_end
            continue
        if depth < indent:
            if depth == indent - 4 and _block_opener(text, line_start, indent) == "with nogil:":
                indent = depth  # the fence ends a nogil block: the statement after it
                continue
            return None
        if depth > indent:
            at = line_end
            continue
        end = _statement_end(text, at)
        if stripped.startswith("cdef ") and "=" not in stripped:
            at = end
            continue
        return (line_start, at, end) if _reads(text[at:end]) else None
    return None


#: a Cython cast (``<uint64_t>``, ``<char *>``): no comparison
_CAST = re.compile(r"<\s*(?:const\s+|volatile\s+)*[A-Za-z_]\w*(?:\s*\*)*\s*>")
_COMPARISON = re.compile(r"<=|>=|(?<![<>])<(?![<=])|(?<![<>-])>(?![>=])")
#: what a weakened bound becomes: under ``not`` a strict bound admits its
#: edge; else a non-strict one stops before it, a strict one one further on
_WEAKER = {"<": "<=", ">": ">=", "<=": "<= 1 +", ">=": ">= -1 +"}
_WEAKER_PLAIN = {"<=": "<", ">=": ">", ">": "> 1 +", "<": "< -1 +"}


def _weakened(path: str, text: str) -> list[Site]:
    """The ``weaken`` sites of a ``.pyx``: each guard on a value loaded
    from memory that hands a hard case back (``if``/``elif <condition>:``
    whose block starts with ``return``, outside ``__cinit__``; the
    condition reads an element or a name assigned from one) weakened in
    turn: removed, each of its ``or`` terms dropped, each comparison moved
    past its edge (see `_WEAKER`).  These are where a native step bounds
    what it read from the pool (R5): the fast paths of `NATIVE_SUITES`."""
    if not path.endswith(".pyx") or path not in NATIVE_SUITES:
        return []  # node-local memory (the node heap) is no pool memory: R5 is the pool's
    found = []
    for function, start, end in _guards(text):
        line = text.count("\n", 0, start) + 1
        for detail, _ in _weakenings(text[start:end]):
            found.append(Site(path, start, line, end, "bound", function, "weaken", detail))
    return found


def _silenced(path: str, text: str) -> list[Site]:
    """The ``silent`` sites of the header: each instruction of cache control
    in its primitive (`SILENT_PRIMITIVES`)."""
    if not path.endswith(".h"):
        return []
    found, function = [], None
    for match in re.finditer(r"^static\s[^;]*?\b(\w+)\s*\([^;]*$|" + SILENT_INSTRUCTIONS.pattern,
                             text, re.M):
        if match.group(1):
            function = match.group(1)
        elif function in SILENT_PRIMITIVES:
            name = match.group().split("(")[0].strip()
            found.append(Site(path, match.start(), text.count("\n", 0, match.start()) + 1, 0,
                              name, function, "silent"))
    return found


def _guards(text: str) -> list[tuple[str, int, int]]:
    """(function, start, end) of the condition of every hand-back guard."""
    guards, function, at, read = [], "<module>", 0, set()
    header = re.compile(r"^(\s*)(?:cdef|cpdef|def)\s.*?(\w+)\s*\(")
    assignment = re.compile(r"^\s*(?:cdef\s+[\w\s\*]*?)?\b(\w+(?:\s*,\s*\w+)*)\s*"
                            r"(?:\[[^\]]*\])?\s*=(?!=)(.*)")
    while at < len(text):
        line_end = text.index("\n", at) + 1 if "\n" in text[at:] else len(text)
        line = text[at:line_end]
        match = header.match(line)
        if match and "=" not in line.split("(")[0]:
            function, read = match.group(2), set()
        code = re.sub(r"\.shape\s*\[[^\]]*\]", "", _code(line))  # a buffer's size: no load
        assigned = assignment.match(code)
        if assigned and re.search(r"[\w)]\s*\[|\bmemcpy\s*\(", assigned.group(2)):
            read.update(re.findall(r"\w+", assigned.group(1)))  # values loaded from memory
        copied = re.search(r"\bmemcpy\s*\(\s*&?(\w+)", code)
        if copied:
            read.add(copied.group(1))
        guard = re.match(r"^(\s*)(?:el)?if\s", line)
        if guard and function not in ("__cinit__", "__init__"):
            start = at + guard.end()
            colon = _condition_end(text, start)
            body = text[colon:].lstrip(" :\n")
            condition = text[start:colon]
            names = set(re.findall(r"\b\w+\b", condition))
            if colon > start and body.startswith("return") and \
                    re.search(r"==|!=|<|>", _CAST.sub(lambda m: " " * len(m.group()),
                                                       condition)) and \
                    (names & read or re.search(r"\w\s*\[", condition)):
                guards.append((function, start, colon))
        at = line_end
    return guards


def _condition_end(text: str, start: int) -> int:
    """Where an ``if`` condition starting at ``start`` ends (its colon)."""
    depth, at = 0, start
    while at < len(text):
        char = text[at]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == ":" and depth == 0:
            return at
        elif char == "\n" and depth == 0 and not text[:at].rstrip(" ").endswith("\\"):
            return start
        at += 1
    return start


def _weakenings(condition: str) -> list[tuple[str, str]]:
    """(what changed, the weakened condition) for one guard's condition."""
    out = [("guard removed", "False")]
    terms = _terms(condition)
    if len(terms) > 1:
        for index, (low, high) in enumerate(terms):
            kept = [condition[a:b].strip() for i, (a, b) in enumerate(terms) if i != index]
            dropped = " ".join(condition[low:high].replace("\\\n", " ").split())
            out.append((f"'{dropped}' dropped", "(" + " or ".join(
                " ".join(term.replace("\\\n", " ").split()) for term in kept) + ")"))
    masked = _CAST.sub(lambda m: " " * len(m.group()), condition)
    seen: dict[str, int] = {}
    for match in _COMPARISON.finditer(masked):
        seen[match.group()] = seen.get(match.group(), 0) + 1
        term = next((condition[a:b] for a, b in terms if a <= match.start() < b), condition)
        negated = term.lstrip().startswith("not ")
        weaker = (_WEAKER if negated else _WEAKER_PLAIN).get(match.group())
        if weaker is None:
            continue
        changed = condition[:match.start()] + weaker + condition[match.end():]
        shown = " ".join(term.replace("\\\n", " ").split())
        nth = f" (occurrence {seen[match.group()]})" if seen[match.group()] > 1 else ""
        out.append((f"'{match.group()}'{nth} to '{weaker}' in '{shown}'", changed))
    return out


def _terms(condition: str) -> list[tuple[int, int]]:
    """The spans of a condition's top-level ``or`` terms."""
    spans, depth, low = [], 0, 0
    for match in re.finditer(r"[()\[\]]|\bor\b", condition):
        token = match.group()
        if token in "([":
            depth += 1
        elif token in ")]":
            depth -= 1
        elif depth == 0:
            spans.append((low, match.start()))
            low = match.end()
    spans.append((low, len(condition)))
    return spans


def _block_opener(text: str, line_start: int, indent: int) -> str:
    """The header line of the block whose statements, at ``indent``,
    include the line at ``line_start``."""
    at = line_start
    while at > 0:
        previous = text.rfind("\n", 0, at - 1) + 1
        line = text[previous:at]
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            return line.strip()
        at = previous
    return ""


def _previous_lines(text: str, start: int) -> tuple[int, int] | None:
    """For the statement line holding ``start``: the span of the statement
    before it in the same block (by indentation, with its own block and
    continuation lines), or None when it is the first of its block or
    shares its line with other code."""
    line_start = text.rfind("\n", 0, start) + 1
    indent = start - line_start
    if text[line_start:start].strip():
        return None  # `if x: fence()` and the like
    at = line_start
    while at > 0:
        previous = text.rfind("\n", 0, at - 1) + 1
        line = text[previous:at]
        stripped = line.strip()
        depth = len(line) - len(line.lstrip())
        at = previous
        if not stripped or stripped.startswith(("#", "/*", "*", "//")):
            continue
        if depth < indent:
            return None
        if depth > indent or stripped.startswith(("else", "elif", "}", "cdef ", '"', "'")):
            continue  # inside the statement (its block, a continuation), or no statement
            # (a declaration, a docstring: nothing to order)
        return previous, line_start
    return None


def native_mutant(site: Site) -> str:
    """The source of ``site.module`` with that one call removed."""
    text = _repository_file(site.module).read_text()
    if site.module.endswith(".py"):
        tree = ast.parse(text)
        call, _ = _calls(tree, kernel=True)[site.index]
        return ast.unparse(_mutated(tree, site, call))
    if site.mutation == "silent":
        return text[:site.index] + BARRIER + text[_call_span(text, site.index):]
    if site.mutation == "weaken":
        condition = text[site.index:site.col]
        weaker = dict(_weakenings(condition))[site.detail]
        return text[:site.index] + " ".join(weaker.replace("\\\n", " ").split()) + \
            text[site.col:]
    start, end, _, _ = _native_calls(site.module)[site.index]
    if site.mutation in ("move", "late-store"):
        before, line_start = _previous_lines(text, start)
        line_end = text.index("\n", end) + 1
        return text[:before] + text[line_start:line_end] + text[before:line_start] + \
            text[line_end:]
    if site.mutation == "early-read":  # the fence after the read it makes fresh
        line_start, read_start, read_end = _next_lines(text, start)
        line_end = text.index("\n", end) + 1
        indent = len(text[read_start:]) - len(text[read_start:].lstrip())
        fence = " " * indent + text[start:end] + (";" if site.module.endswith(".h") else "") + "\n"
        left = text[:line_start] + " " * (start - line_start) + \
            ("(void)0;\n" if site.module.endswith(".h") else "pass\n")
        return left + text[line_end:read_end] + fence + text[read_end:]
    return text[:start] + ("(void)0" if site.module.endswith(".h") else "pass") + text[end:]


def _native_overlay(site: Site, directory: Path, text: str | None = None) -> str | None:
    """The package copied under ``directory`` with ``site``'s source
    mutated (or replaced by ``text``: a schema) and, for native code, its
    extension rebuilt there.  Returns an error message when the build
    fails."""
    package = _repository_file("tract")
    shutil.copytree(package, directory / "tract",
                    ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.html"))
    kernels = package / "_kernels" / "__pycache__"
    if kernels.is_dir():  # the compiled kernels (their sources' stamps kept): only the
        shutil.copytree(kernels, directory / "tract" / "_kernels" / "__pycache__")  # mutated
        # kernel, whose stamp differs, is compiled again
    (directory / site.module).write_text(native_mutant(site) if text is None else text)
    extension, _ = NATIVE_SUITES[site.module]
    if extension is None:
        return None
    built = directory / "tract" / "_native" / (extension.rpartition(".")[2] +
                                               sysconfig.get_config_var("EXT_SUFFIX"))
    optimize = SILENT_OPTIMIZE if site.mutation == "silent" else MUTANT_OPTIMIZE
    cached = _builds_dir() / f"{_build_key(directory, extension, optimize)}.so"
    try:  # one build of a source at a time (a schema's mutants wait for its one build)
        cached.parent.mkdir(parents=True, exist_ok=True)
        lock = open(cached.with_suffix(".lock"), "w")
    except OSError:
        lock = None
    try:
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if cached.exists():  # this very source built before (same sources, same toolchain)
            shutil.copyfile(cached, built)
            os.utime(cached)
            return None
        generated = built.parent / (built.name.partition(".")[0] + ".c")
        translated = _builds_dir() / f"{_build_key(directory, extension, '.c')}.c"
        reuse = site.module.endswith(".h") and translated.exists()  # a header mutant: the
        if reuse:  # Cython source is the original's, and so is its C translation
            shutil.copyfile(translated, generated)
            os.utime(translated)
        failed = build_extension(directory, extension, optimize=optimize, cythonize=not reuse)
        if failed:
            return f"build failed: {failed[-400:]}"
        if not site.module.endswith(".pyx") and not reuse:
            try:
                partial = translated.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
                shutil.copyfile(generated, partial)
                partial.rename(translated)
            except OSError:
                pass
        try:
            partial = cached.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
            shutil.copyfile(built, partial)
            partial.rename(cached)
        except OSError:
            pass  # the cache is only a speed-up
        return None
    finally:
        if lock is not None:
            lock.close()


def _builds_dir() -> Path:
    return _killers_file().parent / "builds"


def _build_key(directory: Path, extension: str, optimize: str) -> str:
    """What a mutant's build depends on: the extension, every native source
    of the overlay (the mutated one among them), the build script and the
    toolchain (interpreter, Cython, numpy, compiler).  With ``optimize``
    ".c", what its C translation depends on (the headers left out)."""
    import Cython
    import numpy

    from tract.bench import trace

    digest = hashlib.sha256()
    for part in (extension, sys.version, Cython.__version__, numpy.__version__,
                 sysconfig.get_config_var("CC") or "", trace.BUILD_SCRIPT, optimize):
        digest.update(part.encode() + b"\0")
    for path in sorted((directory / "tract" / "_native").iterdir()):
        if path.suffix in ((".pyx", ".pxd") if optimize == ".c" else (".pyx", ".pxd", ".h")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def prune_builds(days: float = 14.0) -> None:
    """Drop cached mutant builds unused for ``days`` (each hit touches its file)."""
    cutoff = time.time() - days * 86400
    for path in [*_builds_dir().glob("*.so"), *_builds_dir().glob("*.c")]:
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                path.with_suffix(".lock").unlink(missing_ok=True)
        except OSError:
            pass


def coverage_arguments(modules: list[str] | None = None) -> list[str]:
    """pytest-cov's arguments that measure ``modules`` (default: every
    module of `SUITES`) and nothing else: the simulator and the rest of the
    package, where simulated tests spend most of their time, untraced (a
    run measuring all of ``tract`` took 2.3 times one measuring nothing)."""
    return [f"--cov={module}" for module in (modules or sorted(SUITES))]


def coverage_map(suite: tuple[str, ...], modules: list[str], root: Path, seeds: int,
                 timeout: float = 3600) -> tuple[str, dict[str, dict[int, set[str]]]]:
    """Run one suite unmutated under coverage.py with a context per test.
    Returns its outcome ("passed", "failed" or "error: ...") and, for each
    module, line -> the ids of the tests that executed it."""
    env = dict(os.environ, **{SEEDS_ENV: str(seeds)})
    with tempfile.TemporaryDirectory(prefix="tract-coverage-") as scratch:
        data_file = Path(scratch) / ".coverage"
        env["COVERAGE_FILE"] = str(data_file)
        command = [sys.executable, "-m", "pytest", "-q", "-m", "sim", "-p", "no:cacheprovider",
                   *coverage_arguments(modules), "--cov-context=test", "--cov-report=", *suite]
        try:
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "error: the unmutated suite timed out", {}
        outcome = "passed" if done.returncode == 0 else \
            f"error: exit {done.returncode}: {(done.stdout + done.stderr)[-400:]}"
        return outcome, covering_tests(data_file, modules, suite)


def covering_tests(data_file: Path, modules: list[str], suite: tuple[str, ...]
                   ) -> dict[str, dict[int, set[str]]]:
    """From coverage data recorded with one context per test (pytest-cov's
    ``--cov-context=test``): for each module, line -> the ids of the tests
    of ``suite`` (its test files) that executed it."""
    import coverage  # only the harness needs it

    lines: dict[str, dict[int, set[str]]] = {module: {} for module in modules}
    if not Path(data_file).exists():
        return lines
    data = coverage.CoverageData(basename=str(data_file))
    data.read()
    measured = {os.path.realpath(name): name for name in data.measured_files()}
    prefixes = tuple(f"{test_file}::" for test_file in suite)
    for module in modules:
        name = measured.get(os.path.realpath(_source(module)[0]))
        if name is None:
            continue
        for line, contexts in data.contexts_by_lineno(name).items():
            tests = {context.split("|")[0] for context in contexts
                     if context.startswith(prefixes)}
            if tests:
                lines[module][line] = tests
    return lines


def _killers_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "tract" / "mutants" / "killers.json"


#: the killer of each site as last recorded, in the repository (a clean
#: clone runs each mutant's killer first too); the user's cache overrides it
KILLERS_RECORD = "tests/mutant_killers.json"


#: the outcome of a mutant another run (``--share``) claimed first
ELSEWHERE = "claimed by another run"


def _claim(directory: Path, key: str) -> bool:
    """Whether this run claimed the mutant ``key`` in ``directory`` (one
    file per mutant, created exclusively: exactly one run gets each)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        os.close(os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def _killer(recorded) -> tuple[str | None, int | None]:
    """A recorded killer: its test, and the seed it failed at when known."""
    if isinstance(recorded, list):
        return recorded[0], recorded[1]
    return recorded, None


def site_keys(every: list[Site]) -> list[str]:
    """A key per site that an edit elsewhere in its file keeps: module,
    function, kind, mutation and detail, then the site's rank among the
    sites of its function that share them (no line number)."""
    seen: dict[str, int] = {}
    keys = []
    for site in every:
        stem = f"{site.module}:{site.function}:{site.kind}:{site.mutation}:{site.detail}"
        seen[stem] = seen.get(stem, -1) + 1
        keys.append(f"{stem}:{seen[stem]}")
    return keys


def record_killers(root: Path, keys: list[str], killers: dict[str, str]) -> None:
    """Write `KILLERS_RECORD` under ``root``: the killer of each of ``keys``
    known in ``killers``, with the recorded ones of every other site kept."""
    path = root / KILLERS_RECORD
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        recorded = {}
    recorded.update({key: killers[key] for key in keys if key in killers})
    path.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


def run_mutant(site: Site | None, module: str, root: Path, seeds: int,
               timeout: float = 900, tests: list[str] | None = None,
               first_seed: int | None = None,
               schema: tuple[str, int] | None = None) -> str:
    """Run ``module``'s simulated tests against one mutant (None: the
    unmutated module): ``tests`` (pytest ids, in that order) when given, else
    the whole suite, each test's seeds from ``first_seed`` on when it has
    that one (`tract.testing.seeds`); a native mutant from ``schema`` (its
    source's schema and the mutant's number in it) when given.  Returns
    "passed", "failed [by TEST [at seed N]]" or "error: ..."."""
    env = dict(os.environ, **{SEEDS_ENV: str(seeds)})
    env.pop(sim_seeds.FIRST_ENV, None)
    env.pop(schemata.ENV, None)
    if first_seed is not None:
        env[sim_seeds.FIRST_ENV] = str(first_seed)
    native = module in NATIVE_SUITES
    arguments = ["-q", "-x", "-rf", "-m", NATIVE_MARKERS if native else "sim",
                 "-p", "no:cacheprovider", "-p", "tract.testing.seeds",
                 *(tests or (NATIVE_SUITES[module][1] if native else SUITES[module]))]
    with tempfile.TemporaryDirectory(prefix="tract-mutant-") as scratch:
        env[sim_seeds.REPORT_ENV] = report = os.path.join(scratch, "seeds.jsonl")
        if site is None:
            command = [sys.executable, "-m", "pytest", *arguments]
        elif native:
            failed = _native_overlay(site, Path(scratch), schema and schema[0])
            if schema:
                env[schemata.ENV] = str(schema[1])
            if failed:
                return f"error: {failed}"
            target = NATIVE_SUITES[module][0] or \
                "tract." + module.removeprefix("tract/").removesuffix(".py").replace("/", ".")
            env.pop("NUMBA_CACHE_DIR", None)  # the overlay's own (see _native_overlay)
            command = [sys.executable, "-c", _RUNNER.format(
                overlay=scratch, module=target, arguments=arguments)]
        else:
            _overlay(site, Path(scratch))
            command = [sys.executable, "-c", _RUNNER.format(
                overlay=scratch, module=module, arguments=arguments)]
        try:
            done = _run_tests(command, root, env, timeout)
        except subprocess.TimeoutExpired:
            return "failed"  # a mutant that hangs its tests is caught by them
        failing = []  # (test id, seed or None), as the plugin saw them fail
        if os.path.exists(report):
            with open(report) as lines:
                failing = [(entry["test"], entry["seed"]) for entry in map(json.loads, lines)]
    if done.returncode == 0:
        return "passed"
    if done.returncode < 0:  # the mutant crashed its tests' process: they noticed it
        return f"failed: its tests crashed (signal {-done.returncode})"
    if done.returncode == 1:
        if failing:  # its id whole (an id may hold spaces: a summary line cannot tell)
            test, seed = failing[0]
            return f"failed by {test}" + ("" if seed is None else f" at seed {seed}")
        for line in done.stdout.splitlines():
            if line.startswith("FAILED "):  # failed outside a test's call (a fixture)
                return "failed by " + line.removeprefix("FAILED ").split(" - ")[0]
        return "failed"
    return f"error: exit {done.returncode}: {(done.stdout + done.stderr)[-400:]}"


def _run_tests(command: list[str], root: Path, env: dict, timeout: float
               ) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a mutant's tests, and then the pools its
    process left in /dev/shm (tests/conftest.py names them by its pid): a
    mutant that crashes its tests' process skips their teardown."""
    if command[:2] == [sys.executable, "-c"]:  # forked from a server that imported the rest
        try:
            return _forked(command[2], root, env, timeout)
        except forkserver.Unavailable:
            pass
    with subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise
        finally:
            _destroy_pools_of(child.pid)
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


# The fork servers of this process's mutant runs (`tract.testing.forkserver`):
# each run's own variables are the seeds and report files the plugin reads.
_SERVERS = forkserver.Servers(frozenset({SEEDS_ENV, sim_seeds.FIRST_ENV, sim_seeds.REPORT_ENV,
                                         schemata.ENV}))
atexit.register(_SERVERS.close)


def _forked(code: str, root: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code`` forked from a server, and then the pools its
    process left (as `_run_tests`)."""
    pid = None
    try:
        done = _SERVERS.run(code, root, env, timeout)
        pid = done.pid
        return done
    except subprocess.TimeoutExpired as expired:
        pid = expired.pid
        raise
    finally:
        if pid is not None:
            _destroy_pools_of(pid)


def _destroy_pools_of(pid: int) -> None:
    from tract.pool import Pool

    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        if name.startswith(f"tract-test-{pid}-"):
            try:
                Pool.destroy(os.path.join("/dev/shm", name))
            except OSError:
                pass


def _schemas(every: list[Site]) -> list[tuple[str, int] | None]:
    """Each site's schema and number in it (`tract.testing.schemata`): the
    Cython sources' mutants, but for the ``silent`` ones (built optimized)
    and those the schema cannot hold; None for the others."""
    found: list[tuple[str, int] | None] = [None] * len(every)
    for source in {site.module for site in every if site.module.endswith(".pyx")}:
        indices = [index for index, site in enumerate(every)
                   if site.module == source and site.mutation != "silent"]
        text, held = schemata.schema(_repository_file(source).read_text(),
                                     [native_mutant(every[index]) for index in indices])
        for number in held:
            found[indices[number]] = (text, number + 1)
    return found


def _tally(every: list[Site], outcomes: list[str]) -> dict[str, dict[str, int]]:
    """Per kind of mutation: its sites and how many were killed."""
    tally: dict[str, dict[str, int]] = {}
    for site, outcome in zip(every, outcomes):
        entry = tally.setdefault(site.mutation, {"sites": 0, "killed": 0})
        entry["sites"] += 1
        entry["killed"] += outcome.startswith("failed")
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tract.testing.mutants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(SUITES) + sorted(NATIVE_SUITES),
                        help="protocol module or native source to mutate (default: all)")
    parser.add_argument("--kind", choices=("python", "native", "all"), default="all",
                        help="mutate only the Python protocol modules, or only the native "
                             "sources (default: all; --module narrows further)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seeds", type=int, default=200,
                        help="simulator seeds per test for each mutant (default 200)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--full", action="store_true",
                        help="run every mutant against its whole suite (no coverage selection)")
    parser.add_argument("--coverage", type=Path, metavar="FILE",
                        help="coverage data of a passed run of every simulated test, one "
                             "context per test (make test's sim-coverage tier): the map is "
                             "read from it instead of running each suite unmutated")
    parser.add_argument("--mutation", action="append",
                        choices=("delete", "move", "late-store", "early-read", "weaken",
                                 "silent"),
                        help="run only mutants of this kind (repeatable; default: all)")
    parser.add_argument("--moves", action="store_true",
                        help="also move each fence of the Python modules before the statement "
                             "it follows (native fences are always moved too)")
    parser.add_argument("--coverage-arguments", action="store_true",
                        help="print pytest-cov's arguments that record the map --coverage "
                             "reads (every protocol module, nothing else), and exit")
    parser.add_argument("--record", action="store_true",
                        help=f"write each run site's killer to {KILLERS_RECORD} (commit it: "
                             "a clean clone then runs each killer first)")
    parser.add_argument("--share", type=Path, metavar="DIR",
                        help="claim each mutant in DIR before running it: runs given the same "
                             "DIR split the mutants between them, each reporting its own "
                             "(make test's two lanes)")
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="repository root holding the tests (default: .)")
    args = parser.parse_args(argv)
    if args.coverage_arguments:
        print(*coverage_arguments())
        return 0
    chosen = args.module or ((sorted(SUITES) if args.kind != "native" else []) +
                             (sorted(NATIVE_SUITES) if args.kind != "python" else []))
    modules = [module for module in chosen if module in SUITES]
    natives = [source for source in chosen if source in NATIVE_SUITES]

    every = [site for module in modules for site in sites(module, args.moves)] + \
        [site for source in natives for site in native_sites(source)]
    if args.mutation:
        every = [site for site in every if site.mutation in args.mutation]
    equivalents = [dict(site.as_dict(), reason=equivalent(site)) for site in every
                   if equivalent(site)]
    every = [site for site in every if not equivalent(site)]
    suites: dict[tuple[str, ...], list[str]] = {}
    for module in modules:  # tract.lock and tract.lease share one suite
        suites.setdefault(tuple(SUITES[module]), []).append(module)
    keys = site_keys(every)
    killers_file = _killers_file()
    killers = {}
    for source in (args.root / KILLERS_RECORD, killers_file):  # the cache last: it wins
        try:
            killers.update(json.loads(source.read_text()))
        except (OSError, ValueError):
            pass
    uncovered: list[dict] = []
    errors: list[dict] = []
    sysconfig.get_config_vars()  # filled once, here: its first filling is not thread-safe
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        lines: dict[str, dict[int, set[str]]] = {}
        if args.full:
            unmutated = {suite: pool.submit(run_mutant, None, members[0], args.root, args.seeds)
                         for suite, members in suites.items()}
        elif args.coverage is not None:
            if not args.coverage.exists():
                parser.error(f"--coverage {args.coverage}: no such coverage data file")
            unmutated = {suite: concurrent.futures.Future() for suite in suites}
            for suite, members in suites.items():
                unmutated[suite].set_result(("passed", covering_tests(
                    args.coverage, members, tuple(str(Path(test)) for test in suite))))
        else:
            unmutated = {suite: pool.submit(coverage_map, suite, members, args.root,
                                              min(args.seeds, COVERAGE_SEEDS))
                         for suite, members in suites.items()}
        if not args.full:
            for future in unmutated.values():
                lines.update(future.result()[1])
        selections: list[list[str] | None] = []
        firsts: list[int | None] = []
        for site, key in zip(every, keys):
            first, seed = _killer(killers.get(key))
            firsts.append(seed)
            if site.mutation == "silent":  # only the machine code shows it
                selections.append(SILENT_TESTS)
                continue
            if site.module in NATIVE_SUITES:  # no coverage of native code: the twin suite,
                # after its last killer alone (pytest runs a file's tests in file order,
                # even when one of them is named before it)
                selections.append([first] if first and not args.full else None)
                continue
            if args.full:
                selections.append(None)
                continue
            covering = set()
            for line in _statement_lines(site):
                covering |= lines.get(site.module, {}).get(line, set())
            if not covering:
                uncovered.append(site.as_dict())
                selections.append(None)  # never skipped: the whole suite
                continue
            if first and first.partition("[")[0] in {test.partition("[")[0] for test in covering}:
                covering.add(first)  # a seed of a test parametrized by seed, past the map's
            selections.append(sorted(covering, key=lambda test: (test != first, test)))

        schemas = _schemas(every)

        def judged(site: Site, tests: list[str] | None, first: int | None,
                   schema: tuple[str, int] | None) -> str:
            outcome = run_mutant(site, site.module, args.root, args.seeds, tests=tests,
                                 first_seed=first, schema=schema)
            if not outcome.startswith("failed") and site.module in NATIVE_SUITES and \
                    tests is not None and site.mutation != "silent":
                # its last killer alone passed (or is gone: renamed, removed): the whole suite
                outcome = run_mutant(site, site.module, args.root, args.seeds, schema=schema)
            elif outcome == "passed" and tests is not None and site.module in SUITES:
                # it survived the tests the map names: the whole suite decides
                outcome = run_mutant(site, site.module, args.root, args.seeds)
            return outcome

        def timed(item) -> tuple[str, float]:
            site, tests, first, key, schema = item
            if args.share and not _claim(args.share, key):
                return ELSEWHERE, 0.0
            start = time.monotonic()
            outcome = judged(site, tests, first, schema)
            if schema is not None and not outcome.startswith("failed"):
                # only a kill is taken from the schema: a survivor, or an error, is
                # judged again on a build of its own text
                outcome = judged(site, tests, first, None)
            return outcome, time.monotonic() - start

        outcomes, seconds = zip(*pool.map(timed, zip(every, selections, firsts, keys,
                                                     schemas))) if every else ((), ())
    if args.share:  # the mutants this run claimed, only
        mine = [index for index, outcome in enumerate(outcomes) if outcome != ELSEWHERE]
        every, keys = [every[i] for i in mine], [keys[i] for i in mine]
        outcomes, seconds = [outcomes[i] for i in mine], [seconds[i] for i in mine]
        uncovered = [site for site in uncovered if site in map(Site.as_dict, every)]
    for suite, future in unmutated.items():
        result = future.result() if args.full else future.result()[0]
        if result != "passed":
            errors.append({"module": suites[suite][0], "mutant": None, "result": result})
    found = {}
    for key, outcome in zip(keys, outcomes):
        if outcome.startswith("failed by "):
            test, _, seed = outcome.removeprefix("failed by ").partition(" at seed ")
            found[key] = [test, int(seed)] if seed else test
    killers.update(found)
    if args.record:
        record_killers(args.root, keys, killers)
    prune_builds()
    try:  # merged into the cache as it is now: a run sharing the mutants writes it too
        killers_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            cached = json.loads(killers_file.read_text())
        except (OSError, ValueError):
            cached = {}
        partial = killers_file.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps({**cached, **found}, indent=1, sort_keys=True) + "\n")
        partial.rename(killers_file)
    except OSError:
        pass  # the order is only a speed-up
    survivors = [site.as_dict() for site, outcome in zip(every, outcomes) if outcome == "passed"]
    errors += [dict(site.as_dict(), result=outcome) for site, outcome in zip(every, outcomes)
               if outcome.startswith("error")]
    killed = sum(outcome.startswith("failed") for outcome in outcomes)
    report = {"sites": len(every), "killed": killed, "survivors": survivors,
              "uncovered": uncovered, "equivalent": equivalents,
              "mutations": _tally(every, outcomes),
              "tests_run": "all" if args.full else "covering",
              "slowest": [dict(site.as_dict(), seconds=round(took, 1), result=outcome)
                          for took, site, outcome in sorted(zip(seconds, every, outcomes),
                                                            key=lambda x: -x[0])[:SLOWEST]]}
    if errors:
        report["errors"] = errors
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(every)} sites in {', '.join(chosen)}: {killed} killed, "
              f"{len(survivors)} survived, {len(errors)} errors "
              f"({'every test' if args.full else 'covering tests only'}; "
              f"{len(uncovered)} sites uncovered, run against their whole suite)")
        for mutation, tally in report["mutations"].items():
            print(f"  {mutation}: {tally['sites']} sites, {tally['killed']} killed")
        print(f"  {sum(seconds):.0f} s of mutant runs; the slowest:")
        for slow in report["slowest"]:
            print(f"    {slow['seconds']:6.1f} s  {slow['module']}:{slow['line']} {slow['kind']} "
                  f"({slow['mutation']}): {slow['result']}")
        for site in uncovered:
            print(f"  UNCOVERED {site['module']}:{site['line']} {site['kind']} "
                  f"in {site['function']}")
        for site in equivalents:
            print(f"  EQUIVALENT {site['module']}:{site['line']} {site['kind']} "
                  f"in {site['function']} ({site['mutation']}): {site['reason']}")
        for survivor in survivors:
            print(f"  SURVIVED {survivor['module']}:{survivor['line']} {survivor['kind']} "
                  f"in {survivor['function']} ({survivor['mutation']})")
        for error in errors:
            print(f"  ERROR {error}")
    return 1 if survivors or errors else 0


if __name__ == "__main__":
    sys.exit(main())
