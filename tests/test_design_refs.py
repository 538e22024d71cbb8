"""The design lives in the repository (docs/design.md) and the code cites it by section: every
`docs/design.md §N` (or `§N.M`; a list such as `§3.6, §5.4` or `§4 and §5` counts each) in schemas/,
services/, learner/, bench/, soak/, tests/, deploy/, README.md and docs/ must name a section heading of
docs/design.md (`## N. ...` or `### N.M ...`). Citations of the design documents that are not in the
repository (the old design file and its NATS notes) must be gone. docs/README.md's feature map must
name files that exist, and list every tests/test_*.py (a feature's tests are found there by file name).
Code carries no issue numbers: a comment or docstring says what the code does or cites the design, since
an issue tracker's numbers mean nothing to a reader of the repository. No broker, no torch: a text scan."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SCANNED_DIRS = ("schemas", "services", "learner", "bench", "soak", "tests", "deploy", "docs")
SCANNED_FILES = ("README.md",)
SUFFIXES = {".py", ".md", ".conf", ".json", ".yml", ".yaml", ".html", ".txt", ".toml", ".cfg", ""}

# `design.md` followed by one or more section marks: "§3", "§3.6", "§3.6, §5.4", "§4 and §5", "§7/§8".
CITE = re.compile(r"design\.md((?:\s*(?:,|/|and|&)?\s*§\d+(?:\.\d+)*)+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
# Documents that are not in the repository. Built from pieces so this file does not match itself.
GONE = [re.compile(p) for p in ("DESIGN" + r"\s*§", "DESIGN" + r"\.md", "NATS" + "-NOTES")]
SELF = Path(__file__).resolve()
# Code (not the docs, which may tell the history): the packages, the benchmarks, the tests, the deployment
# files and the top-level scripts and configuration.
CODE_DIRS = ("schemas", "services", "learner", "bench", "soak", "tests", "deploy", "yeto")
CODE_FILES = ("run", ".ci/run", "pyproject.toml", "docker-compose.yml", "constraints.txt")
CODE_SUFFIXES = SUFFIXES - {".md"}
# "issue 25", "Issue 25 item 3", "issues 14 and 15", "issue #7", "issue-5", "gh-12", "PR #3".
ISSUE_TAG = re.compile(r"\bissues?[\s#-]*\d+|\bgh-\d+|\bPR\s*#\d+", re.I)


def sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text()))


def scanned_files():
    for d in SCANNED_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in SUFFIXES:
                yield p
    for name in SCANNED_FILES:
        yield ROOT / name


def _lines(p: Path):
    try:
        text = p.read_text()
    except (UnicodeDecodeError, OSError):
        return
    yield from enumerate(text.splitlines(), 1)


def citations():
    """(file:line, section) for every design citation in the scanned files."""
    for p in scanned_files():
        for n, line in _lines(p):
            for m in CITE.finditer(line):
                for sec in SECTION.findall(m.group(1)):
                    yield f"{p.relative_to(ROOT)}:{n}", sec


def test_design_has_numbered_sections_and_a_glossary():
    secs = sections()
    assert {str(n) for n in range(1, 17)} <= secs, sorted(secs)
    text = DESIGN.read_text()
    glossary = text.split("## 16. Glossary", 1)[1]
    for term in ("cut", "seal", "intent", "attempt", "try", "generation", "anchor", "fragment", "version",
                 "round", "step", "quorum", "boundary", "standby", "lease", "shard", "domain", "mirror"):
        assert re.search(rf"\*\*{term}\*\*", glossary), f"glossary lacks {term!r}"


def test_every_design_citation_names_an_existing_section():
    secs = sections()
    found = list(citations())
    assert len(found) > 50, "the scan finds the code's citations"
    bad = [f"{where}: §{sec}" for where, sec in found if sec not in secs]
    assert not bad, "citations of sections docs/design.md does not have:\n" + "\n".join(bad)


def test_no_citation_of_documents_outside_the_repository():
    bad = []
    for p in scanned_files():
        if p.resolve() == SELF:
            continue
        for n, line in _lines(p):
            if any(g.search(line) for g in GONE):
                bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "cite docs/design.md instead:\n" + "\n".join(bad)


def test_the_citation_pattern():
    def secs(s):
        return [x for m in CITE.finditer(s) for x in SECTION.findall(m.group(1))]
    assert secs("(docs/design.md §3.6, §5.4)") == ["3.6", "5.4"]
    assert secs("docs/design.md §4 and §5 alone.") == ["4", "5"]
    assert secs("see docs/design.md §15.1).") == ["15.1"]
    assert secs("docs/design.md §7/§8") == ["7", "8"]
    assert secs("docs/design.md") == []


def feature_map() -> list[str]:
    """The rows of docs/README.md's feature map."""
    text = (ROOT / "docs" / "README.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert len(table) > 20
    return table


def test_feature_map_names_existing_files():
    table = feature_map()
    paths = [p for line in table for p in re.findall(r"`([^`\s]+)`", line) if "/" in p]
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/README.md names files that do not exist: {missing}"


def test_feature_map_lists_every_test_file():
    named = {p for line in feature_map() for p in re.findall(r"`(tests/test_[^`\s]+\.py)`", line)}
    files = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    assert len(files) > 90 and len(named) > 90
    missing = sorted(files - named)
    assert not missing, "tests/ files that docs/README.md's feature map does not list under a feature:\n" + \
        "\n".join(missing)


def code_files():
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in CODE_SUFFIXES:
                yield p
    for name in CODE_FILES:
        yield ROOT / name


def test_no_issue_numbers_in_the_code():
    files = [p for p in code_files() if p.resolve() != SELF]
    assert len(files) > 200, "the scan finds the code"
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files for n, line in _lines(p)
           if ISSUE_TAG.search(line)]
    assert not bad, ("issue numbers in the code: say what the code does, or cite docs/design.md §N:\n"
                     + "\n".join(bad))


def test_the_issue_tag_pattern():
    for tagged in ("(issue 25 item 3)", "Issue 27 item 1: goodput", "issues 14 and 15", "see issue #7",
                   "the issue-5 path", "gh-12", "PR #3"):
        assert ISSUE_TAG.search(tagged), tagged
    for clean in ("re-issues a version", "a version re-issued after a redo", "issue_token(5)", "reissue[1] = 4",
                  "the issuer_name(ca)", "# 5 ranks", "issue one identity per island"):
        assert not ISSUE_TAG.search(clean), clean
