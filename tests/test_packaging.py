"""The wheel installs one namespace, `yeto` (yeto.schemas, yeto.services, yeto.learner): no generic top-level
`schemas`, `services`, `learner`, `bench` or `tests` package lands in a training environment, where a
repository's own `schemas/` folder would shadow ours (or ours its). Built for real with pip, then read.
"""
from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = {"yeto.schemas": "schemas", "yeto.services": "services", "yeto.learner": "learner", "yeto": "yeto"}


def _folder_to_package(folder: Path) -> str:
    rel = folder.relative_to(ROOT).parts
    for pkg, top in MAP.items():
        if rel[0] == top:
            return ".".join([pkg, *rel[1:]])
    raise AssertionError(folder)


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_folder_to_package(p.parent) for top in MAP.values() for p in (ROOT / top).rglob("__init__.py")
             if "__pycache__" not in p.parts}
    assert found == listed, f"pyproject.toml packages: missing {sorted(found - listed)}, stale {sorted(listed - found)}"


@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_wheel_holds_only_the_yeto_namespace(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path), "-q"], capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = tmp_path.glob("yeto_nats-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"yeto"}, sorted(tops)
    for needed in ("yeto/__init__.py", "yeto/services/cli.py", "yeto/schemas/json/", "yeto/services/nats.conf",
                   "yeto/services/steplog/static/dashboard.html", "yeto/learner/plugins/yeto_swift_plugin.py"):
        assert any(n.startswith(needed) for n in names), needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "yeto = yeto.services.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
