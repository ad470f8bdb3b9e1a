"""Mutant schemata (tract.testing.schemata): one Cython build for every
mutant of a source, each chosen at import by TRACT_MUTANT."""

import os
import subprocess
import sys
import textwrap

import pytest

from tract.bench.trace import build_extension
from tract.testing import mutants, schemata

SOURCE = textwrap.dedent('''\
    # cython: language_level=3
    """A module."""

    from libc.stdint cimport int64_t


    def step(int64_t a, int64_t b):
        cdef int64_t total = 0
        total += a
        total += b
        if a > 2 and b > 2:
            total += 100
        elif a > 1:
            total += 10
        else:
            total += 1
        return total


    def twice(int64_t a):
        cdef int64_t x = a
        x = x * 2
        return (x +
                1)
''')


def _mutants() -> list[str]:
    """A deletion, a swap of two lines, two weakenings of one guard (one of
    them in an arm), a change in a statement's continuation line, and a
    change that meets a declaration (which no branch may hold)."""
    return [
        SOURCE.replace("    total += a\n", "    pass\n"),
        SOURCE.replace("    total += a\n    total += b\n", "    total += b\n    total += a\n"),
        SOURCE.replace("if a > 2 and b > 2:", "if a > 2:"),
        SOURCE.replace("elif a > 1:", "elif False:"),
        SOURCE.replace("            1)", "            2)"),
        SOURCE.replace("    cdef int64_t x = a\n    x = x * 2\n",
                       "    x = x * 2\n    cdef int64_t x = a\n"),
    ]


def test_each_mutant_the_schema_holds_reads_back_as_its_own_text():
    text, held = schemata.schema(SOURCE, _mutants())
    assert held == [0, 1, 2, 3, 4]  # the declaration's mutant is built alone
    assert schemata.resolve(text, 0) == SOURCE
    for index in held:
        assert schemata.resolve(text, index + 1) == _mutants()[index]
    chains = [line for line in text.splitlines() if line.lstrip().startswith(f"if {schemata.NAME}")]
    assert len(chains) == 3  # the guard's two mutants share one chain, as do the two lines
    assert schemata.resolve(text, 6) == SOURCE  # a number no branch holds: the source


def test_a_schema_that_does_not_read_back_is_refused():
    """A mutant whose change cannot sit in a branch (here a dedent out of its
    block) is left out, never held with a different text."""
    broken = SOURCE.replace("    return total\n", "return total\n")
    text, held = schemata.schema(SOURCE, [broken, _mutants()[0]])
    assert held == [1]
    assert schemata.resolve(text, 2) == _mutants()[0]


@pytest.mark.parametrize("source", [name for name in mutants.NATIVE_SUITES
                                    if name.endswith(".pyx")])
def test_every_native_source_has_a_schema_of_its_mutants(source):
    every = [site for site in mutants.native_sites(source)
             if not mutants.equivalent(site) and site.mutation != "silent"]
    texts = [mutants.native_mutant(site) for site in every]
    original = mutants._repository_file(source).read_text()
    text, held = schemata.schema(original, texts)
    assert len(held) >= len(every) - 2, "most mutants share the schema's one build"
    assert schemata.resolve(text, 0) == original
    for index in held:
        assert schemata.resolve(text, index + 1) == texts[index]


def test_one_build_runs_each_mutant_by_its_number(tmp_path):
    """The schema compiles, and TRACT_MUTANT picks the mutant at import."""
    native = tmp_path / "tract" / "_native"
    native.mkdir(parents=True)
    for package in (tmp_path / "tract", native):
        (package / "__init__.py").write_text("")
    text, held = schemata.schema(SOURCE, _mutants())
    (native / "_tiny.pyx").write_text(text)
    failed = build_extension(tmp_path, "tract._native._tiny", optimize="-O0")
    assert failed is None, failed
    results = {}
    for number in range(len(held) + 1):
        done = subprocess.run(
            [sys.executable, "-c", "from tract._native._tiny import step, twice; "
             "print([step(a, b) for a in range(5) for b in range(5)], twice(3))"],
            cwd=tmp_path, capture_output=True, text=True, check=True,
            env=dict(os.environ, PYTHONPATH=str(tmp_path), **{schemata.ENV: str(number)}))
        results[number] = done.stdout
    assert results[0] == results[2]  # the swap changes no result
    assert len({results[number] for number in (0, 1, 3, 4, 5)}) == 5
    assert results[5].split()[-1] == "8"  # (3*2)+2: mutant 5's continuation line
