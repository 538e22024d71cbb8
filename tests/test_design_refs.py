"""The design lives in the repository (docs/design.md) and the code cites it by section: every
`docs/design.md §N` (or `§N.M`; a list such as `§3.6, §5.4` or `§4 and §5` counts each) in schemas/,
services/, learner/, bench/, tests/, deploy/, README.md and docs/ must name a section heading of
docs/design.md (`## N. ...` or `### N.M ...`). Citations of the design documents that are not in the
repository (the old design file and its NATS notes) must be gone. docs/README.md's feature map must
name files that exist. No broker, no torch: a text scan."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
SCANNED_DIRS = ("schemas", "services", "learner", "bench", "tests", "deploy", "docs")
SCANNED_FILES = ("README.md",)
SUFFIXES = {".py", ".md", ".conf", ".json", ".yml", ".yaml", ".html", ".txt", ".toml", ".cfg", ""}

# `design.md` followed by one or more section marks: "§3", "§3.6", "§3.6, §5.4", "§4 and §5", "§7/§8".
CITE = re.compile(r"design\.md((?:\s*(?:,|/|and|&)?\s*§\d+(?:\.\d+)*)+)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)")
HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", re.M)
# Documents that are not in the repository. Built from pieces so this file does not match itself.
GONE = [re.compile(p) for p in ("DESIGN" + r"\s*§", "DESIGN" + r"\.md", "NATS" + "-NOTES")]
SELF = Path(__file__).resolve()


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


def test_feature_map_names_existing_files():
    text = (ROOT / "docs" / "README.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert len(table) > 20
    paths = [p for line in table for p in re.findall(r"`([^`\s]+)`", line) if "/" in p]
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"docs/README.md names files that do not exist: {missing}"
