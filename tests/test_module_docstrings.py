"""Every module of schemas/, services/ and learner/ opens with its contract (docs/design.md §2): a docstring
of at most 15 lines saying what it owns, what it may touch and its invariants. The detailed rules sit
next to the code that keeps them (class and function docstrings), the design and its reasons in
docs/design.md, measurements in bench/README.md, history in git. Read with `ast`: nothing is imported."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 15
# What a contract does not carry: the code's history (git has it).
HISTORY = re.compile(r"\b(used to|previously|formerly|originally|at first|in the old|the original design)\b", re.I)


@functools.cache
def docstrings() -> dict[str, str | None]:
    return {str(p.relative_to(ROOT)): ast.get_docstring(ast.parse(p.read_text()))
            for d in ("schemas", "services", "learner") for p in sorted((ROOT / d).rglob("*.py"))}


def test_every_module_states_its_contract_in_at_most_15_lines():
    docs = docstrings()
    assert len(docs) > 100 and "learner/island.py" in docs   # the walk found the code
    missing = sorted(p for p, d in docs.items() if not d or not d.strip())
    assert not missing, f"modules without a docstring (say what the module owns and keeps): {missing}"
    long = {p: len(d.splitlines()) for p, d in docs.items() if len(d.splitlines()) > LIMIT}
    assert not long, (f"module docstrings over {LIMIT} lines: state the contract; move the rules next to the "
                      f"code, the design to docs/design.md, figures to bench/README.md: {long}")


def test_no_history_in_a_contract():
    bad = [f"{p}: {line.strip()}" for p, d in docstrings().items() for line in (d or "").splitlines()
           if HISTORY.search(line)]
    assert not bad, "history belongs to git, not to a module's contract:\n" + "\n".join(bad)


def test_the_history_pattern():
    for line in ("the syncer used to drop it", "(it once was, previously)", "the case the original design left"):
        assert HISTORY.search(line), line
    for line in ("it no longer names it", "a reader used by the shell", "the first version overwrites"):
        assert not HISTORY.search(line), line
