"""Hybrid process groups (learner/hybrid.py, docs/design.md §6).

Pure tests of the node math and backend choice, then real multi-process torch.distributed/gloo runs
that simulate two nodes through `YETO_RANKS_PER_NODE`. The multi-process runs use the test-only
`force_host_copy` switch so CPU tensors take the host-copy path (fresh host tensor, gloo, copy back):
every op on a hybrid group must give the same result as the same call on a plain gloo group with the
same ranks, and both must match a reference computed here from the per-rank inputs.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from yeto.learner import hybrid, hybrid_backend, hybrid_calls
from yeto.schemas.errors import ConfigError

# ------------------------------------------------------------------------------------------------
# Pure
# ------------------------------------------------------------------------------------------------


def test_ranks_per_node_precedence_and_validation():
    assert hybrid.ranks_per_node({"YETO_RANKS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "8"}, world_size=16) == 2
    assert hybrid.ranks_per_node({"LOCAL_WORLD_SIZE": "8"}, world_size=16) == 8
    assert hybrid.ranks_per_node({"YETO_RANKS_PER_NODE": "", "LOCAL_WORLD_SIZE": "4"}, world_size=16) == 4
    assert hybrid.ranks_per_node({}, world_size=16) == 16  # no launcher info: one node
    assert hybrid.ranks_per_node({"WORLD_SIZE": "6"}) == 6
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(ConfigError) as err:
            hybrid.ranks_per_node({"YETO_RANKS_PER_NODE": bad}, world_size=4)
        assert err.value.field == "ranks_per_node" and err.value.value == bad
        assert "YETO_RANKS_PER_NODE" in str(err.value)


def test_node_math():
    assert [hybrid.node_of(r, 4) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert not hybrid.spans_nodes([0, 1, 2, 3], 4)
    assert hybrid.spans_nodes([3, 4], 4)
    assert hybrid.spans_nodes([0, 4], 4)
    assert not hybrid.spans_nodes([5], 4)
    assert not hybrid.spans_nodes([], 4)
    assert not hybrid.spans_nodes(range(16), 16)


@pytest.mark.parametrize("ranks,requested,device,backend,is_hybrid", [
    ([0, 1], None, "hccl", None, False),  # TP inside a node keeps the default (device) backend
    ([0, 1], "nccl", "nccl", "nccl", False),
    ([0, 2], None, "hccl", "gloo", True),  # DP across nodes
    ([2, 0], "hccl", "hccl", "gloo", True),  # order does not matter
    ([0, 2], "nccl", "nccl", "gloo", True),
    ([0, 2], "cpu:gloo,cuda:nccl", "nccl", "gloo", True),
    ([0, 2], "gloo", "hccl", "gloo", False),  # Megatron's own gloo groups: asked for, left alone
    ([0, 2], "mpi", "nccl", "mpi", False),
    ([0, 2], None, "gloo", "gloo", True),  # CPU island: hybrid but nothing is ever copied
])
def test_choose_backend(ranks, requested, device, backend, is_hybrid):
    c = hybrid.choose_backend(ranks, requested, device, per_node=2)
    assert (c.ranks, c.requested, c.backend, c.hybrid) == (tuple(sorted(ranks)), requested, backend, is_hybrid)
    assert c.reason


def test_device_backend_spec_and_detection_on_cpu():
    assert hybrid_backend._backend_of_spec("hccl") == "hccl"
    assert hybrid_backend._backend_of_spec("cpu:gloo,cuda:nccl") == "nccl"
    assert hybrid_backend._backend_of_spec("gloo") == "gloo"
    if torch.cuda.is_available() or "torch_npu" in sys.modules:
        pytest.skip("detection check is for CPU-only machines")
    assert hybrid.device_backend() == "gloo"
    assert "torch_npu" not in sys.modules  # detection never imported it


_PATCHED = ("new_group", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
            "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
            "broadcast_object_list", "destroy_process_group")


def test_install_patches_both_namespaces_and_uninstall_restores():
    import torch.distributed.distributed_c10d as c10d

    before = {(m.__name__, n): getattr(m, n) for m in (dist, c10d) for n in _PATCHED}
    check_op = c10d._check_op
    assert hybrid.install_from_env({}) is False and not hybrid.installed()
    try:
        assert hybrid.install_from_env({"YETO_CROSS_NODE_GLOO": "1"}) is True
        hybrid.install()  # idempotent: wrappers are not wrapped twice
        for name in _PATCHED:
            assert getattr(dist, name) is getattr(c10d, name), name
            assert getattr(dist, name) is not before[("torch.distributed", name)], name
            assert getattr(dist, name).__wrapped__ is before[("torch.distributed", name)], name
        assert c10d._check_op is not check_op
    finally:
        hybrid.uninstall()
    assert {(m.__name__, n): getattr(m, n) for m in (dist, c10d) for n in _PATCHED} == before
    assert c10d._check_op is check_op and not hybrid.installed()


_PLUGIN_PROBE = """
import hashlib, importlib.util, json, sys, torch.distributed as dist
from yeto.learner import hybrid, hybrid_backend, hybrid_calls
path = sys.argv[1]
loaded = []
for _ in range(2):  # as ms-swift's import_external_file does it: a hashed module name, imported twice
    name = "_swift_external_" + hashlib.sha256(path.encode()).hexdigest() + str(len(loaded))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    loaded.append(mod.INSTALLED)
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
g = dist.new_group([0])
print(json.dumps({"loaded": loaded, "installed": hybrid.installed(),
                  "choices": len(hybrid.choices())}))
"""


@pytest.mark.parametrize("enable", ["1", "0"])
@pytest.mark.e2e
def test_hybrid_plugin_file_installs_only_when_asked(tmp_path, enable):
    """learner/plugins/yeto_hybrid_plugin.py, loaded the way ms-swift loads --external_plugins, installs
    the hybrid groups with YETO_CROSS_NODE_GLOO=1 (then every new group is decided and recorded) and
    leaves torch.distributed untouched without it."""
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    plugin = root / "learner" / "plugins" / "yeto_hybrid_plugin.py"
    env = dict(os.environ, YETO_CROSS_NODE_GLOO=enable, YETO_RANKS_PER_NODE="1")
    out = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE, str(plugin), str(tmp_path / "pg")], env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    on = enable == "1"
    assert got == {"loaded": [on, on], "installed": on, "choices": 1 if on else 0}


# ------------------------------------------------------------------------------------------------
# Multi-process (real gloo)
# ------------------------------------------------------------------------------------------------


def _init(rank: int, world: int, init_file: str, per_node: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on *_tensor
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as if the launcher saw one node ...
    os.environ["YETO_RANKS_PER_NODE"] = str(per_node)  # ... and the override splits it into nodes
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _eq(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{what}: {a} != {b}"
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{what}: {a} != {b}"
        for x, y in zip(a, b):
            _eq(x, y, what)
    else:
        assert a == b, f"{what}: {a} != {b}"


def _same(name: str, run, hyb, plain, expect, stat: str | None = None, plain_too: bool = True) -> None:
    """run(group) on the plain group (no host copy may happen) and on the hybrid one (host copies must
    happen, counted under `stat`); both results must equal `expect`."""
    stat = stat or name
    if plain_too:
        before = hybrid.stats()
        _eq(run(plain), expect, f"{name} on plain group")
        assert hybrid.stats() == before, f"{name}: plain group went through host copies"
    before = hybrid.stats().get(stat, 0)
    _eq(run(hyb), expect, f"{name} on hybrid group")
    assert hybrid.stats().get(stat, 0) > before, f"{name}: hybrid group did not copy to host"


def _base(r: int) -> torch.Tensor:
    return torch.tensor([r + 1.0, 10.0 * (r + 1), -0.5 * r], dtype=torch.float64)


def _check_ops(rank: int, hyb, plain, members: list[int], orig_isend) -> None:
    n = len(members)
    gr = members.index(rank)
    peer = members[1 - gr]
    total = sum(_base(m) for m in members)

    # --- in-place collectives: the caller's tensor (same storage) receives the result
    def all_reduce(op):
        def run(g):
            x = _base(rank)
            ptr = x.data_ptr()
            dist.all_reduce(x, op=op, group=g)
            assert x.data_ptr() == ptr
            return x
        return run

    _same("all_reduce", all_reduce(dist.ReduceOp.SUM), hyb, plain, total)
    _same("all_reduce AVG", all_reduce(dist.ReduceOp.AVG), hyb, plain, total / n, stat="all_reduce")
    _same("all_reduce MAX", all_reduce(dist.ReduceOp.MAX), hyb, plain,
          torch.stack([_base(m) for m in members]).max(0).values, stat="all_reduce")

    def all_reduce_bf16(g):
        x = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
        dist.all_reduce(x, group=g)
        return x
    _same("all_reduce bf16", all_reduce_bf16, hyb, plain,
          torch.full((4,), float(sum(m + 1 for m in members)), dtype=torch.bfloat16), stat="all_reduce")

    def all_reduce_async(g):
        x = _base(rank)
        work = dist.all_reduce(x, group=g, async_op=True)
        work.wait()
        y = _base(rank) * 2
        fut = dist.all_reduce(y, group=g, async_op=True).get_future()
        fut.wait()
        assert fut.value()[0].data_ptr() == y.data_ptr()
        z = _base(rank)
        w = dist.all_reduce(z, group=g, async_op=True)
        while not w.is_completed():
            pass
        return [x, y, z]
    _same("all_reduce async", all_reduce_async, hyb, plain, [total, total * 2, total], stat="all_reduce")

    src = members[1]  # a root that is not group rank 0

    def broadcast(g):
        x = _base(rank)
        ptr = x.data_ptr()
        dist.broadcast(x, src=src, group=g)
        assert x.data_ptr() == ptr
        return x
    _same("broadcast", broadcast, hyb, plain, _base(src))

    def all_gather(g):
        out = [torch.zeros(3, dtype=torch.float64) for _ in range(n)]
        ptrs = [t.data_ptr() for t in out]
        dist.all_gather(out, _base(rank), group=g)
        assert [t.data_ptr() for t in out] == ptrs
        return out
    _same("all_gather", all_gather, hyb, plain, [_base(m) for m in members])

    gathered = torch.cat([_base(m) for m in members])

    def all_gather_into_tensor(g):
        out = torch.zeros(3 * n, dtype=torch.float64)
        dist.all_gather_into_tensor(out, _base(rank), group=g)
        # Megatron's in-place form: the input is this rank's slice of the output buffer
        buf = torch.zeros(n, 3, dtype=torch.float64)
        buf[gr] = _base(rank)
        work = dist.all_gather_into_tensor(buf.view(-1), buf[gr], group=g, async_op=True)
        work.wait()
        return [out, buf.view(-1)]
    _same("all_gather_into_tensor", all_gather_into_tensor, hyb, plain, [gathered, gathered])

    def reduce_scatter(g):
        out = torch.zeros(3, dtype=torch.float64)
        dist.reduce_scatter(out, [_base(rank) * (j + 1) for j in range(n)], group=g)
        return out
    _same("reduce_scatter", reduce_scatter, hyb, plain, total * (gr + 1))

    inputs = {m: torch.arange(3.0 * n, dtype=torch.float64) * (m + 1) - m for m in members}
    rs_sum = sum(inputs.values())[3 * gr:3 * (gr + 1)]

    def reduce_scatter_tensor(op):
        def run(g):
            out = torch.zeros(3, dtype=torch.float64)
            dist.reduce_scatter_tensor(out, inputs[rank].clone(), op=op, group=g)
            # Megatron's in-place form: the output is this rank's slice of the input buffer
            buf = inputs[rank].clone()
            dist.reduce_scatter_tensor(buf[3 * gr:3 * (gr + 1)], buf, op=op, group=g, async_op=True).wait()
            return [out, buf[3 * gr:3 * (gr + 1)]]
        return run
    _same("reduce_scatter_tensor", reduce_scatter_tensor(dist.ReduceOp.SUM), hyb, plain, [rs_sum, rs_sum])
    _same("reduce_scatter_tensor AVG", reduce_scatter_tensor(dist.ReduceOp.AVG), hyb, plain,
          [rs_sum / n, rs_sum / n], stat="reduce_scatter_tensor")

    # --- the fallbacks an older gloo needs (all_reduce + slice, all_gather into views), forced here
    for family in hybrid_calls._NATIVE:
        hybrid_calls._NATIVE[family] = False
    try:
        _same("reduce_scatter (fallback)", reduce_scatter, hyb, plain, total * (gr + 1), stat="reduce_scatter")
        _same("reduce_scatter_tensor (fallback)", reduce_scatter_tensor(dist.ReduceOp.SUM), hyb, plain,
              [rs_sum, rs_sum], stat="reduce_scatter_tensor")
        _same("reduce_scatter_tensor AVG (fallback)", reduce_scatter_tensor(dist.ReduceOp.AVG), hyb, plain,
              [rs_sum / n, rs_sum / n], stat="reduce_scatter_tensor")
        _same("all_gather_into_tensor (fallback)", all_gather_into_tensor, hyb, plain, [gathered, gathered],
              stat="all_gather_into_tensor")
    finally:
        for family in hybrid_calls._NATIVE:
            hybrid_calls._NATIVE[family] = True

    # --- point to point (global ranks, as torch takes them)
    def send_recv(g):
        got = torch.zeros(3, dtype=torch.float64)
        if gr == 0:
            dist.send(_base(rank), dst=peer, group=g)
            dist.recv(got, src=peer, group=g)
        else:
            dist.recv(got, src=peer, group=g)
            dist.send(_base(rank), dst=peer, group=g)
        return got
    _same("send/recv", send_recv, hyb, plain, _base(peer), stat="recv")

    def isend_irecv(g):
        got = torch.zeros(3, dtype=torch.float64)
        works = [dist.isend(_base(rank) * 3, peer, group=g), dist.irecv(got, peer, group=g)]
        for w in works:
            w.wait()
        return got
    _same("isend/irecv", isend_irecv, hyb, plain, _base(peer) * 3, stat="irecv")

    def batch(g):
        got = [torch.zeros(3, dtype=torch.float64) for _ in range(2)]
        ops = [dist.P2POp(dist.irecv, got[0], peer, g), dist.P2POp(dist.isend, _base(rank) * 5, peer, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        # a P2POp built with isend bound before install (`from torch.distributed import isend`)
        ops = [dist.P2POp(orig_isend, _base(rank) * 7, peer, g), dist.P2POp(dist.irecv, got[1], peer, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return got
    _same("batch_isend_irecv", batch, hyb, plain, [_base(peer) * 5, _base(peer) * 7], stat="irecv")

    # --- barrier: device ids are dropped on a hybrid group (gloo has none)
    dist.barrier(group=hyb)
    dist.barrier(group=hyb, device_ids=[0])
    dist.barrier(group=plain)

    # --- object collectives: their inner tensor calls go through the host-copy wrappers
    def bcast_obj(g):
        objs = [{"from": rank, "v": [rank] * 3}, "x" * rank] if rank == src else [None, None]
        dist.broadcast_object_list(objs, src=src, group=g, device=torch.device("cpu"))
        return objs
    _same("broadcast_object_list", bcast_obj, hyb, plain, [{"from": src, "v": [src] * 3}, "x" * src],
          stat="broadcast")

    def all_gather_obj(g):
        out = [None] * n
        dist.all_gather_object(out, {"r": rank, "pad": "y" * rank}, group=g)
        return out
    _same("all_gather_object", all_gather_obj, hyb, plain, [{"r": m, "pad": "y" * m} for m in members],
          stat="all_gather")

    dst = members[0]

    def gather_obj(g):
        out = [None] * n if rank == dst else None
        dist.gather_object(("g", rank), out, dst=dst, group=g)
        return out if rank == dst else "not root"
    _same("gather_object", gather_obj, hyb, plain, [("g", m) for m in members] if rank == dst else "not root",
          stat="all_gather")  # torch gathers the sizes with all_gather

    def scatter_obj(g):
        out = [None]
        dist.scatter_object_list(out, [{"to": m} for m in members] if rank == dst else None, src=dst, group=g)
        return out[0]
    _same("scatter_object_list", scatter_obj, hyb, plain, {"to": rank}, stat="scatter")


def _four_ranks(rank: int, world: int, init_file: str) -> None:
    _init(rank, world, init_file, per_node=2)  # 2 nodes: {0, 1}, {2, 3}
    orig_isend = dist.isend
    records: list[logging.LogRecord] = []
    keep = logging.Handler(logging.DEBUG)
    keep.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("yeto.hybrid")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(keep)
    hybrid.install(force_host_copy=True)
    try:
        # Megatron-like TP=2 x DP=2: TP inside a node, DP across nodes; every rank creates every group.
        tp = [dist.new_group(r) for r in ([0, 1], [2, 3])]
        dp = [dist.new_group(r) for r in ([0, 2], [1, 3])]
        everyone = dist.new_group()  # ranks=None: the whole world
        plain = [dist.new_group(r, backend="gloo") for r in ([0, 2], [1, 3])]  # asked for gloo: left alone
        got = [(c.ranks, c.backend, c.hybrid) for c in hybrid.choices()]
        assert got == [((0, 1), None, False), ((2, 3), None, False), ((0, 2), "gloo", True),
                       ((1, 3), "gloo", True), ((0, 1, 2, 3), "gloo", True),
                       ((0, 2), "gloo", False), ((1, 3), "gloo", False)], got
        my_tp, my_dp, my_plain = tp[rank // 2], dp[rank % 2], plain[rank % 2]
        assert hybrid.is_hybrid(my_dp) and hybrid.is_hybrid(everyone)
        assert not hybrid.is_hybrid(my_tp) and not hybrid.is_hybrid(my_plain)
        assert dist.get_backend(my_dp) == "gloo" and dist.get_backend(everyone) == "gloo"
        # only groups this rank belongs to are registered (non-members get no group object)
        assert len(hybrid.hybrid_groups()) == 2
        # each group's choice is logged once in the island: at INFO by its lowest rank, DEBUG elsewhere
        logged = [r for r in records if r.getMessage().startswith("group ")]
        assert len(logged) == 7
        infos = [r.getMessage() for r in logged if r.levelno == logging.INFO]
        mine = [c for c in hybrid.choices() if c.ranks[0] == rank]
        assert len(infos) == len(mine), infos
        for text, c in zip(infos, mine):
            assert text.startswith(f"group {list(c.ranks)} -> {'gloo' if c.backend else 'default'}"), text

        _check_ops(rank, my_dp, my_plain, [rank % 2, rank % 2 + 2], orig_isend)

        # a group inside one node is untouched: no host copies
        before = hybrid.stats()
        x = _base(rank)
        dist.all_reduce(x, group=my_tp)
        _eq(x, sum(_base(m) for m in (rank // 2 * 2, rank // 2 * 2 + 1)), "all_reduce on TP group")
        assert hybrid.stats() == before
        # the whole-world hybrid group works too
        y = _base(rank)
        dist.all_reduce(y, group=everyone)
        _eq(y, sum(_base(m) for m in range(world)), "all_reduce on world hybrid group")

        dist.destroy_process_group(my_dp)
        assert not hybrid.is_hybrid(my_dp) and hybrid.is_hybrid(everyone)
    finally:
        hybrid.uninstall()
        dist.destroy_process_group()


def _eight_ranks(rank: int, world: int, init_file: str) -> None:
    _init(rank, world, init_file, per_node=4)  # 2 nodes: 0-3, 4-7
    hybrid.install(force_host_copy=True)
    try:
        # Megatron order tp-dp-pp with TP=2, DP=2, PP=2: TP and DP inside a node, PP across nodes.
        for r in ([0, 1], [2, 3], [4, 5], [6, 7]):
            dist.new_group(r)
        for r in ([0, 2], [1, 3], [4, 6], [5, 7]):
            dist.new_group(r)
        pp, _ = dist.new_subgroups_by_enumeration([[0, 4], [1, 5], [2, 6], [3, 7]])
        got = [(c.ranks, c.hybrid) for c in hybrid.choices()]
        assert [r for r, h in got if h] == [(0, 4), (1, 5), (2, 6), (3, 7)], got
        assert len(got) == 12 and hybrid.is_hybrid(pp)
        stage, peer = rank // 4, (rank + 4) % 8

        # pipeline hand-off the way Megatron's p2p does it
        got_t = torch.zeros(3, dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, _base(rank), peer, pp), dist.P2POp(dist.irecv, got_t, peer, pp)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _eq(got_t, _base(peer), "pp exchange")
        x = _base(rank)
        dist.all_reduce(x, group=pp)
        _eq(x, _base(rank) + _base(peer), "pp all_reduce")
        objs = [rank] if stage == 0 else [None]
        dist.broadcast_object_list(objs, src=rank % 4, group=pp)
        assert objs == [rank % 4]
        assert hybrid.stats().get("irecv", 0) == 1 and hybrid.stats().get("all_reduce", 0) == 1
    finally:
        hybrid.uninstall()
        dist.destroy_process_group()


def _start(fn, world: int, tmp_path) -> None:
    # forkserver with torch preloaded: each rank is a fork of a process that imported torch once but never
    # ran a parallel region (fork-safe), instead of a fresh interpreter importing torch per rank.
    import multiprocessing

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "yeto.learner.hybrid"])
    mp.start_processes(fn, args=(world, str(tmp_path / "init")), nprocs=world, join=True,
                       start_method="forkserver")


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_hybrid_groups_four_ranks_two_nodes(tmp_path):
    _start(_four_ranks, 4, tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.e2e
def test_hybrid_groups_eight_ranks_megatron_layout(tmp_path):
    _start(_eight_ranks, 8, tmp_path)


def _device_pair(rank: int, world: int, init_file: str, device: str) -> None:
    """Two processes, one rank each, both on the same device; each its own "node", so their group is hybrid.
    On `cuda` the tensors are real device tensors (the host-copy path as it runs for a GPU island); on the
    CPU the test-only switch stands in for them."""
    _init(rank, world, init_file, per_node=1)
    hybrid.install(force_host_copy=device == "cpu")
    try:
        g = dist.new_group([0, 1])
        assert hybrid.is_hybrid(g) and dist.get_backend(g) == "gloo"
        dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        peer = 1 - rank

        def on(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev)

        def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
            assert got.device == dev, f"{what}: the result left the device ({got.device})"
            _eq(got.cpu(), want, what)

        x = on(_base(rank))
        ptr = x.data_ptr()
        dist.all_reduce(x, group=g)
        assert x.data_ptr() == ptr  # in place: the caller's device tensor holds the result
        same(x, _base(0) + _base(1), "all_reduce")
        h = on(torch.full((5,), float(rank + 1), dtype=torch.bfloat16))
        dist.all_reduce(h, group=g)
        same(h, torch.full((5,), 3.0, dtype=torch.bfloat16), "all_reduce bf16")
        b = on(_base(rank))
        dist.broadcast(b, src=1, group=g)
        same(b, _base(1), "broadcast")
        outs = [on(torch.zeros(3, dtype=torch.float64)) for _ in range(2)]
        dist.all_gather(outs, on(_base(rank)), group=g)
        for m, o in enumerate(outs):
            same(o, _base(m), "all_gather")
        flat = on(torch.zeros(6, dtype=torch.float64))
        dist.all_gather_into_tensor(flat, on(_base(rank)), group=g)
        same(flat, torch.cat([_base(0), _base(1)]), "all_gather_into_tensor")
        rs = on(torch.zeros(3, dtype=torch.float64))
        dist.reduce_scatter_tensor(rs, on(torch.arange(6.0, dtype=torch.float64) * (rank + 1)), group=g)
        same(rs, (torch.arange(6.0, dtype=torch.float64) * 3)[3 * rank: 3 * rank + 3], "reduce_scatter_tensor")
        got = on(torch.zeros(3, dtype=torch.float64))
        ops = [dist.P2POp(dist.isend, on(_base(rank) * 5), peer, g), dist.P2POp(dist.irecv, got, peer, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same(got, _base(peer) * 5, "batch_isend_irecv")
        stats = hybrid.stats()
        for op in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                   "irecv"):
            assert stats.get(op, 0) >= 1, (op, stats)  # every call went through the host copies
    finally:
        hybrid.uninstall()
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.e2e
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_hybrid_group_carries_device_tensors_between_two_processes(tmp_path, device):
    import multiprocessing

    # CUDA: spawned ranks (a rank forked after the CUDA driver was touched cannot use the GPU)
    method = "spawn" if device == "cuda" else "forkserver"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "yeto.learner.hybrid"])
    mp.start_processes(_device_pair, args=(2, str(tmp_path / "init"), device), nprocs=2, join=True,
                       start_method=method)
