"""The outer optimizer against torch.optim.SGD(nesterov=True) as the independent reference."""
from __future__ import annotations

import time
import warnings

import pytest
import torch

from yeto.services.syncer.outer import outer_step_, weights_for


def _reference_grad(deltas: list[torch.Tensor], tokens: list[float]) -> torch.Tensor:
    # Independent of outer_step_'s accumulation: float64 weighted mean, negated, rounded once to f32.
    stacked = torch.stack([d.double() for d in deltas])
    w = torch.tensor(tokens, dtype=torch.float64)
    return (-(w[:, None] * stacked).sum(0) / w.sum()).float()


def _random_bounds(n: int, gen: torch.Generator) -> list[tuple[int, int]]:
    cuts = sorted(set(torch.randint(1, n, (7,), generator=gen).tolist()))
    edges = [0, *cuts, n]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


@pytest.mark.parametrize("kernel", ["0", "sync", "async"])
@pytest.mark.parametrize("lr,mu", [(0.7, 0.9), (1.0, 0.0), (0.35, 0.5)])
def test_matches_sgd_nesterov_chunkwise_over_many_rounds(lr: float, mu: float, kernel: str, monkeypatch) -> None:
    # sync on chunks this small runs the fused kernel's eager twin (same bits as the compiled loop,
    # see test_compiled_kernel_gives_its_eager_twins_bits)
    monkeypatch.setenv("YETO_OUTER_COMPILE", kernel)
    gen = torch.Generator().manual_seed(1234)
    n, members, rounds = 1031, 3, 50
    theta0 = torch.randn(n, generator=gen)
    ours, buf = theta0.clone(), torch.zeros(n)
    ref_param = torch.nn.Parameter(theta0.clone())
    # SGD refuses nesterov without momentum; with μ = 0 Nesterov is plain SGD
    sgd = torch.optim.SGD([ref_param], lr=lr, momentum=mu, nesterov=mu > 0)
    scratch = torch.empty(600)  # larger than any chunk: the shell reuses one scratch buffer
    for _ in range(rounds):
        deltas = [torch.randn(n, generator=gen) * 0.01 for _ in range(members)]
        tokens = [float(t) for t in torch.randint(1, 10_000, (members,), generator=gen).tolist()]
        w = weights_for(tokens, equal_weights=False)
        for a, b in _random_bounds(n, gen):
            chunk = [d[a:b] for d in deltas]
            # scratch only fits chunks up to 600 elements; bigger ones allocate their own
            outer_step_(ours[a:b], buf[a:b], chunk, w, lr, mu, out=scratch if b - a <= 600 else None)
        ref_param.grad = _reference_grad(deltas, tokens)
        sgd.step()
    torch.testing.assert_close(ours, ref_param.detach(), rtol=1e-6, atol=1e-6)
    if mu:
        torch.testing.assert_close(buf, sgd.state[ref_param]["momentum_buffer"], rtol=1e-5, atol=1e-7)
    # the run moved the parameters far beyond the tolerance, so the comparison is not vacuous
    assert (ours - theta0).abs().max() > 1e-3


def test_chunking_changes_no_bit() -> None:
    gen = torch.Generator().manual_seed(7)
    n = 777
    deltas = [torch.randn(n, generator=gen) for _ in range(4)]
    w = [3.0, 1.0, 0.0, 2.5]
    whole_p, whole_m = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    chunk_p, chunk_m = whole_p.clone(), whole_m.clone()
    outer_step_(whole_p, whole_m, deltas, w, 0.7, 0.9)
    for a, b in _random_bounds(n, gen):
        outer_step_(chunk_p[a:b], chunk_m[a:b], [d[a:b] for d in deltas], w, 0.7, 0.9)
    assert torch.equal(whole_p, chunk_p) and torch.equal(whole_m, chunk_m)


def test_sign_every_island_moves_up_so_the_global_value_moves_up() -> None:
    # d = local - anchor = +1 on every island: the outer gradient is -1 and Θ must increase.
    n = 16
    theta = torch.zeros(n)
    buf = torch.zeros(n)
    deltas = [torch.ones(n) for _ in range(4)]
    lr, mu = 0.5, 0.5  # exact in binary, so the first move is exactly lr·(1+μ) = 0.75
    outer_step_(theta, buf, deltas, weights_for([10, 20, 30, 4], False), lr, mu)
    assert torch.equal(theta, torch.full((n,), 0.75))
    assert torch.equal(buf, torch.full((n,), -1.0))
    # and with a non-binary lr/μ the first move is lr·(1+μ) to f32 rounding, still upward
    theta2, buf2 = torch.zeros(n), torch.zeros(n)
    outer_step_(theta2, buf2, [torch.ones(n)] * 3, [1, 1, 1], 0.7, 0.9)
    torch.testing.assert_close(theta2, torch.full((n,), 0.7 * 1.9), rtol=2e-7, atol=0)
    # a second identical round keeps moving up, faster (momentum)
    before = theta2.clone()
    outer_step_(theta2, buf2, [torch.ones(n)] * 3, [1, 1, 1], 0.7, 0.9)
    assert bool(((theta2 - before) > 0.7 * 1.9).all())


def test_lr1_mu0_lands_on_the_weighted_mean() -> None:
    anchor = torch.tensor([1.0, -2.0, 0.5])
    locals_ = [anchor + torch.tensor([1.0, 0.0, 2.0]), anchor + torch.tensor([-3.0, 4.0, 2.0])]
    theta, buf = anchor.clone(), torch.zeros(3)
    outer_step_(theta, buf, [x - anchor for x in locals_], [3.0, 1.0], 1.0, 0.0)
    expected = (3 * locals_[0] + locals_[1]) / 4
    torch.testing.assert_close(theta, expected, rtol=0, atol=1e-6)


def test_bf16_deltas_are_upcast_exactly() -> None:
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(100, generator=gen).bfloat16() for _ in range(3)]
    p1, m1 = torch.randn(100, generator=gen), torch.zeros(100)
    p2, m2 = p1.clone(), m1.clone()
    outer_step_(p1, m1, deltas, [1, 2, 3], 0.7, 0.9)
    outer_step_(p2, m2, [d.float() for d in deltas], [1, 2, 3], 0.7, 0.9)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)


def test_weights() -> None:
    assert weights_for([1, 3], False) == [0.25, 0.75]
    assert weights_for([1, 3], True) == [0.5, 0.5]
    # all-zero token counts fall back to equal weights instead of dividing by zero
    assert weights_for([0, 0, 0, 0], False) == [0.25] * 4
    assert weights_for([{"c_tokens": 2}, {"c_tokens": 6}], False) == [0.25, 0.75]
    with pytest.raises(ValueError):
        weights_for([], False)
    with pytest.raises(ValueError):
        weights_for([-1, 2], False)


def test_refuses_bad_input() -> None:
    p, m = torch.zeros(4), torch.zeros(4)
    with pytest.raises(TypeError):
        outer_step_(p.double(), m, [torch.zeros(4)], [1], 0.7, 0.9)
    with pytest.raises(ValueError):
        outer_step_(p, m, [torch.zeros(5)], [1], 0.7, 0.9)
    with pytest.raises(ValueError):
        outer_step_(p, m, [torch.zeros(4)], [1, 2], 0.7, 0.9)
    with pytest.raises(ValueError):
        outer_step_(p, m, [torch.zeros(4)], [0], 0.7, 0.9)
    with pytest.raises(ValueError):
        outer_step_(p, m, [torch.zeros(4)], [1], 0.7, 1.0)
    with pytest.raises(ValueError):
        outer_step_(p, m, [torch.zeros(4)], [1], 0.7, 0.9, out=torch.empty(3))


def _run_chunks(p, m, deltas, w, bounds, lr=0.7, mu=0.9):
    scratch = torch.empty(max(b - a for a, b in bounds))
    for a, b in bounds:
        outer_step_(p[a:b], m[a:b], [d[a:b] for d in deltas], w, lr, mu, out=scratch[: b - a])


def _wire_deltas(n, dtype, gen, members=3):
    raw = [(torch.randn(n, generator=gen) * 0.01).to(dtype) for _ in range(members)]
    wire = [bytes(r.view(torch.uint8).numpy()) for r in raw]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers; the step never writes a delta
        return [torch.frombuffer(b, dtype=dtype) for b in wire]


def _run_prepared(p, m, deltas, w, bounds, chunk_numel, lr=0.7, mu=0.9):
    """As the shell merges: one OuterStep per merge, called per chunk."""
    from yeto.services.syncer.outer import OuterStep

    step = OuterStep(w, lr, mu, delta_dtypes=[d.dtype for d in deltas], chunk_numel=chunk_numel)
    scratch = torch.empty(max(b - a for a, b in bounds))
    for a, b in bounds:
        step(p[a:b], m[a:b], [d[a:b] for d in deltas], out=scratch[: b - a])
    return step


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_compiled_kernel_gives_its_eager_twins_bits(monkeypatch) -> None:
    """YETO_OUTER_COMPILE=sync: the torch.compile'd loop (static shapes, compiled for the merge's chunk
    length) and the eager twin that runs wherever it is not compiled compute the same bits, so which
    one ran never changes a merged version. Chunks as the shell passes them: slices at odd offsets,
    two of the compiled length and a last one of another length, f32 deltas read in place from wire
    bytes (read-only) and bf16 ones; three rounds, so momentum carries over. Both agree with the SGD
    kernel (`0`) to f32 rounding."""
    from yeto.services.syncer import outer

    gen = torch.Generator().manual_seed(11)
    big = outer.COMPILE_MIN_NUMEL + 7
    bounds = [(0, big), (big, 2 * big), (2 * big, 2 * big + 1001)]
    n = bounds[-1][1]
    for dtype in (torch.float32, torch.bfloat16):
        p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
        deltas = _wire_deltas(n, dtype, gen)
        w = [1000.0, 1010.0, 1020.0]
        got = {}
        for label, chunk_numel, mode in (("compiled", big, "sync"), ("twin", 0, "sync"), ("sgd", big, "0")):
            monkeypatch.setenv("YETO_OUTER_COMPILE", mode)
            p, m = p0.clone(), m0.clone()
            for _ in range(3):
                step = _run_prepared(p, m, deltas, w, bounds, chunk_numel)
                if label == "compiled":
                    assert step.kernel_for is not None
                    used = step.kernel_for(big, [d[:big] for d in deltas])
                    if used is None:
                        pytest.skip("torch.compile is not available here (no C++ compiler?): only the eager twin runs")
                    assert step.kernel_for(1001, [d[:1001] for d in deltas]) is None   # other lengths: the twin
                    assert (step.compiled_calls, step.eager_calls) == (2, 1)   # what the merge record reports
                else:
                    assert (step.compiled_calls, step.eager_calls) == (0, 3)
            got[label] = (p, m)
        (pc, mc), (pt, mt), (pd, md) = got["compiled"], got["twin"], got["sgd"]
        assert torch.equal(pc, pt) and torch.equal(mc, mt), dtype
        torch.testing.assert_close(pc, pd, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mc, md, rtol=1e-5, atol=1e-8)
        assert (pc - p0).abs().max() > 1e-3  # the rounds moved the params: the comparisons are not vacuous


@pytest.mark.timeout(300)
@pytest.mark.e2e
def test_async_compile_switches_kernels_mid_merge_without_changing_a_bit(monkeypatch) -> None:
    """The default (async): a merge starts on the eager twin while the loop compiles in the background
    and moves to the compiled loop in the middle when it is ready; its bytes equal a merge that ran on
    the twin alone."""
    from yeto.services.syncer import outer

    monkeypatch.setenv("YETO_OUTER_COMPILE", "async")
    gen = torch.Generator().manual_seed(5)
    c = outer.COMPILE_MIN_NUMEL + 13          # a chunk length no other test compiles: a fresh key
    chunks = 4
    n = c * chunks
    p0, m0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01
    deltas = _wire_deltas(n, torch.float32, gen, members=2)
    w = [3.0, 1.0]
    bounds = [(k * c, (k + 1) * c) for k in range(chunks)]
    step = outer.OuterStep(w, 0.7, 0.9, delta_dtypes=[torch.float32] * 2, chunk_numel=c)
    p, m = p0.clone(), m0.clone()
    ran = []
    rounds = 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:   # rounds of the same merge until the compile is done, then two more
        rounds += 1
        time.sleep(0.02)       # a few hundred rounds while it compiles, not tens of thousands
        for a, b in bounds:
            ds = [d[a:b] for d in deltas]
            ran.append(step.kernel_for(c, ds) is not None)
            step(p[a:b], m[a:b], ds)
        if ran[-1] and ran.count(True) >= 2 * chunks:
            break
    key = ((str(torch.float32),) * 2, c)
    if outer._COMPILED._ready.get(key) is None and key not in outer._COMPILED._pending:
        pytest.skip("torch.compile is not available here (no C++ compiler?): only the eager twin runs")
    assert not ran[0] and ran[-1], "the merge began on the twin and ended on the compiled loop"
    assert (step.compiled_calls, step.eager_calls) == (ran.count(True), ran.count(False))
    monkeypatch.setenv("YETO_OUTER_COMPILE", "sync")
    pt, mt = p0.clone(), m0.clone()
    for _ in range(rounds):
        _run_prepared(pt, mt, deltas, w, bounds, 0)     # chunk_numel 0: nothing compiled, the twin only
    assert torch.equal(p, pt) and torch.equal(m, mt)
    assert (p - p0).abs().max() > 1e-3


def test_kernel_setting_is_checked(monkeypatch) -> None:
    p, m = torch.zeros(4), torch.zeros(4)
    monkeypatch.setenv("YETO_OUTER_COMPILE", "fast")
    with pytest.raises(ValueError, match="YETO_OUTER_COMPILE must be one of 0, async, sync, got 'fast'"):
        outer_step_(p, m, [torch.zeros(4)], [1], 0.7, 0.9)


@pytest.mark.timeout(180)
@pytest.mark.e2e
def test_a_process_done_while_the_loop_still_compiles_exits_with_its_code_not_an_abort() -> None:
    """A daemon thread compiling the merge loop (YETO_OUTER_COMPILE=async) is inside C++: an interpreter
    finalizing around it aborted a syncer that ended a short run ("terminate called without an active
    exception", SIGABRT: the two-datacenter demo test failed so in CI). `exit_now_if_compiling` (what
    `yeto syncer` calls on its way out) leaves at once with the process's own code."""
    import random
    import subprocess
    import sys
    import textwrap

    from yeto.services.syncer import outer

    numel = outer.COMPILE_MIN_NUMEL + random.randrange(1, 10**6)   # a key no cache holds yet
    code = textwrap.dedent(f"""
        import os, time, torch
        os.environ["YETO_OUTER_COMPILE"] = "async"
        os.environ["YETO_COMPILE_CACHE"] = "0"   # compiled in this process (no helper process): in flight here
        from yeto.services.syncer import outer
        outer.OuterStep([1.0] * 3, 0.7, 0.9, delta_dtypes=[torch.float32] * 3, chunk_numel={numel})
        time.sleep(0.3)
        print("compiling" if outer.compile_in_flight() else "compiled already", flush=True)
        outer.exit_now_if_compiling(7)
        print("no compile in flight", flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=150)
    if "compiled already" in p.stdout:
        pytest.skip("the loop compiled within 0.3 s (or not at all here): nothing in flight to exit around")
    assert p.returncode == 7, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "compiling" in p.stdout and "no compile in flight" not in p.stdout
    assert "terminate called" not in p.stderr


def test_compile_cache_key_names_everything_the_loop_depends_on(monkeypatch, tmp_path) -> None:
    """The package's file name changes with the loop's source, the dtypes, the chunk length and the
    CPU's flags; `0` keeps nothing; the default follows XDG_CACHE_HOME."""
    from yeto.services.syncer import compile_cache

    monkeypatch.setenv("YETO_COMPILE_CACHE", str(tmp_path))
    base = compile_cache.package_path("src", ("torch.float32",) * 2, 1 << 18)
    assert base is not None and base.startswith(str(tmp_path)) and base.endswith(".pt2")
    others = {compile_cache.package_path("src2", ("torch.float32",) * 2, 1 << 18),
              compile_cache.package_path("src", ("torch.float32",) * 3, 1 << 18),
              compile_cache.package_path("src", ("torch.bfloat16",) * 2, 1 << 18),
              compile_cache.package_path("src", ("torch.float32",) * 2, (1 << 18) + 1)}
    assert base not in others and len(others) == 4
    monkeypatch.setattr(compile_cache, "_cpu_fingerprint", lambda: "another CPU")
    assert compile_cache.package_path("src", ("torch.float32",) * 2, 1 << 18) != base
    assert compile_cache.temp_path(base).endswith(".pt2") and compile_cache.temp_path(base) != base
    for off in ("0", "off"):
        monkeypatch.setenv("YETO_COMPILE_CACHE", off)
        assert compile_cache.package_path("src", ("torch.float32",) * 2, 1 << 18) is None
    monkeypatch.delenv("YETO_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_dir() == str(tmp_path / "xdg" / "yeto" / "outer")


@pytest.mark.timeout(900)
@pytest.mark.e2e
def test_a_second_start_loads_the_checked_loop_and_a_damaged_one_is_rebuilt(monkeypatch, tmp_path, caplog) -> None:
    """YETO_COMPILE_CACHE: a syncer asks for the loop as soon as its session is pinned (`prewarm`); a
    helper process builds it, checks it against the eager twin and keeps it, and finishes even when the
    syncer that asked exits at once (a short run). The next start loads it instead of compiling and its
    first merge chunk runs on the compiled loop. A damaged file is removed and rebuilt, never used."""
    import logging
    import subprocess
    import sys
    import textwrap

    from yeto.services.syncer import outer

    monkeypatch.setenv("YETO_COMPILE_CACHE", str(tmp_path))
    numel = outer.COMPILE_MIN_NUMEL + 29          # a key no other test builds
    key = (("torch.float32",) * 2, numel)

    def start(body: str) -> subprocess.CompletedProcess:
        code = textwrap.dedent("""
            import logging, sys, time, torch
            logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
            from yeto.services.syncer import outer
        """) + textwrap.dedent(body)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    # A short run: the session is pinned, the run ends before any compile could finish.
    p = start(f"""
        assert outer.prewarm("f32", {numel}, 2)
        time.sleep(1.0)
        outer.exit_now_if_compiling(0)
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "helper process" in p.stdout, p.stdout
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (not list(tmp_path.glob("*.pt2")) or list(tmp_path.glob("*.lock"))):
        time.sleep(0.5)
    kept = sorted(tmp_path.glob("*.pt2"))
    logs = "".join(f.read_text() for f in tmp_path.glob("*.log"))
    if not kept and "no compiled loop" in logs:   # the builder's own verdict: neither way compiles here
        pytest.skip(f"no compiled loop here (no C++ compiler?): {logs[-500:]}")
    assert len(kept) == 1 and ".tmp" not in kept[0].name, (sorted(tmp_path.iterdir()), logs[-2000:])
    assert "built with AOTInductor" in logs and not list(tmp_path.glob("*.lock")), logs[-2000:]

    # The next start: loaded and checked, no compile; the first chunk of the first merge runs compiled.
    p = start(f"""
        assert outer.prewarm("f32", {numel}, 2)
        while ({key!r}) not in outer._COMPILED._ready:
            time.sleep(0.01)
        step = outer.OuterStep([1.0, 3.0], 0.7, 0.9, delta_dtypes=[torch.float32] * 2, chunk_numel={numel})
        d = [torch.randn({numel}) for _ in range(2)]
        print("first chunk compiled:", step.kernel_for({numel}, d) is not None, flush=True)
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "loaded from" in p.stdout and "helper process" not in p.stdout, p.stdout
    assert "first chunk compiled: True" in p.stdout, p.stdout

    kept[0].write_bytes(b"not a package")
    with caplog.at_level(logging.INFO, logger="yeto.services.syncer.outer"):
        fn = outer._CompiledKernels.compile(key)
    assert fn is not None
    text = caplog.text
    assert "removed" in text and "helper process" in text and "loaded from" in text, text
    assert kept[0].read_bytes()[:2] == b"PK"   # a package (zip) again, checked before it was kept


def test_a_dead_builders_lock_is_taken_over_and_a_live_one_is_waited_for(tmp_path) -> None:
    """One helper process builds a package; its lock names host and pid. A lock whose pid is gone (a
    builder killed -9) or that is older than LOCK_STALE_S is taken over; a live one, or another host's,
    is not."""
    import os
    import socket

    from yeto.services.syncer import compile_cache

    lock = str(tmp_path / "outer-x.pt2.lock")
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read())   # pids are below pid_max: never a live process
    with open(lock, "w") as f:
        f.write(f"{socket.gethostname()} {dead_pid}")
    assert not compile_cache._lock_alive(lock)
    assert compile_cache._take_lock(lock)
    assert open(lock).read() == f"{socket.gethostname()} {os.getpid()}"
    assert compile_cache._lock_alive(lock) and not compile_cache._take_lock(lock)   # ours: live
    with open(lock, "w") as f:
        f.write(f"another-host {dead_pid}")
    assert compile_cache._lock_alive(lock)      # a pid on another host cannot be checked from here
    old = os.stat(lock).st_mtime - compile_cache.LOCK_STALE_S - 1
    os.utime(lock, (old, old))
    assert not compile_cache._lock_alive(lock) and compile_cache._take_lock(lock)
