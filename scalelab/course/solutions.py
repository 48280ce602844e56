"""Solution markers, read one way everywhere: the release, the site and the lab tests all call `replace_solutions`.

In a reference lab (notebook cells and helper modules alike) an exercise's answer sits between two comment lines:

    # BEGIN SOLUTION
    ...the answer...
    # END SOLUTION

The release puts the exercise stub in its place; the site shows one `# YOUR CODE HERE` line. Unbalanced markers are
an error that names the cell and line: a student copy or a page must never show half a solution.
"""
from __future__ import annotations

import re

from ..errors import ScalelabError

BEGIN = re.compile(r"^(\s*)#+\s*BEGIN SOLUTION\b")
END = re.compile(r"^\s*#+\s*END SOLUTION\b")


def replace_solutions(source: str, placeholder: list[str] | tuple[str, ...], where: str = "cell",
                      error: type[ScalelabError] = ScalelabError) -> tuple[str, int]:
    """`source` with each solution block (markers included) replaced by the `placeholder` lines at the BEGIN line's
    indentation; returns (new source, blocks replaced). Unbalanced markers raise `error` naming `where` and the line."""
    out, indent, blocks = [], None, 0
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if indent is not None:
                raise error(f"{where}, line {number}: BEGIN SOLUTION inside another solution block")
            indent = begin.group(1)
        elif end:
            if indent is None:
                raise error(f"{where}, line {number}: END SOLUTION without a BEGIN SOLUTION before it")
            newline = "\n" if line.endswith("\n") else ""
            out.append("".join(f"{indent}{p}\n" for p in placeholder).rstrip("\n") + newline)
            indent, blocks = None, blocks + 1
        elif indent is None:
            out.append(line)
    if indent is not None:
        raise error(f"{where}: BEGIN SOLUTION is never closed by an END SOLUTION; a student copy or a page must not "
                    "show half a solution")
    return "".join(out), blocks


def solution_blocks(source: str) -> list[str]:
    """The text between each BEGIN/END SOLUTION pair of `source` (markers excluded), one string per block."""
    blocks, current = [], None
    for line in source.splitlines(keepends=True):
        if BEGIN.match(line):
            current = []
        elif END.match(line) and current is not None:
            blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


__all__ = ["BEGIN", "END", "replace_solutions", "solution_blocks"]
