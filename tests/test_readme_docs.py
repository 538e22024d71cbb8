"""The README documents what the code reads: every `YETO_*` variable the learner and the services
read appears in README.md (or, for the megatron/ms-swift plugin, in docs/megatron.md), and the
README's first two commands are the bootstrap's."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VAR = re.compile(r"YETO_[A-Z][A-Z0-9_]*[A-Z0-9]")
# Not variables: stream-name examples in docstrings (YETO_<run>_<KIND> renders as YETO_R_CTL).
NOT_VARS = {"YETO_R_CTL"}


def _vars_read(paths) -> dict[str, str]:
    out = {}
    for p in paths:
        for v in VAR.findall(p.read_text()):
            out.setdefault(v, str(p.relative_to(ROOT)))
    return out


def test_every_variable_the_code_reads_is_documented():
    sources = [p for d in ("learner", "services") for p in (ROOT / d).rglob("*.py")]
    docs = (ROOT / "README.md").read_text()
    megatron_doc = ROOT / "docs" / "megatron.md"
    if megatron_doc.exists():
        docs += megatron_doc.read_text()
    read = _vars_read(sources)
    assert "YETO_DILOCO_STEP_LOG" in read and "YETO_CROSS_NODE_GLOO" in read  # the scan finds real ones
    missing = {v: where for v, where in read.items() if v not in NOT_VARS and v not in docs}
    assert not missing, f"variables read by the code but not in README.md: {missing}"


def test_readme_starts_with_the_two_bootstrap_commands():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    cmds = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert cmds == ["./run demo", "./run test"]
    run = (ROOT / "run").read_text()
    assert "demo)" in run and "test)" in run
