"""docs/design.md §2: the code stays in small modules whose names say what they hold — none of schemas/,
services/ or learner/ over 600 lines (the syncer's shell was 857 before its start-up moved out: now
services/syncer/run_claim.py and services/syncer/opening.py)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 600


def test_no_module_over_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for d in ("schemas", "services", "learner") for p in (ROOT / d).rglob("*.py")}
    assert len(sizes) > 50 and "services/syncer/service.py" in sizes   # the walk found the code
    over = {p: n for p, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by what they hold): {over}"

