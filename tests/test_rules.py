"""Repository rules that keep one room per mechanism: production code
imports nothing of `tract.testing`, and no module imports another's
underscore names (a module's private layout, checks and steps stay its
own)."""

import ast
from pathlib import Path

import numpy as np

import tract
import twins

ROOT = Path(tract.__file__).parent


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(("tract",) + path.relative_to(ROOT).with_suffix("").parts)
        yield name.removesuffix(".__init__"), ast.parse(path.read_text(), str(path))


def _imports(tree):
    """(imported module, names) of every import in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


def test_production_code_imports_nothing_of_tract_testing():
    found = [(name, module) for name, tree in _modules()
             if not name.startswith("tract.testing")
             for module, names in _imports(tree)
             if module.startswith("tract.testing")
             or (module == "tract" and "testing" in names)]
    assert found == []


def test_no_module_imports_another_modules_underscore_names():
    modules = {name for name, _ in _modules()}
    found = [(name, module, imported) for name, tree in _modules()
             for module, names in _imports(tree)
             if module.startswith("tract")
             for imported in names
             if imported.startswith("_") and not imported.startswith("__") and module != name
             and f"{module}.{imported}" not in modules  # a private module of the package
             and not module.startswith("tract._native")]  # the extensions' own Python API
    assert found == []


def test_the_rules_see_imports():
    """The checks above find what they look for (they are not vacuous)."""
    tree = ast.parse("from tract.testing import faults\nfrom tract.lock import _x\n")
    assert list(_imports(tree)) == [("tract.testing", ["faults"]), ("tract.lock", ["_x"])]


# ------------------------------------------------------------ fast twins

FAST_MODULES = ("tract._kernels.indexfast", "tract._native._allocfast",
                "tract._native._handofffast", "tract._native._lockfast",
                "tract._native._nodeheap")
#: the batched native steps of the mapping (its single primitives are what
#: every trace is made of, and are held to the simulator's model of them)
REGION_STEPS = ("copy_in_blocks", "copy_out_blocks", "digest_blocks")
#: the mapping module's native functions that walk an engine's buffers
REGION_WALKS = ("flat_segments",)


def fast_entry_points():
    """Every fast entry point: the public functions of the kernels' twin
    modules, the public methods of each native class that works on a pool,
    and the mapping's batched copies."""
    import importlib
    import inspect

    found = []
    for name in FAST_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "__all__") and not name.startswith("tract._native"):
            found += [f"{name}.{item}" for item in module.__all__]
            continue
        for cls_name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != name or cls_name.startswith("_"):
                continue
            if f"{name}.{cls_name}" in twins.NOT_STEPS:
                found.append(f"{name}.{cls_name}")
                continue
            found += [f"{name}.{cls_name}.{method}" for method, value in vars(cls).items()
                      if not method.startswith("_") and callable(value)]
    return found + [f"tract._native._region.Region.{step}" for step in REGION_STEPS] + \
        [f"tract._native._region.{walk}" for walk in REGION_WALKS]


def _resolves(dotted):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            target = getattr(target, part, None)
        return target is not None
    return False


def test_every_fast_entry_point_has_a_registered_twin():
    """DESIGN.md §5: a fast path without a registered twin is a defect.
    Each entry point is in `tests/twins.py`'s TWINS (with a reference that
    exists), or named there as no protocol step, or as unproven: a list
    that may only shrink."""
    points = fast_entry_points()
    assert len(points) > 10 and "tract._kernels.indexfast.pin" in points
    missing = [point for point in points
               if point not in twins.TWINS and point not in twins.NOT_STEPS
               and point not in twins.UNPROVEN]
    assert missing == []
    stale = [name for name in [*twins.TWINS, *twins.NOT_STEPS, *twins.UNPROVEN]
             if name not in points]
    assert stale == []
    for twin in twins.TWINS.values():
        for reference in twin.reference.split(" + "):
            name = reference.split(" ")[0]
            assert _resolves(name), f"{twin.fast}: its reference {name} does not exist"
    assert twins.UNPROVEN == {}  # the cohort steps were its last entries


def test_every_registered_twin_is_held_to_its_reference_by_a_test():
    """Each twin's name appears in a test that calls `twins.check` (so a
    registration is not a claim)."""
    tests = Path(__file__).parent
    text = "\n".join(path.read_text() for path in tests.glob("test_*.py")
                     if "twins.check" in path.read_text() or "twins.run" in path.read_text())
    unchecked = [name for name in twins.TWINS if f'"{name}"' not in text]
    assert unchecked == []


def test_shared_layout_constants_agree_on_both_sides():
    """The line, the check word, the index entry, the owner record and the
    cohort slot are each defined once in Python (`tract.lines` and the module
    that owns each layout) and once in C (`_cachectl.h`, the native modules);
    nothing else repeats them."""
    from tract import alloc, index, lines, lock, objects, pool
    from tract._kernels import indexfast, probe
    from tract._native import _allocfast, _lockfast, _region

    assert lines.LINE == _region.LINE == _allocfast.LINE_BYTES == 64
    assert (lines.CHECK_PRIME, lines.CHECK_ADD) == (_region.CHECK_PRIME, _region.CHECK_ADD)
    for fields in ([0] * 5, [1, 2, 3, 4, 5], [lines.MASK64] * 5):
        assert _lockfast.grant_check(fields) == lines.check_word(lock.GRANT_TAG, fields)
    entry = np.arange(1, 9, dtype=np.uint64)
    assert probe.entry_check(entry) == lines.check_word(probe.ENTRY_TAG, entry[:7])
    assert len({lock.GRANT_TAG, objects.RECORD_TAG, probe.ENTRY_TAG}) == 3
    assert index.ENTRY_BYTES == indexfast.ENTRY == _region.LINE
    assert alloc.OWNER_BYTES == _allocfast.OWNER_RECORD_BYTES
    assert lock.SLOT_BYTES == pool.SLOT_BYTES == _lockfast.SLOT_BYTES
    assert _lockfast.COHORT_WORDS == {"held": lock.HELD, "waiters": lock.WAITERS,
                                      "passes": lock.PASSES}
    assert lock.PASSES_PER_CHECK == _lockfast.CHECK_EVERY
    assert (lock.ACQUIRED, lock.OWNER_DIED, lock.ANNOUNCED) == \
        (_lockfast.ACQUIRED, _lockfast.OWNER_DIED, _lockfast.ANNOUNCED)


def test_no_module_repeats_a_shared_constant():
    """``LINE = 64`` and the check word's mixing constants appear only where
    they are defined (the C side names them in ``_cachectl.h``)."""
    import re

    defined = {"tract/lines.py"}
    found = []
    for path in sorted(ROOT.rglob("*.py")) + sorted(ROOT.rglob("*.pyx")):
        name = str(path.relative_to(ROOT.parent))
        if name in defined or name == "tract/testing/mutants.py":
            continue
        text = path.read_text()
        for pattern in (r"^LINE = \d", r"0x100_?0000_?01B3", r"0x9E37_?79B9"):
            if re.search(pattern, text, re.MULTILINE | re.IGNORECASE):
                found.append((name, pattern))
    assert found == []


# ------------------------------------------------------------------- fsck

SYNC_ATTRIBUTES = {"flush", "invalidate", "fence", "writeback"}


def _foreign_reaches(tree):
    """(line, what) of every cache-control call, every underscore attribute
    of something other than ``self`` or ``cls``, and every underscore name
    imported, in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in SYNC_ATTRIBUTES:
                yield node.lineno, f".{node.attr}"
            elif node.attr.startswith("_") and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                yield node.lineno, f".{node.attr}"
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_"):
                    yield node.lineno, f"import {alias.name}"


def test_fsck_only_orchestrates():
    """fsck issues no cache control and reaches into no other object's
    underscore names: each mechanism owns its layout, its fresh reads (R4),
    its checks (R5) and its flushed repairs (R3)."""
    tree = ast.parse((ROOT / "fsck.py").read_text())
    assert list(_foreign_reaches(tree)) == []


def test_the_fsck_rule_sees_what_it_looks_for():
    tree = ast.parse("self._a()\nregion.fence()\npool.allocator._bitmap()\n"
                     "from tract.lock import _x\ncls._b\n")
    assert sorted(_foreign_reaches(tree)) == [(2, ".fence"), (3, "._bitmap"), (4, "import _x")]


# ---------------------------------------------------------- mutation harness

# modules that issue cache control the harness does not mutate, and why
NOT_MUTATED = {
    "tract.bench.region": "times the primitives themselves (a benchmark, no protocol step)",
    "tract.bench.transfer": "drops the cache before a timed read (a benchmark, no protocol step)",
    "tract.demo": "sys.stderr.flush() is a file's, not cache control",
    "tract.integrations.vllm_proxy": "wfile.flush() is a socket file's, not cache control",
    "tract.testing.bench_scale": "a benchmark: each simulated host starts fresh once the "
                                 "pool is formatted (no protocol step)",
    "tract.testing.faults": "fault injection: corrupts lines on purpose",
    "tract.testing.incoherent": "the simulator (its copies are made of its own primitives)",
}


def test_every_module_that_issues_cache_control_is_in_the_mutation_harness():
    """DESIGN.md §5 and issue 23: a flush, invalidate, write-back or fence
    nothing mutates is a claim nobody checks.  Each Python module with one is
    in `SUITES`, each native source and kernel with one in `NATIVE_SUITES`,
    or in NOT_MUTATED with its reason."""
    from tract.testing import mutants
    outside = [name for name, _ in _modules()
               if mutants.sites(name) and name not in mutants.SUITES and name not in NOT_MUTATED]
    assert outside == []
    stale = [name for name in NOT_MUTATED if not mutants.sites(name)]
    assert stale == []
    repository = ROOT.parent
    native = [path for pattern in ("_native/*.pyx", "_native/*.h", "_kernels/*.py")
              for path in sorted(ROOT.glob(pattern))]
    unregistered = [str(path.relative_to(repository)) for path in native
                    if mutants.native_sites(str(path.relative_to(repository)))
                    and str(path.relative_to(repository)) not in mutants.NATIVE_SUITES]
    assert unregistered == []
    assert len(native) > 5 and "tract/_native/_lockfast.pyx" in mutants.NATIVE_SUITES
