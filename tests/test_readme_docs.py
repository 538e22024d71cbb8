"""The README and the operator guides document what the code reads: every `YETO_*` variable the learner and
the services read appears in README.md or in one of the guides under docs/ (the reference moved out of the
README: broker, syncer, island, shards, datacenters, security, testing, and docs/megatron.md for the
ms-swift plugin), and every guide is reachable from docs/README.md's index; the README's first two commands
are the bootstrap's."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAR = re.compile(r"YETO_[A-Z][A-Z0-9_]*[A-Z0-9]")
# Not variables: stream-name examples in docstrings (YETO_<run>_<KIND> renders as YETO_R_CTL).
NOT_VARS = {"YETO_R_CTL"}
# The design is not an operator's reference: a variable it alone mentions is undocumented.
NOT_GUIDES = {"design.md", "README.md"}


def _vars_read(paths) -> dict[str, str]:
    out = {}
    for p in paths:
        for v in VAR.findall(p.read_text()):
            out.setdefault(v, str(p.relative_to(ROOT)))
    return out


def guides() -> list[Path]:
    """The operator guides under docs/ (not the design, not the index)."""
    return sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_GUIDES)


def test_every_variable_the_code_reads_is_documented():
    sources = [p for d in ("learner", "services") for p in (ROOT / d).rglob("*.py")]
    assert {"megatron.md", "island.md", "syncer.md", "broker.md"} <= {p.name for p in guides()}
    docs = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in guides())
    read = _vars_read(sources)
    assert "YETO_DILOCO_STEP_LOG" in read and "YETO_CROSS_NODE_GLOO" in read  # the scan finds real ones
    missing = {v: where for v, where in read.items() if v not in NOT_VARS and v not in docs}
    assert not missing, f"variables read by the code but in neither README.md nor a guide under docs/: {missing}"


def test_every_guide_is_indexed_and_the_readme_points_to_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    unlisted = [p.name for p in guides() if f"]({p.name})" not in index]
    assert not unlisted, f"guides docs/README.md does not link: {unlisted}"
    assert "](docs/README.md)" in (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_bootstrap_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    cmds = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert cmds == ["./run demo", "./run test"]
    run = (ROOT / "run").read_text()
    assert "demo)" in run and "test)" in run
