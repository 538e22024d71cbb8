"""Optional dependencies of a test module: skipped where the extra is not installed, an error where it
was asked for.

`./run` exports YETO_EXTRAS (default `test,swift`); when it names an extra, a missing or broken import
of that extra fails the test module instead of skipping it — so CI cannot go green by silently
skipping the Megatron and ms-swift tests. A bare `pytest` without the extra skips them.
"""
from __future__ import annotations

import importlib
import os

import pytest


def require(extra: str, *modules: str) -> None:
    wanted = extra in {e.strip() for e in os.environ.get("YETO_EXTRAS", "").split(",")}
    for name in modules:
        if wanted:
            importlib.import_module(name)  # raises: the extra was installed for these tests
        else:
            pytest.importorskip(name, reason=f"needs the `{extra}` extra (pip install -e '.[{extra}]')")
