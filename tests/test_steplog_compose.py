"""docker-compose.yml's yeto services, the Prometheus / Grafana profile and the image recipe, checked
without a Docker engine: every `yeto` command in the file parses with the real CLI parser, ports and
scrape targets agree, mounted files exist, and every metric the Grafana dashboard queries is one the
exporter actually exposes."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from yeto.services.steplog.exporter import Exporter
from tests.test_steplog_support import add_malformed, scenario

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _yeto_services(compose):
    return {name: svc for name, svc in compose["services"].items() if svc.get("image", "").startswith("yeto-nats")}


def test_yeto_services_run_valid_commands_against_the_compose_nats(compose, monkeypatch):
    from yeto.services.cli import build_parser

    svcs = _yeto_services(compose)
    assert set(svcs) >= {"syncer", "exporter", "dashboard"}
    for name, svc in svcs.items():
        env = svc["environment"]
        # nats://nats:4222 unless YETO_NATS names other servers (the `cluster` profile's list)
        assert env["YETO_NATS"] == "${YETO_NATS:-nats://nats:4222}" and "YETO_RUN" in env, name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile"
        monkeypatch.setenv("YETO_RUN", "demo")  # as the container's environment provides it
        args = build_parser().parse_args(svc["command"])
        assert args.run == "demo" and callable(args.func), name
        if name in ("exporter", "dashboard"):
            assert args.host == "0.0.0.0", "a container must listen on all interfaces"
            assert f"{args.port}:{args.port}" in svc["ports"]


def test_monitoring_profile_scrapes_the_exporter(compose):
    prom, graf = compose["services"]["prometheus"], compose["services"]["grafana"]
    assert prom["profiles"] == ["monitoring"] and graf["profiles"] == ["monitoring"]
    for svc in (prom, graf):
        for vol in svc["volumes"]:
            host = vol.split(":")[0]
            if host.startswith("./"):
                assert (ROOT / host).exists(), f"{host} is mounted but missing"
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    exporter_port = compose["services"]["exporter"]["command"][-1]
    assert f"exporter:{exporter_port}" in targets
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/yeto.yml").read_text())
    mounted = [v.split(":")[1] for v in graf["volumes"] if "dashboards:" in v and "provisioning" not in v]
    assert provider["providers"][0]["options"]["path"] in mounted


def test_grafana_dashboard_queries_only_metrics_the_exporter_exposes():
    dash = json.loads((ROOT / "deploy/grafana/dashboards/yeto.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\byeto_[a-z_]+", e)}
    assert len(dash["panels"]) >= 10 and used
    exp = Exporter("R")
    r = scenario("R")
    add_malformed(r)
    for subject, data, _ in r.msgs:
        exp.feed.on_message(subject, data)
    text = exp.metrics.exposition().decode()
    exposed = set(re.findall(r"^(yeto_[a-z_]+)[{ ]", text, flags=re.M))
    assert used <= exposed, f"queried but never exposed: {sorted(used - exposed)}"
    assert all('run="$run"' in e for e in exprs)


def test_image_recipe_installs_the_cli():
    text = (ROOT / "deploy/Dockerfile").read_text()
    for pkg in ("schemas", "services", "learner", "yeto"):
        assert f"COPY {pkg} ./{pkg}" in text
    assert 'ENTRYPOINT ["yeto"]' in text and "-c constraints.txt" in text


def test_dashboard_page_ships_as_package_data():
    """A non-editable install (the image) must carry the page: pyproject's package-data names it,
    as `services.steplog = ["static/*"]` or `services = ["steplog/static/*"]`."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    page = "static/dashboard.html"
    ok = any(Path(page).match(p) for p in data.get("yeto.services.steplog", [])) or \
        any(Path("steplog/" + page).match(p) for p in data.get("yeto.services", []))
    assert ok, f"pyproject package-data does not ship services/steplog/{page}: {data}"


@pytest.mark.e2e
def test_cluster_profile_runs_three_hub_nodes_from_the_shipped_templates(compose, monkeypatch):
    """`docker compose --profile cluster up`: three NATS servers, each with its own hub-<i>.conf from
    deploy/nats/ (which pass `nats-server -t`, tests/test_broker.py), its own volume and host ports,
    and a health check; the syncer passes YETO_REPLICAS through."""
    from yeto.services.broker import check_config
    from yeto.services.cli import build_parser

    hubs = {n: s for n, s in compose["services"].items() if "cluster" in s.get("profiles", [])}
    assert sorted(hubs) == ["hub-1", "hub-2", "hub-3"]
    host_ports, volumes = set(), set()
    for name, svc in hubs.items():
        # the `nats` service's image: the official one unless YETO_NATS_IMAGE names deploy/images.sh's
        assert svc["image"] == compose["services"]["nats"]["image"] == "${YETO_NATS_IMAGE:-nats:2.11-alpine}"
        conf = svc["command"][svc["command"].index("-c") + 1]
        assert conf == f"/etc/nats/{name}.conf"
        mounts = dict(v.split(":")[:2] for v in svc["volumes"])
        assert mounts["./deploy/nats"] == "/etc/nats"
        host_file = ROOT / "deploy" / "nats" / f"{name}.conf"
        check_config(host_file)
        # the container reaches its peers by service name: the routes of the shipped config
        common = (ROOT / "deploy" / "nats" / "hub-common.conf").read_text()
        assert all(f"nats-route://{peer}:6222" in common for peer in hubs)
        data = [k for k, v in mounts.items() if v == "/data"]
        assert len(data) == 1 and data[0] in compose["volumes"]
        volumes.add(data[0])
        ports = {p.split(":")[1]: p.split(":")[0] for p in svc["ports"]}
        assert set(ports) == {"4222", "8222", "7422"}
        host_ports |= set(ports.values())
        assert "healthz" in " ".join(svc["healthcheck"]["test"])
    assert len(volumes) == 3 and len(host_ports) == 9  # nothing shared between the nodes
    assert not host_ports & {"4222", "8222"}  # the default `nats` service keeps its ports
    syncer = compose["services"]["syncer"]
    assert syncer["environment"]["YETO_REPLICAS"] == "${YETO_REPLICAS:-1}"
    monkeypatch.setenv("YETO_RUN", "demo")
    monkeypatch.setenv("YETO_REPLICAS", "3")
    assert build_parser().parse_args(syncer["command"]).replicas == 3
