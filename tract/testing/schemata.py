"""One build for every mutant of a Cython source (mutant schemata).

A native mutant used to be a source of its own: one Cython run and one C
compile each, 8-12 s of its 11-16 s.  A schema is the source with every
mutant's change in it at once, each behind a test of one module-level
integer that the ``TRACT_MUTANT`` environment variable sets when the
module is imported: 0 (or unset) runs the source as written, K runs mutant
K (1-based, in the order given).  One build then serves every mutant of the
source.

The schema is made from the mutants' own texts, not from their kinds.  For
each mutant, the lines where its text differs from the source's are widened
to whole statements of one block (an ``if`` header takes its body and its
``elif``/``else`` arms; a statement's continuation lines come with it).
Where the widened regions of several mutants overlap they merge.  Each
region becomes::

    if _tract_mutant == 3:  # tract-mutant
        <mutant 3's text of the region>
    elif _tract_mutant == 7:  # tract-mutant
        <mutant 7's text of the region>
    else:  # tract-mutant
        <the source's text of the region>

Wrapping whole statements of one block in a branch at that block's
indentation does not change what they do, except for declarations, so a
region holding a ``cdef`` line is not wrapped: its mutants are left out
and built alone, as before.  `schema` checks its own output: `resolve`
reads the schema back for each mutant, by the markers alone, and a mutant
whose resolved text is not its own text line for line is left out too.
"""

from __future__ import annotations

import re

__all__ = ["ENV", "schema", "resolve"]

ENV = "TRACT_MUTANT"
NAME = "_tract_mutant"
MARK = "# tract-mutant"
_CONTINUING = ("elif", "else", "except", "finally")
_HEAD = re.compile(rf"^( *)(if|elif) {NAME} == (\d+):  {re.escape(MARK)}\n$")
_ELSE = re.compile(rf"^( *)else:  {re.escape(MARK)}\n$")


def _blank(line: str) -> bool:
    return not line.strip()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _continues(line: str) -> bool:
    word = line.strip().split(":")[0].split(" ")[0]
    return word in _CONTINUING


def _depths(lines: list[str]) -> tuple[int, int]:
    """(bracket depth at the end of ``lines``, the lowest it reached)."""
    depth = low = 0
    for line in lines:
        code = line.split("#")[0]
        depth += sum(map(code.count, "([{")) - sum(map(code.count, ")]}"))
        low = min(low, depth)
    return depth, low


def _balanced(lines: list[str]) -> bool:
    return _depths(lines) == (0, 0) and not (lines and lines[-1].rstrip().endswith("\\"))


def _widen(lines: list[str], a: int, b: int) -> tuple[int, int] | None:
    """[a, b) grown to whole statements of one block, or None."""
    while True:
        while a < b and _blank(lines[a]):
            a += 1
        while b > a and _blank(lines[b - 1]):
            b -= 1
        if a == b:
            return None
        level = _indent(lines[a])
        depth, low = _depths(lines[a:b])
        if low < 0 or a > 0 and lines[a - 1].rstrip().endswith("\\"):
            a -= 1  # a continuation line: take the statement from its first line
            continue
        if depth > 0 or lines[b - 1].rstrip().endswith("\\"):
            if b == len(lines):
                return None
            b += 1
            continue
        if _continues(lines[a]):  # an arm: take the statement from its head
            a -= 1
            while a >= 0 and (_blank(lines[a]) or _indent(lines[a]) > level):
                a -= 1
            if a < 0:
                return None
            continue
        after = b
        while after < len(lines) and _blank(lines[after]):
            after += 1
        if after < len(lines) and (_indent(lines[after]) > level or
                                   _indent(lines[after]) == level and _continues(lines[after])):
            b = after + 1
            continue
        if any(not _blank(line) and _indent(line) < level for line in lines[a:b]):
            return None
        return a, b


def _shift(lines: list[str]) -> list[str]:
    return [line if _blank(line) else "    " + line for line in lines]


def _prologue_at(lines: list[str]) -> int:
    """The line after the module's leading comments and docstring."""
    at = 0
    while at < len(lines) and (_blank(lines[at]) or lines[at].startswith("#")):
        at += 1
    if at < len(lines) and lines[at].lstrip().startswith(('"""', "'''")):
        quote = lines[at].lstrip()[:3]
        rest = lines[at].lstrip()[3:]
        while quote not in rest:
            at += 1
            rest = lines[at]
        at += 1
    return at


def schema(text: str, mutants: list[str]) -> tuple[str, list[int]]:
    """The schema of ``text`` holding ``mutants`` (each a whole source), and
    the indices of the mutants it holds (the others must be built alone).
    Mutant ``mutants[i]`` is selected by ``TRACT_MUTANT=i+1``."""
    lines = text.splitlines(keepends=True)
    if not text.endswith("\n"):
        return text, []
    held = [index for index in range(len(mutants))  # each alone first: a mutant that
            if not _build(lines, mutants, [index])[1]]  # breaks the markers is dropped alone
    while True:
        built, wrong = _build(lines, mutants, held)
        if not wrong:
            return built, held
        held = [index for index in held if index not in wrong]


def _build(lines: list[str], mutants: list[str], held: list[int]) -> tuple[str, set[int]]:
    """The schema of the ``held`` mutants, and those it cannot hold."""
    wrong: set[int] = set()
    regions: list[tuple[int, int, list[int]]] = []
    bodies: dict[int, list[str]] = {}
    for index in held:
        other = mutants[index].splitlines(keepends=True)
        start = 0
        while start < min(len(lines), len(other)) and lines[start] == other[start]:
            start += 1
        tail = 0
        while tail < min(len(lines), len(other)) - start and \
                lines[len(lines) - 1 - tail] == other[len(other) - 1 - tail]:
            tail += 1
        if start == len(lines) == len(other):
            wrong.add(index)  # no change: nothing to select
            continue
        span = _widen(lines, start, max(len(lines) - tail, start + 1))
        if span is None:
            wrong.add(index)
            continue
        bodies[index] = other
        regions.append((*span, [index]))
    changed = True
    while changed:  # overlapping regions merge, widened again, until none overlap
        changed, merged = False, []
        for a, b, members in sorted(regions):
            if merged and a < merged[-1][1]:
                first, last, before = merged.pop()
                span = _widen(lines, first, max(last, b))
                if span is None:
                    return "", wrong | set(before + members)
                merged.append((*span, before + members))
                changed = True
            else:
                merged.append((a, b, members))
        regions = merged
    out = lines[:_prologue_at(lines)]
    out.append(f"cdef int {NAME} = int(__import__('os').environ.get('{ENV}') or 0)  {MARK}\n")
    at = _prologue_at(lines)
    for a, b, members in merged:
        out += lines[at:a]
        pad = " " * _indent(lines[a])
        for number, index in enumerate(members):
            other = bodies[index]
            body = other[a:b + len(other) - len(lines)]
            if any(line.lstrip().startswith("cdef ") for line in body + lines[a:b]) or \
                    not _balanced(body) or not _balanced(lines[a:b]) or \
                    all(_blank(line) for line in body):
                wrong.add(index)
            out.append(f"{pad}{'elif' if number else 'if'} {NAME} == {index + 1}:  {MARK}\n")
            out += _shift(body)
        out.append(f"{pad}else:  {MARK}\n")
        out += _shift(lines[a:b])
        at = b
    out += lines[at:]
    built = "".join(out)
    for index in held:
        if index not in wrong and resolve(built, index + 1) != mutants[index]:
            wrong.add(index)
    return built, wrong


def resolve(text: str, number: int) -> str:
    """The source a schema runs as with ``TRACT_MUTANT=number``, read from
    its markers alone (0: the source as written)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    at = 0
    while at < len(lines):
        line = lines[at]
        if line.endswith(f"  {MARK}\n") and line.startswith(f"cdef int {NAME} "):
            at += 1
            continue
        head = _HEAD.match(line)
        if not head:
            out.append(line)
            at += 1
            continue
        level, chosen, arms = len(head[1]), None, 0
        while at < len(lines):
            head, other = _HEAD.match(lines[at]), _ELSE.match(lines[at])
            if not (head and len(head[1]) == level and (arms == 0 or head[2] == "elif")
                    or other and len(other[1]) == level):
                break
            arms += 1
            at += 1
            body = []
            while at < len(lines) and (_blank(lines[at]) or _indent(lines[at]) > level):
                body.append(lines[at])
                at += 1
            while body and _blank(body[-1]):  # blank lines after the last arm are the source's
                at -= 1
                body.pop()
            if chosen is None and (other or int(head[3]) == number):
                chosen = body
            if other:
                break
        out += [line[4:] if not _blank(line) else line for line in chosen or []]
    return "".join(out)
