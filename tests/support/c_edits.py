"""Planted mistakes and cheats for a lab in C (instructor/mistakes/<lab>/*.edit,
instructor/cheats/<lab>/*.edit): C has no later `def` that replaces an earlier one, so
each is an edit of one of the lab's solutions instead, written to be read:

    # what the mistake (or cheat) is, and why a student makes it
    EXPECTED_FAILURES = ["test_...", ...]        (a cheat: TARGETS = [...])
    BASE = "decode_kernel_plain.c"               (a file of instructor/solutions/)
    --- replace
    <lines of BASE, found there exactly once>
    +++ with
    <the lines that take their place>

with as many replace/with pairs as it needs. apply_edit gives the edited source; a pair
whose lines are not in BASE exactly once fails loudly, so an edit cannot go stale silently
when the solution changes.
"""
import ast
from pathlib import Path
from typing import List, Tuple


def parse(path: Path) -> Tuple[dict, List[Tuple[str, str]]]:
    """({name: value} of the NAME = literal lines, [(old, new), ...])."""
    declared, pairs, block, old = {}, [], None, None
    for line in path.read_text().split("\n"):
        if line == "--- replace":
            if block is not None:
                pairs.append((old, "\n".join(block)))
            block, old = [], None
        elif line == "+++ with":
            old, block = "\n".join(block), []
        elif block is not None:
            block.append(line)
        elif "=" in line and not line.startswith("#"):
            name, _, value = line.partition("=")
            declared[name.strip()] = ast.literal_eval(value.strip())
    if block is not None:
        pairs.append((old, "\n".join(block).rstrip("\n")))
    if not pairs or any(old is None for old, _ in pairs):
        raise ValueError(f"{path}: each '--- replace' needs its '+++ with'")
    return declared, pairs


def declared(path: Path, name: str) -> set:
    """The list an edit declares under `name` (EXPECTED_FAILURES, TARGETS), as a set."""
    values, _ = parse(path)
    if name not in values:
        raise AssertionError(f"{path} declares no {name}")
    return set(values[name])


def apply_edit(path: Path, solutions: Path) -> str:
    """The source of the edit's BASE (a file of `solutions`) with every pair applied."""
    values, pairs = parse(path)
    source = (solutions / values["BASE"]).read_text()
    for old, new in pairs:
        count = source.count(old)
        if count != 1:
            raise AssertionError(f"{path.name}: the lines to replace occur {count} times in "
                                 f"{values['BASE']}, not once:\n{old}")
        source = source.replace(old, new)
    return source
