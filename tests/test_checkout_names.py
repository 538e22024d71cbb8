"""No module outside tests/ names a package that only the checkout provides.

In the repository `schemas/`, `services/` and `learner/` sit at the top; the wheel installs them as
`yeto.schemas`, `yeto.services` and `yeto.learner` and nothing else. A top-level name (an import, a resource
read such as `resources.files("services")`, a `python -m services.cli` command line) works from the
repository root and fails everywhere a user runs the product. Read from the source with `ast`, so a name in
a branch no test reaches is found too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT_ONLY = {"schemas", "services", "learner"}
# calls whose first argument is a module or package name
NAME_TAKERS = {"files", "import_module", "find_spec", "__import__", "as_file", "contents", "read_text",
               "read_binary", "open_text", "open_binary", "is_resource", "path"}
SKIP = {"tests", ".venv", "build", "dist", ".git"}


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def checkout_names(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of a checkout-only top-level name in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _top(a.name) in CHECKOUT_ONLY]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _top(node.module) in CHECKOUT_ONLY:
                found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            arg = node.args[0]
            if fn in NAME_TAKERS and isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
                    and _top(arg.value) in CHECKOUT_ONLY and "/" not in arg.value:
                found.append((node.lineno, f"{fn}({arg.value!r})"))
        elif isinstance(node, (ast.List, ast.Tuple)):
            items = node.elts
            for a, b in zip(items, items[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) \
                        and isinstance(b.value, str) and _top(b.value) in CHECKOUT_ONLY:
                    found.append((b.lineno, f"-m {b.value}"))
    return found


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts))


@pytest.mark.parametrize("snippet, what", [
    ('from importlib import resources\nresources.files("services").joinpath("nats.conf")', 'files(\'services\')'),
    ("from schemas import codec", "from schemas import ..."),
    ("import learner.island", "import learner.island"),
    ('cmd = [sys.executable, "-m", "services.cli", "demo"]', "-m services.cli"),
    ('importlib.import_module("schemas.codec")', "import_module('schemas.codec')"),
])
def test_the_check_finds_each_kind_of_checkout_name(snippet, what):
    assert [w for _, w in checkout_names(snippet)] == [what]


def test_the_check_passes_installed_names():
    ok = ('from yeto.schemas import codec\nimport yeto.learner.island\nresources.files(__package__)\n'
          'cmd = [sys.executable, "-P", "-m", "yeto.services.cli"]\nresources.files("yeto.services")\n'
          'd = {"services": 1}\nPath("learner/plugins/x.py")')
    assert checkout_names(ok) == []


def test_no_module_outside_tests_names_a_checkout_only_package():
    mods = _modules()
    assert len(mods) > 100, f"only {len(mods)} modules found under {ROOT}"  # the walk itself works
    bad = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in mods for line, what in checkout_names(p.read_text())]
    assert not bad, "names that exist only in the checkout (use yeto.schemas / yeto.services / yeto.learner, " \
                    "resources.files(__package__)):\n" + "\n".join(bad)
