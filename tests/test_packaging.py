"""The wheel installs one namespace, `yeto` (yeto.schemas, yeto.services, yeto.learner): no generic top-level
`schemas`, `services`, `learner`, `bench` or `tests` package lands in a training environment, where a
repository's own `schemas/` folder would shadow ours (or ours its). Built for real with pip, then read.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built by pip from a copy of the checkout that is deleted once it is built (so
    nothing installed from it can lean on a checkout)."""
    src = tmp_path_factory.mktemp("src") / "yeto-nats"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".pytest_cache", ".hypothesis"))
    out_dir = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                          "-w", str(out_dir), "-q"], capture_output=True, text=True, timeout=230)
    shutil.rmtree(src)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (whl,) = out_dir.glob("yeto_nats-*.whl")
    return whl


@pytest.mark.timeout(240)
@pytest.mark.e2e
def test_wheel_holds_only_the_yeto_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"yeto"}, sorted(tops)
    for needed in ("yeto/__init__.py", "yeto/services/cli.py", "yeto/schemas/json/", "yeto/services/nats.conf",
                   "yeto/services/steplog/static/dashboard.html", "yeto/learner/plugins/yeto_swift_plugin.py"):
        assert any(n.startswith(needed) for n in names), needed
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "yeto = yeto.services.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


# A training repository of the user's own, which `yeto` must never import: a top-level name that only the
# checkout provides resolves here instead, and fails loudly.
_SHADOW = 'raise ImportError("yeto imported the user\'s own top-level {0!r} package: a checkout-only name")\n'

# ms-swift's own loader when it is installed (`--external_plugins`), else the same steps; then a message
# validated through the package the plugin loaded, and a bad one refused naming its field.
_PLUGIN_PROBE = """
import hashlib, importlib.util, json, os, sys
path = sys.argv[1]
try:
    from swift.utils.utils import import_external_file
except ImportError:
    def import_external_file(p):
        sys.path.insert(0, os.path.dirname(p))
        spec = importlib.util.spec_from_file_location("_swift_external_" + hashlib.sha256(p.encode()).hexdigest(), p)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod
plugin = import_external_file(path)
import yeto
from yeto.schemas import codec
from yeto.schemas.errors import SchemaError
hello = codec.examples("hello")[0]
codec.validate("hello", hello)
try:
    codec.validate("hello", dict(hello, island=7))
    refused = None
except SchemaError as e:
    refused = str(e)
print(json.dumps({"callback": plugin.CALLBACK_NAME, "yeto": yeto.__file__, "refused": refused,
                  "path": sys.path}))
"""


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """A fresh virtual environment with the wheel installed and the dependencies of this one (its
    site-packages on the path through a .pth file, which does not run this environment's own .pth files:
    the editable install of the checkout stays out), and a working directory that holds its own `schemas/`
    and `services/` packages. Returns {"bin", "py", "cwd", "env"}."""
    import site

    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "_yeto_test_deps.pth").write_text("\n".join(deps) + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--force-reinstall",
                          "-q", str(wheel)], capture_output=True, text=True, timeout=230)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    cwd = tmp_path_factory.mktemp("training-repo")
    for name in ("schemas", "services", "learner"):
        (cwd / name).mkdir()
        (cwd / name / "__init__.py").write_text(_SHADOW.format(name))
    # as a user's shell has it: no PYTHONSAFEPATH (the working directory is on a `python -c`/`-m` path), no
    # PYTHONPATH, no settings of a test run
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONSAFEPATH", "PYTHONPATH", "NATS_URL") and not k.startswith("YETO_")}
    env["PYTHONUNBUFFERED"] = "1"
    return {"bin": venv / "bin", "py": py, "cwd": cwd, "env": env, "venv": venv}


def _run(installed, argv, timeout=60, **kw):
    return subprocess.run(argv, cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_installed_wheel_runs_the_demo_exactly_from_a_training_repository(installed):
    probe = _run(installed, [str(installed["py"]), "-c", "import json, sys, yeto, yeto.services.broker as b; "
                             "print(json.dumps([yeto.__file__, str(b.default_config_path()), sys.path]))"])
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, conf, path = json.loads(probe.stdout)
    assert Path(where).is_relative_to(installed["venv"]) and Path(conf).is_file(), (where, conf)
    # no folder on the path holds a checkout (this one or a copy): only the venv's own `yeto` can resolve
    assert not [p for p in path if p and ((Path(p) / "schemas" / "json").is_dir() or Path(p).resolve() == ROOT
                                          or (Path(p) / "yeto").is_dir() and not Path(p).is_relative_to(installed["venv"]))], \
        f"a checkout is on {path}"
    rounds = 6
    demo = _run(installed, [str(installed["bin"] / "yeto"), "demo", "--rounds", str(rounds),
                            "--workdir", str(installed["cwd"] / "demo")], timeout=240)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert summary["rounds"] == rounds and summary["max_abs_diff_vs_final_cut"] == 0.0, summary
    assert "Traceback" not in demo.stderr, demo.stderr[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_installed_wheel_starts_the_broker_and_the_learner(installed, tmp_path):
    from yeto.services.broker import free_port

    port = free_port()
    log = tmp_path / "broker.out"
    with open(log, "w") as f:
        broker = subprocess.Popen([str(installed["bin"] / "yeto"), "broker", "--port", str(port), "--store-dir",
                                   str(tmp_path / "js")], cwd=installed["cwd"], env=installed["env"], stdout=f,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "yeto broker ready" not in log.read_text() and broker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "yeto broker ready" in log.read_text(), log.read_text()[-3000:]
        assert f"nats://127.0.0.1:{port}" in log.read_text()
    finally:
        broker.terminate()
        assert broker.wait(30) == 0, log.read_text()[-3000:]
    helped = _run(installed, [str(installed["py"]), "-m", "yeto.learner.demo", "--help"])
    assert helped.returncode == 0 and "--island" in helped.stdout, helped.stdout[-2000:] + helped.stderr[-2000:]


@pytest.mark.timeout(180)
@pytest.mark.e2e
def test_installed_swift_plugin_loads_as_external_plugins_does_and_validates(installed):
    plugin = Path(_run(installed, [str(installed["bin"] / "yeto"), "plugin", "swift"]).stdout.strip())
    assert plugin.name == "yeto_swift_plugin.py" and plugin.is_file() and plugin.is_relative_to(installed["venv"]), plugin
    hybrid = Path(_run(installed, [str(installed["bin"] / "yeto"), "plugin", "hybrid"]).stdout.strip())
    assert hybrid.name == "yeto_hybrid_plugin.py" and hybrid.is_file(), hybrid
    out = _run(installed, [str(installed["py"]), "-c", _PLUGIN_PROBE, str(plugin)], timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["callback"] == "yeto" and Path(got["yeto"]).is_relative_to(installed["venv"]), got
    assert got["refused"] and "island" in got["refused"], got
