"""docker-compose.yml on a real Docker engine (the `docker` tier, README "Tests"): the recipes of its header, as
written, with the images deploy/images.sh builds (`YETO_NATS_IMAGE`, `YETO_PYTHON_IMAGE`; nothing is pulled).

- `docker compose up` of nats + syncer + syncer-standby + exporter + dashboard; two `python -m yeto.learner.demo`
  islands on the host (through the published 4222) train a run to its end; the container owning the run is
  `docker kill`ed mid-run and the other syncer container takes it over; then `docker compose restart nats`
  mid-run; the run finishes exactly (every island bitwise on the final cut `yeto export` writes from the
  syncers' checkpoint volume, one digest per committed version); the exporter's metrics and the dashboard's
  page answer on their published ports;
- `YETO_REPLICAS=3 docker compose --profile cluster up` with the services on the three hub nodes: one hub
  container killed mid-run, the run finishes exactly.

Each test runs under a compose project name of its own (own network and volumes, removed at the end); the
host ports are the compose file's, so this file's tests run one at a time (one xdist worker per file).
"""
from __future__ import annotations

import asyncio
import sys
import os
import socket
import subprocess
import urllib.request

import pytest

from tests.docker_support import Compose, nats_image, require_images
from tests.e2e_procs import IslandProc, merges, tails, wait_exit, wait_until
from tests.scripted import tape

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("docker_engine")]

# 2 fragments, a round every 2 local steps (H=4): long enough (0.2 s steps) that the kill, the standby's
# takeover (one lease TTL, 10 s by default) and the broker restart all fall inside the run.
RUN_ENV = {"YETO_ISLANDS": "2", "YETO_FRAGMENTS": "2", "YETO_SYNC_EVERY": "4"}
ISLAND_ARGS = ("--step-delay", "0.2")


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as docker-proxy binds (TIME_WAIT is no owner)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def _ports_free(*ports: int) -> None:
    taken = [p for p in ports if not _free(p)]
    assert not taken, f"host ports {taken} are taken: docker-compose.yml publishes them (stop what holds them)"


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode(errors="replace")


async def _get_eventually(url: str, want, timeout: float = 90) -> str:
    """GET url until its body satisfies want(body) (a service still starting refuses the connection)."""
    last = ""

    async def ok():
        nonlocal last
        try:
            status, body = await asyncio.to_thread(_get, url)
        except OSError as e:
            last = repr(e)
            return False
        last = body[-2000:]
        return status == 200 and want(body)

    try:
        await wait_until(ok, timeout, url, poll=1)
    except AssertionError as e:
        raise AssertionError(f"{e}; last answer: {last}") from None
    return last


async def _lease_host(js, run: str) -> str | None:
    import orjson
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from yeto.schemas import subjects as S
    try:
        kv = await js.key_value(S.kv_bucket(run, "state"))
        return orjson.loads((await kv.get("lease")).value).get("host")
    except (KeyNotFoundError, NotFoundError):
        return None


async def _one_digest_per_version(js, run: str) -> int:
    seen: dict[tuple[int, int], set[str]] = {}
    for r in await tape(js, run, "commit"):
        seen.setdefault((r["fragment"], r["version"]), set()).add(r["detail"]["version_digest"])
    doubles = {k: v for k, v in seen.items() if len(v) > 1}
    assert not doubles, doubles
    return len(seen)


def _export_and_compare(c: Compose, run: str, tmp_path, islands) -> None:
    """`yeto export` in a container on the syncers' checkpoint volume, as an operator would run it; every island
    saved exactly that cut and rejected nothing."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "export"
    out.mkdir()
    os.chmod(out, 0o777)  # the yeto image runs as uid 10001
    c.run("run", "--rm", "--no-deps", "-v", f"{out}:/out", "syncer", "export", "--run", run,
          "--checkpoint-dir", "/data/syncer", "--out", "/out/final.safetensors", timeout=180)
    final = load_file(str(out / "final.safetensors"))
    assert final
    for isl in islands:
        saved = load_file(str(isl.out))
        assert sorted(saved) == sorted(final), isl.island
        for n, value in final.items():
            assert torch.equal(saved[n], value), (isl.island, n)
        res = isl.result()
        assert res is not None and res["counters"]["rejected"] == 0, isl.output()[-3000:]


@pytest.fixture
def images():
    require_images(nats_image(), "yeto-nats:latest")


@pytest.mark.timeout(900)
async def test_compose_up_trains_a_run_exactly_through_a_syncer_kill_and_a_broker_restart(images, tmp_path):
    import nats

    _ports_free(4222, 8222, 9464, 8080)
    run = "compose_" + os.urandom(4).hex()
    rounds = 60
    c = Compose({"YETO_RUN": run, "YETO_TOTAL_STEPS": str(rounds), **RUN_ENV}, log_dir=tmp_path)
    islands: dict = {}
    nc = None
    try:
        c.run("up", "-d")  # docs/broker.md "Docker compose": nats, syncer, syncer-standby, exporter, dashboard
        c.wait_healthy("nats")
        url = "nats://127.0.0.1:4222"
        islands = {i: IslandProc(url, run, i, tmp_path, args=ISLAND_ARGS).start() for i in ("a", "b")}
        nc = await nats.connect(url, max_reconnect_attempts=-1)
        js = nc.jetstream()
        await wait_until(lambda: merges_at_least(js, run, 3), 240, "three merges")

        # The owner is whichever syncer container took the lease first; its hostname is in the lease.
        hosts = {svc: c.inspect(svc)["Config"]["Hostname"] for svc in ("syncer", "syncer-standby")}
        owner_host = await _lease_host(js, run)
        owner = next(svc for svc, h in hosts.items() if h == owner_host)
        other = "syncer-standby" if owner == "syncer" else "syncer"
        subprocess.run(["docker", "kill", c.container(owner)], check=True, capture_output=True)
        killed_at = await merge_count(js, run)

        async def taken_over():
            return await _lease_host(js, run) == hosts[other]
        await wait_until(taken_over, 120, f"{other} to take the run over from the killed {owner}")
        await wait_until(lambda: merges_at_least(js, run, killed_at + 3), 180, "merges by the new owner")

        # The broker restarted mid-run (its store on the nats-data volume): everyone reconnects.
        before_restart = await merge_count(js, run)
        assert before_restart < rounds - 3, "the run (nearly) ended before the broker restart: lengthen it"
        c.run("restart", "nats", timeout=120)
        c.wait_healthy("nats")
        await wait_until(lambda: merges_at_least(js, run, before_restart + 3), 180, "merges after the restart")

        # The viewers, on their published ports, while the run goes on.
        metrics = await _get_eventually("http://127.0.0.1:9464/metrics",
                                        lambda b: f'run="{run}"' in b and 'island="a"' in b)
        assert "yeto_" in metrics
        page = await _get_eventually("http://127.0.0.1:8080/", lambda b: "<html" in b.lower())
        assert page

        rcs = await wait_exit(islands, 420)
        assert rcs == {"a": 0, "b": 0}, tails(islands)
        committed = await _one_digest_per_version(js, run)
        assert committed >= rounds
        _export_and_compare(c, run, tmp_path, islands.values())
        assert "took over" in c.logs(other), c.logs(other)[-4000:]
    finally:
        for p in islands.values():
            p.stop()
        if nc is not None:
            await nc.close()
        c.down()


async def _merge_count(js, run: str) -> int | None:
    """Merges on the tape so far; None while JetStream does not answer (a broker restarting, a cluster
    electing leaders after a node died)."""
    import nats.errors

    try:
        return len(await merges(js, run))
    except nats.errors.TimeoutError:
        return None


async def merge_count(js, run: str) -> int:
    async def answered():
        n = await _merge_count(js, run)
        return None if n is None else (n,)  # a tuple: 0 merges is an answer too
    return (await wait_until(answered, 120, "JetStream to answer again"))[0]


async def merges_at_least(js, run: str, n: int) -> bool:
    got = await _merge_count(js, run)
    return got is not None and got >= n


@pytest.mark.timeout(900)
async def test_cluster_profile_with_three_replicas_survives_a_hub_killed_mid_run(images, tmp_path):
    import nats

    _ports_free(4222, 8222, 4223, 4224, 4225, 8223, 8224, 8225, 7423, 7424, 7425, 9464, 8080)
    run = "cluster_" + os.urandom(4).hex()
    rounds = 40
    # The header's recipe (its `up` detached here): YETO_NATS=<the hubs> YETO_REPLICAS=3 docker compose --profile cluster up
    from tests.docker_support import header_recipe
    recipe = " ".join(header_recipe("Point the yeto services at it")).replace("\\", " ").split()
    assert recipe == ["YETO_NATS=nats://hub-1:4222,nats://hub-2:4222,nats://hub-3:4222", "YETO_REPLICAS=3",
                      "docker", "compose", "--profile", "cluster", "up"], recipe
    c = Compose({"YETO_RUN": run, "YETO_TOTAL_STEPS": str(rounds), **RUN_ENV,
                 "YETO_NATS": "nats://hub-1:4222,nats://hub-2:4222,nats://hub-3:4222", "YETO_REPLICAS": "3"},
                log_dir=tmp_path)
    islands: dict = {}
    nc = None
    try:
        c.run("--profile", "cluster", "up", "-d", "--no-build")
        for hub in ("hub-1", "hub-2", "hub-3"):
            c.wait_healthy(hub)
        urls = "nats://127.0.0.1:4223,nats://127.0.0.1:4224,nats://127.0.0.1:4225"
        islands = {i: IslandProc(urls, run, i, tmp_path, args=ISLAND_ARGS).start() for i in ("a", "b")}
        nc = await nats.connect(urls.split(","), max_reconnect_attempts=-1)
        js = nc.jetstream()
        await wait_until(lambda: merges_at_least(js, run, 3), 300, "three merges")
        from yeto.schemas import subjects as S
        for kind in ("PUSH", "BCAST", "EVENTS"):  # YETO_REPLICAS=3 reached the syncer's provisioning
            assert (await js.stream_info(S.stream(run, kind))).config.num_replicas == 3, kind
        subprocess.run(["docker", "kill", c.container("hub-2")], check=True, capture_output=True)
        killed_at = await merge_count(js, run)
        assert killed_at < rounds - 3, "the run (nearly) ended before the hub was killed: lengthen it"
        await wait_until(lambda: merges_at_least(js, run, killed_at + 3), 240, "merges after the hub was killed")
        rcs = await wait_exit(islands, 420)
        assert rcs == {"a": 0, "b": 0}, tails(islands)
        await _one_digest_per_version(js, run)
        _export_and_compare(c, run, tmp_path, islands.values())
    finally:
        for p in islands.values():
            p.stop()
        if nc is not None:
            await nc.close()
        c.down()


@pytest.mark.timeout(600)
async def test_the_secured_recipe_of_the_header_runs_as_written(images, tmp_path):
    """The header's four commands, verbatim, in a copy of the compose file's directory (`./yeto-auth` lands
    there): `yeto auth init --tls`, the secured broker, `setfacl` for the containers' user, the whole stack
    (in the foreground, as written: it runs in the background here until the end). Then islands a and b on the
    host with their own identities over TLS train the default run (`demo`) to the end, exactly; the exporter
    and the dashboard read the run with the observer identity."""
    import shutil

    from tests.docker_support import compose_copy, header_recipe

    _ports_free(4222, 8222, 9464, 8080)
    assert shutil.which("setfacl"), "setfacl is missing (apt-get install acl): the recipe runs it"
    recipe = header_recipe("A secured run")
    assert len(recipe) == 4 and recipe[-1].endswith("docker compose up"), recipe
    proj = compose_copy(tmp_path / "proj")
    project = f"yt{os.urandom(5).hex()}"
    venv_bin = os.path.dirname(os.path.realpath(shutil.which("yeto") or "")) or os.path.dirname(sys.executable)
    env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "PATH": f"{os.path.dirname(sys.executable)}:{venv_bin}:"
           + os.environ["PATH"]}
    c = Compose({"YETO_BROKER_AUTH": "./yeto-auth"}, project=project, log_dir=tmp_path, project_dir=proj)
    env.update({k: c.env[k] for k in ("YETO_NATS_IMAGE", "YETO_PYTHON_IMAGE")})
    islands: dict = {}
    up = None
    try:
        for line in recipe[:-1]:
            proc = subprocess.run(["bash", "-c", line], cwd=proj, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        up_log = open(tmp_path / "compose-up.log", "w")
        up = subprocess.Popen(["bash", "-c", recipe[-1]], cwd=proj, env=env, stdout=up_log, stderr=subprocess.STDOUT)
        c.wait_healthy("nats")
        auth = proj / "yeto-auth"
        url = "tls://127.0.0.1:4222"
        islands = {i: IslandProc(url, "demo", i, tmp_path, env={"YETO_NATS_CREDS": str(auth / f"{i}.creds"),
                                                               "YETO_TLS_CA": str(auth / "tls" / "ca.pem")}).start()
                   for i in ("a", "b")}
        metrics = await _get_eventually("http://127.0.0.1:9464/metrics",
                                        lambda b: 'run="demo"' in b and 'island="a"' in b, timeout=240)
        assert "yeto_" in metrics
        await _get_eventually("http://127.0.0.1:8080/", lambda b: "<html" in b.lower())
        rcs = await wait_exit(islands, 300)
        assert rcs == {"a": 0, "b": 0}, tails(islands) + "\n" + c.logs()[-4000:]
        _export_and_compare(c, "demo", tmp_path, islands.values())
        assert "Authorization Violation" not in c.logs("syncer", "exporter", "dashboard")
    finally:
        for p in islands.values():
            p.stop()
        if up is not None and up.poll() is None:
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
        c.down()
