"""Mutation harness: delete each cache-control call in a protocol module in
turn and check that the module's simulated tests notice.

A *site* is one call of ``flush``, ``invalidate``, ``writeback``, ``fence``,
``store_fence`` or ``load_fence`` in the module's source.  A mutant is the
module with one site removed (the statement becomes ``pass``).  Each mutant
runs the module's simulated tests (pytest marker ``sim``) in a fresh
interpreter that imports the package from a copy holding the mutated
module, so no module can keep a reference to the original.  A mutant whose
tests still pass *survives*, which means that call is either unneeded or
untested — either way a finding.

    python -m tract.testing.mutants [--json] [--module M] [--seeds N] [--jobs J]

exits non-zero when any mutant survives (or a run errs), and with ``--json``
prints ``{"sites": n, "killed": k, "survivors": [{"module", "line", "kind"}]}``.

Protocol modules register their simulated test files in `SUITES`; each
protocol issue adds its module there.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

__all__ = ["SUITES", "SYNC_CALLS", "Site", "mutate", "run_mutant", "sites"]

SYNC_CALLS = ("flush", "invalidate", "writeback", "fence", "store_fence", "load_fence",
              "flush_lines", "invalidate_lines")

# protocol module -> its simulated test files, relative to the repository root
SUITES: dict[str, list[str]] = {
    "tract.testing.mailbox": ["tests/test_incoherent.py"],
    "tract.lock": ["tests/test_lock.py"],
    "tract.lease": ["tests/test_lock.py"],
    "tract.alloc": ["tests/test_alloc.py"],
    "tract.objects": ["tests/test_objects.py"],
    "tract.index": ["tests/test_index.py"],
    "tract.connector": ["tests/test_connector.py"],
    "tract.stats": ["tests/test_stats.py"],
}

SEEDS_ENV = "TRACT_SIM_SEEDS"


@dataclasses.dataclass(frozen=True)
class Site:
    """One cache-control call: where it is and what it does."""

    module: str
    index: int
    line: int
    col: int
    kind: str
    function: str

    def as_dict(self) -> dict:
        return {"module": self.module, "line": self.line, "kind": self.kind,
                "function": self.function}


def _source(module: str) -> tuple[str, str]:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"{module!r} is not a Python source module")
    return spec.origin, Path(spec.origin).read_text()


def _calls(tree: ast.AST):
    """(call node, enclosing function name) for every sync call, in source order."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else function
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) \
                    and child.func.attr in SYNC_CALLS:
                found.append((child, function))
            visit(child, name)

    visit(tree, "<module>")
    return sorted(found, key=lambda item: (item[0].lineno, item[0].col_offset))


def sites(module: str) -> list[Site]:
    """Every cache-control call site of ``module``, in source order."""
    _, source = _source(module)
    return [Site(module, index, call.lineno, call.col_offset, call.func.attr, function)
            for index, (call, function) in enumerate(_calls(ast.parse(source)))]


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
    tree = ast.fix_missing_locations(_Remove(call).visit(tree))
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
        shutil.copytree(package, directory / top,
                        ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.html"))
        target = directory / top / Path(path).relative_to(package)
    else:
        target = directory / Path(path).name
    tree = ast.parse(source)
    call, _ = _calls(tree)[site.index]
    target.write_text(ast.unparse(ast.fix_missing_locations(_Remove(call).visit(tree))))
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


def run_mutant(site: Site | None, module: str, root: Path, seeds: int,
               timeout: float = 900) -> str:
    """Run ``module``'s simulated tests against one mutant (None: the
    unmutated module).  Returns "passed", "failed" or "error: ..."."""
    env = dict(os.environ, **{SEEDS_ENV: str(seeds)})
    arguments = ["-q", "-x", "-m", "sim", "-p", "no:cacheprovider", *SUITES[module]]
    with tempfile.TemporaryDirectory(prefix="tract-mutant-") as scratch:
        if site is None:
            command = [sys.executable, "-m", "pytest", *arguments]
        else:
            _overlay(site, Path(scratch))
            command = [sys.executable, "-c", _RUNNER.format(
                overlay=scratch, module=module, arguments=arguments)]
        try:
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "failed"  # a mutant that hangs its tests is caught by them
    if done.returncode == 0:
        return "passed"
    if done.returncode == 1:
        return "failed"
    return f"error: exit {done.returncode}: {(done.stdout + done.stderr)[-400:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tract.testing.mutants",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", choices=sorted(SUITES),
                        help="protocol module to mutate (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seeds", type=int, default=200,
                        help="simulator seeds per test for each mutant (default 200)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="repository root holding the tests (default: .)")
    args = parser.parse_args(argv)
    modules = args.module or sorted(SUITES)

    # one unmutated run per distinct suite (tract.lock and tract.lease share
    # one), in the same pool as the mutants
    baselines = list({tuple(SUITES[module]): module for module in modules}.values())
    every = [site for module in modules for site in sites(module)]
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        unmutated = [pool.submit(run_mutant, None, module, args.root, args.seeds)
                     for module in baselines]
        outcomes = list(pool.map(
            lambda site: run_mutant(site, site.module, args.root, args.seeds), every))
    errors: list[dict] = [{"module": module, "mutant": None, "result": done.result()}
                          for module, done in zip(baselines, unmutated)
                          if done.result() != "passed"]
    survivors = [site.as_dict() for site, outcome in zip(every, outcomes) if outcome == "passed"]
    errors += [dict(site.as_dict(), result=outcome) for site, outcome in zip(every, outcomes)
               if outcome.startswith("error")]
    killed = sum(outcome == "failed" for outcome in outcomes)
    report = {"sites": len(every), "killed": killed, "survivors": survivors}
    if errors:
        report["errors"] = errors
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{len(every)} sites in {', '.join(modules)}: {killed} killed, "
              f"{len(survivors)} survived, {len(errors)} errors")
        for survivor in survivors:
            print(f"  SURVIVED {survivor['module']}:{survivor['line']} {survivor['kind']} "
                  f"in {survivor['function']}")
        for error in errors:
            print(f"  ERROR {error}")
    return 1 if survivors or errors else 0


if __name__ == "__main__":
    sys.exit(main())
