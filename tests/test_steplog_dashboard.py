"""`yeto dashboard` against a real nats-server: the SSE stream read raw, and the page in headless
Chromium (driven over the Chrome DevTools protocol on a pipe, no extra packages) drawing its charts
and updating them as events arrive. Screenshots go to artifacts/ (viewable with any image viewer).

The browser tests skip, saying so, only where no Chromium binary can be found (Debian: `apt-get
install chromium`; or point YETO_CHROMIUM at one).
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import pytest

from yeto.services.steplog.consume import SourceOptions
from yeto.services.steplog.dashboard import Dashboard, serve_dashboard
from tests.test_steplog_support import MALFORMED, SyntheticRun, add_malformed, http_get, publish_all, scenario, until

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1400,1200"]


def chromium_binary() -> str | None:
    env = os.environ.get("YETO_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDP:
    """A minimal Chrome DevTools protocol client over --remote-debugging-pipe (fd 3: commands in,
    fd 4: replies out, NUL-separated JSON). Blocking; the async tests call it through to_thread."""

    def __init__(self, binary: str):
        self.tmp = tempfile.mkdtemp(prefix="yeto-chromium-")
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()

        def child_fds():  # runs in the child before exec: put the pipe ends on fds 3 and 4
            a, b = os.dup(cmd_r), os.dup(out_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.log = open(os.path.join(self.tmp, "chromium.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={os.path.join(self.tmp, 'profile')}",
             "--remote-debugging-pipe", "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log)
        os.close(cmd_r)
        os.close(out_w)
        self._id = 0
        self._buf = b""
        self._lock = threading.Lock()
        self.session = None

    def call(self, method: str, params: dict | None = None, *, session: bool = True, timeout: float = 20.0) -> dict:
        with self._lock:
            self._id += 1
            msg = {"id": self._id, "method": method, "params": params or {}}
            if session and self.session:
                msg["sessionId"] = self.session
            os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
            deadline = time.monotonic() + timeout
            while True:
                while b"\0" in self._buf:
                    raw, self._buf = self._buf.split(b"\0", 1)
                    reply = json.loads(raw)
                    if reply.get("id") == self._id:
                        if "error" in reply:
                            raise RuntimeError(f"{method}: {reply['error']}")
                        return reply["result"]
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise TimeoutError(f"{method}: no reply (chromium exit code {self.proc.poll()})")
                import select

                ready, _, _ = select.select([self._out_r], [], [], 0.2)
                if ready:
                    chunk = os.read(self._out_r, 1 << 20)
                    if not chunk:
                        raise RuntimeError("chromium closed the DevTools pipe")
                    self._buf += chunk

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 1200, "deviceScaleFactor": 1, "mobile": False})
        self.call("Page.enable")
        self.call("Page.navigate", {"url": url})

    def eval(self, expression: str):
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        params = {"format": "png"}
        if full_page:
            h = self.eval("document.documentElement.scrollHeight")
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": 1400, "height": max(600, int(h)), "scale": 1})
        data = self.call("Page.captureScreenshot", params)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._out_r)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium binary found (Debian: apt-get install -y chromium; or set YETO_CHROMIUM): "
                    "the dashboard's page cannot be rendered here")
    cdp = start_browser(binary)
    try:
        yield cdp
    finally:
        cdp.close()


def start_browser(binary: str, attempts: int = 2, timeout: float = 60.0) -> CDP:
    """A Chromium answering on its DevTools pipe. A cold first start on a fresh machine (font and
    profile caches) has taken over 20 s, and once a start never answered at all: the second attempt
    gets a fresh process; the error carries Chromium's own log."""
    errors = []
    for _ in range(attempts):
        cdp = CDP(binary)
        try:
            cdp.call("Browser.getVersion", session=False, timeout=timeout)
            return cdp
        except (TimeoutError, RuntimeError) as exc:
            cdp.log.flush()
            log = Path(cdp.log.name).read_text(errors="replace")[-2000:]
            errors.append(f"{exc}; chromium log:\n{log}")
            cdp.close()
    raise AssertionError(f"Chromium did not start in {attempts} attempts:\n" + "\n---\n".join(errors))


class Served:
    """serve_dashboard in this event loop, on a free port."""

    def __init__(self, nc, run, **kw):
        self.dash = Dashboard(run, flush_s=0.1, **{k: v for k, v in kw.items() if k in ("max_points", "island")})
        self.opts = SourceOptions(run, from_start=kw.get("from_start", True))
        self.nc = nc

    async def __aenter__(self):
        self.stop = asyncio.Event()
        started = asyncio.get_running_loop().create_future()
        self.task = asyncio.create_task(serve_dashboard(self.nc, self.opts, port=0, stop=self.stop, started=started,
                                                        dashboard=self.dash))
        self.port = await asyncio.wait_for(started, 10)
        self.url = f"http://127.0.0.1:{self.port}/"
        return self

    async def __aexit__(self, *exc):
        self.stop.set()
        await asyncio.wait_for(self.task, 10)


async def read_sse(reader, n: int, timeout: float = 10.0) -> list[tuple[str, dict]]:
    out = []
    event, data = None, []
    while len(out) < n:
        line = (await asyncio.wait_for(reader.readline(), timeout)).decode().rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
        elif line == "" and event:
            out.append((event, json.loads("\n".join(data))))
            event, data = None, []
    return out


async def test_sse_sends_a_snapshot_then_deltas_with_every_point_once(nc, run):
    r = scenario(run)
    add_malformed(r)
    js = nc.jetstream()
    half = 12
    await publish_all(js, r.msgs, stop=half)
    async with Served(nc, run) as srv:
        await until(lambda: srv.dash.feed.received == half, what="first half read")
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        assert head.startswith("HTTP/1.1 200") and "text/event-stream" in head
        [(kind, snap)] = await read_sse(reader, 1)
        assert kind == "snapshot"
        await publish_all(js, r.msgs, start=half)
        points = {k: len(v) for k, v in snap["islands"].items()}
        rounds, last = len(snap["rounds"]), snap
        while last["summary"]["malformed"] < MALFORMED or sum(points.values()) < len(r.steplogs) or rounds < 2:
            [(kind, delta)] = await read_sse(reader, 1)
            assert kind == "delta"
            for k, v in delta["islands"].items():
                points[k] = points.get(k, 0) + len(v)
            rounds += len(delta["rounds"])
            last = delta
        writer.close()
        # nothing twice, nothing missing: the snapshot and the deltas split the stream exactly
        assert points == {"a": 4, "b": 4} and rounds == 2
        assert last["summary"]["merges"] == 2 and last["island_state"]["b"]["lag"] == 1
        # the same state as plain JSON
        status, _h, body = await http_get(srv.port, "/state.json")
        state = orjson.loads(body)
        assert status == 200 and {k: len(v) for k, v in state["islands"].items()} == {"a": 4, "b": 4}
        assert state["summary"]["malformed"] == MALFORMED


async def test_page_is_self_contained(nc, run):
    async with Served(nc, run) as srv:
        status, headers, body = await http_get(srv.port, "/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert f"yeto run <span id=\"run\">{run}</span>" in page
    # no CDN, no remote font: the network is closed
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "page references a remote resource"
    assert "@import" not in page and "<script src" not in page


def _steps(r: SyntheticRun, islands: list[str], steps: range, lag_of=lambda isl, s: 0) -> None:
    for s in steps:
        for k, isl in enumerate(islands):
            b = 0.1 + 0.02 * k + 0.01 * (s % 5)
            r.step(isl, s, boundary_s=b, export_s=b * 0.6, apply_s=b * 0.3, versions={0: max(0, s // 2 - lag_of(isl, s))},
                   pushes=1, bytes_out=4096)


async def test_page_draws_its_charts_and_updates_them_live(nc, run, browser):
    r = scenario(run)
    add_malformed(r)
    js = nc.jetstream()
    await publish_all(js, r.msgs)
    # the syncer's status record names the run's --total-steps: the page shows progress against it
    state = await js.key_value(f"yeto_{run}_state")
    await state.put("syncer", orjson.dumps({"updated_at": time.time(), "phase": "rounds", "committed_step": 2,
                                            "total_steps": 8, "versions": {"0": 1, "1": 1}, "rounds_in_flight": []}))
    async with Served(nc, run) as srv:
        await until(lambda: srv.dash.feed.received == len(r.msgs), what="events read")
        await asyncio.to_thread(browser.open, srv.url)
        stats = lambda: asyncio.to_thread(browser.eval, "window.yetoDash && yetoDash.stats()")  # noqa: E731

        async def drawn_all():
            s = await stats()
            return s if s and s["snapshots"] >= 1 and s["draws"] >= 1 and s["drawn"].get("boundary") == 8 else None

        s = await until(drawn_all, what="first draw")
        assert s["islands"] == {"a": 4, "b": 4} and s["rounds"] == 2 and s["timeouts"] == 1
        # loss: a reported one with each of its 4 steps, b none (no point drawn for it)
        assert s["drawn"]["loss"] == 4
        s = await until(lambda: _progress(stats), what="progress from the status record")
        assert s["progress"] == pytest.approx(0.25)
        header = await asyncio.to_thread(browser.eval, "document.getElementById('s-progress').textContent")
        assert header == "2 / 8 (25%)"
        rows = await asyncio.to_thread(browser.eval, "[...document.querySelectorAll('#t-islands tbody tr')]"
                                                     ".map(tr => [...tr.children].slice(0, 3).map(td => td.textContent))")
        assert sorted(rows) == [["a", "4", "2.750"], ["b", "4", "-"]]
        loss_ink = await asyncio.to_thread(browser.eval, """(() => { const c = document.getElementById('c-loss');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
            for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })()""")
        assert loss_ink > 300
        assert s["drawn"]["split"] == 2 and s["drawn"]["lag"] == 8 and s["drawn"]["rounds"] == 4
        assert s["drawn"]["timeouts"] >= 2 and s["malformed"] == MALFORMED and s["errors"] == 0
        text = await asyncio.to_thread(browser.eval, "document.body.innerText")
        assert "quorum timeouts\n1" in text.replace("\t", "\n") or "quorum timeouts 1" in text
        legend = await asyncio.to_thread(browser.eval, "[...document.querySelectorAll('#legend span')].map(e => e.textContent)")
        assert legend == ["a", "b"]
        # the page drew pixels, not just numbers: the boundary canvas is not blank
        inked = await asyncio.to_thread(browser.eval, """(() => { const c = document.getElementById('c-boundary');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
            for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })()""")
        assert inked > 500
        await asyncio.to_thread(browser.screenshot, ARTIFACTS / "steplog-dashboard.png")

        # live: three more steps per island and another merged round arrive while the page is open
        before = s["updates"]
        more = SyntheticRun(run, t=r.t)
        _steps(more, ["a", "b"], range(5, 8))
        more.tape("merge", step=3, fragment=0, attempt=1, base_version=1, version=2, expected=[], responded=[],
                  quorum=1, weights={}, quorum_s=0.5, grace_s=0.0, sync_s=0.75)
        await publish_all(js, more.msgs)

        async def grown():
            s = await stats()
            # the round and the steps may come in separate deltas, each drawn 50 ms later: wait for the draw
            # of both (a loaded run read the new round's data before its chart was drawn again)
            return s if (s["islands"] == {"a": 7, "b": 7} and s["rounds"] == 3 and s["drawn"]["boundary"] == 14
                         and s["drawn"]["rounds"] == 6) else None

        s = await until(grown, what="live update")
        assert s["updates"] > before and s["snapshots"] == 1 and s["errors"] == 0  # deltas, not a reload
        assert s["drawn"]["rounds"] == 6


async def _progress(stats):
    s = await stats()
    return s if s and s.get("progress") is not None else None


async def test_page_with_twenty_islands(nc, run, browser):
    islands = [f"isl-{k:02d}" for k in range(20)]
    r = SyntheticRun(run)
    _steps(r, islands, range(1, 9), lag_of=lambda isl, s: int(isl[-2:]) % 3)
    await publish_all(nc.jetstream(), r.msgs)
    async with Served(nc, run) as srv:
        await until(lambda: srv.dash.feed.received == len(r.msgs), what="events read")
        await asyncio.to_thread(browser.open, srv.url)

        async def drawn():
            s = await asyncio.to_thread(browser.eval, "window.yetoDash && yetoDash.stats()")
            return s if s and s["draws"] >= 1 and s["drawn"].get("split") == 20 else None

        s = await until(drawn, what="twenty islands drawn")
        assert len(s["islands"]) == 20 and set(s["islands"].values()) == {8}
        assert s["drawn"]["boundary"] == 160 and s["drawn"]["lag"] == 160 and s["errors"] == 0
        legend = await asyncio.to_thread(browser.eval, "document.querySelectorAll('#legend span').length")
        rows = await asyncio.to_thread(browser.eval, "document.querySelectorAll('#t-islands tbody tr').length")
        assert legend == 20 and rows == 20
        # the split chart grows with the island count instead of squeezing twenty bars into 220 px
        h = await asyncio.to_thread(browser.eval, "document.getElementById('c-split').clientHeight")
        assert h >= 20 * 18
        # hiding an island from the legend removes its line
        await asyncio.to_thread(browser.eval, "document.querySelector('#legend span').click()")
        await until(lambda: asyncio.to_thread(browser.eval, "yetoDash.drawn.boundary === 152"), what="island hidden")
        await asyncio.to_thread(browser.eval, "document.querySelector('#legend span').click()")
        await asyncio.to_thread(browser.screenshot, ARTIFACTS / "steplog-dashboard-20-islands.png")


async def test_dashboard_cli_serves_the_page(run, nats_url):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-P", "-m", "yeto.services.cli", "dashboard", "--run", run, "--nats", nats_url, "--port", "0",
        "--log-level", "WARNING", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        port = int(re.search(r":(\d+)/", line).group(1))
        status, _h, body = await http_get(port, "/")
        assert status == 200 and b"<canvas" in body
        status, _h, body = await http_get(port, "/healthz")
        assert status == 200
    finally:
        proc.terminate()
        _out, err = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, err.decode()
