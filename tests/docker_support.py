"""The `docker` tier's parts (README "Tests"): which broker image to run, a broker container started through
testcontainers, and `docker compose` of this repository's docker-compose.yml under a project name of its own.

The images are the ones deploy/images.sh builds where no image registry is reachable (`YETO_NATS_IMAGE`,
`YETO_PYTHON_IMAGE`, as it prints them); nothing here pulls an image.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"


def _image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def nats_image() -> str:
    """YETO_NATS_IMAGE; else deploy/images.sh's local image of the embedded nats-server's version when it is
    there; else the official image compose names."""
    if os.environ.get("YETO_NATS_IMAGE"):
        return os.environ["YETO_NATS_IMAGE"]
    try:
        from yeto.services.broker import nats_server_binary

        out = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True).stdout
        local = "yeto-local/nats:" + out.strip().removeprefix("nats-server: v")
        if _image_exists(local):
            return local
    except Exception:  # no embedded binary: the official image, as compose has it
        pass
    return "nats:2.11-alpine"


def python_image() -> str:
    """The base deploy/Dockerfile is built on: YETO_PYTHON_IMAGE, else the local one of deploy/images.sh when
    it is there, else the official one."""
    if os.environ.get("YETO_PYTHON_IMAGE"):
        return os.environ["YETO_PYTHON_IMAGE"]
    return "yeto-local/python:3.11" if _image_exists("yeto-local/python:3.11") else "python:3.11-slim"


def require_images(*names: str) -> None:
    """Fail (not skip: the engine runs, so the tier must run) naming the script that builds what is missing."""
    missing = [n for n in names if not _image_exists(n)]
    assert not missing, (f"images {missing} are not on this engine: build them with `eval \"$(deploy/images.sh)\"` "
                         "(or pull them where a registry is reachable)")


@contextlib.contextmanager
def broker_container(image: str | None = None):
    """A nats-server container started through testcontainers with the shipped config (services/nats.conf,
    as compose mounts it) and JetStream, ready once its /healthz says JetStream is up; yields its nats:// URL
    on the host. Ryuk (testcontainers' reaper) is off: its image would have to be pulled; the container is
    removed when the block ends."""
    os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import HttpWaitStrategy

    from yeto.services.broker import default_config_path

    image = image or nats_image()
    require_images(image)
    c = (DockerContainer(image, command=["-c", "/etc/nats/nats.conf", "-js", "-sd", "/data"])
         .with_volume_mapping(str(default_config_path()), "/etc/nats/nats.conf", "ro")
         .with_exposed_ports(4222, 8222)
         .waiting_for(HttpWaitStrategy(8222, "/healthz?js-enabled-only=true").with_startup_timeout(60)))
    with c:
        yield f"nats://{c.get_container_host_ip()}:{c.get_exposed_port(4222)}"


def compose_command() -> list[str]:
    """`docker compose` (v2) where the plugin is there, else v1's `docker-compose` (Debian's docker-compose 1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise AssertionError("neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")


class Compose:
    """docker-compose.yml under a project name of its own (its own network and volumes), with the environment
    the recipe's variables come from. `down()` removes the containers and volumes."""

    def __init__(self, env: dict[str, str], *, project: str | None = None, log_dir: Path | None = None,
                 project_dir: Path = ROOT):
        self.project = project or f"yt{uuid.uuid4().hex[:10]}"
        self.env = {**os.environ, "YETO_NATS_IMAGE": nats_image(), "YETO_PYTHON_IMAGE": python_image(), **env}
        self.cmd = [*compose_command(), "-p", self.project, "-f", str(project_dir / COMPOSE_FILE.name)]
        self.log_dir = log_dir
        self.cwd = project_dir

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.cmd, *args], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                 f"{proc.stderr[-3000:]}\n--- logs ---\n{self.logs()[-6000:]}")
        return proc

    def container(self, service: str) -> str:
        """The id of a service's (one) container, running or not."""
        out = self.run("ps", "-a", "-q", service).stdout.split()
        assert len(out) == 1, f"{service}: containers {out}"
        return out[0]

    def inspect(self, service: str) -> dict:
        cid = self.container(service)
        return json.loads(subprocess.run(["docker", "inspect", cid], capture_output=True, text=True,
                                         check=True).stdout)[0]

    def wait_healthy(self, service: str, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            state = self.inspect(service)["State"]
            if state.get("Health", {}).get("Status") == "healthy":
                return
            assert time.monotonic() < deadline, f"{service} not healthy after {timeout:.0f}s: {state}"
            time.sleep(1)

    def logs(self, *services: str) -> str:
        proc = subprocess.run([*self.cmd, "logs", "--no-color", *services], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=60)
        return proc.stdout + proc.stderr

    def down(self) -> None:
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            (self.log_dir / f"compose-{self.project}.log").write_text(self.logs())
        self.run("--profile", "cluster", "down", "-v", "--remove-orphans", "-t", "5", timeout=180, check=False)


def compose_copy(dest: Path) -> Path:
    """docker-compose.yml with the files it mounts (services/nats.conf, deploy/nats/), in dest: a recipe that
    writes next to the compose file (`--out ./yeto-auth`) runs there as written, not in the checkout."""
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(COMPOSE_FILE, dest / COMPOSE_FILE.name)
    (dest / "services").mkdir()
    shutil.copy(ROOT / "services" / "nats.conf", dest / "services" / "nats.conf")
    shutil.copytree(ROOT / "deploy" / "nats", dest / "deploy" / "nats")
    return dest


def header_recipe(marker: str) -> list[str]:
    """The commands of docker-compose.yml's header that follow the comment line containing `marker`: the
    `#   ` lines (comments after two spaces dropped)."""
    lines = COMPOSE_FILE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("#"):
            break
        if line.startswith("#   "):
            out.append(line[4:].split("  #")[0].rstrip())
        elif out:
            break
    assert out, f"no recipe after {marker!r} in {COMPOSE_FILE}"
    return out


def assert_served_by_a_container(url: str) -> None:
    """The URL's host port is one a running broker container publishes (so a container test did not fall back
    to the embedded broker)."""
    from urllib.parse import urlparse

    port = urlparse(url).port
    out = subprocess.run(["docker", "ps", "--filter", f"ancestor={nats_image()}", "--format", "{{.Ports}}"],
                         capture_output=True, text=True, check=True).stdout
    assert f":{port}->4222/tcp" in out, f"{url} is no port of a running {nats_image()} container: {out!r}"
