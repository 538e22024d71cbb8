"""Syncer shards, provisioning side (docs/design.md §10): each shard's durable consumers (names, filters, CTL only
in the coordinator; one shard unchanged), what the server makes of them (a shard's consumers deliver
its own fragments' INIT and push subjects only), and several shards provisioning one run at once.
Against a real nats-server."""
from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js import api

from yeto.schemas import subjects as S
from yeto.schemas.errors import ConfigError
from yeto.schemas.provision import ProvisionConflict, RunLimits, provision_run, remove_run, syncer_consumer_configs

LIMITS = RunLimits.small()
QUIET = dict(log=lambda _: None)


def _filters(cfg: api.ConsumerConfig) -> list[str]:
    return sorted(list(cfg.filter_subjects or []) + ([cfg.filter_subject] if cfg.filter_subject else []))


def test_one_shard_consumers_are_the_unsharded_ones():
    plain = syncer_consumer_configs("r1")
    one = syncer_consumer_configs("r1", shard=0, shards=1, fragments=4)
    assert list(one) == [S.SYNCER_CTL_CONSUMER, S.SYNCER_HB_CONSUMER, S.SYNCER_INIT_CONSUMER,
                         S.SYNCER_PUSH_CONSUMER] == list(plain)
    for name, (kind, cfg) in one.items():
        assert plain[name][0] == kind and plain[name][1] == cfg
    assert _filters(one[S.SYNCER_PUSH_CONSUMER][1]) == [S.push_all("r1")]
    assert _filters(one[S.SYNCER_INIT_CONSUMER][1]) == []          # the whole INIT stream, as before
    assert one[S.SYNCER_PUSH_CONSUMER][1].headers_only is True


@pytest.mark.parametrize("shards", [2, 3])
def test_each_shard_consumes_its_own_fragments_and_only_the_coordinator_reads_ctl(shards):
    P = 5
    seen_init, seen_push = [], []
    for k in range(shards):
        got = syncer_consumer_configs("r1", shard=k, shards=shards, fragments=P, push_headers_only=False)
        own = [f for f in range(P) if f % shards == k]
        want = {f"syncer-init-s{k}": "INIT", f"syncer-push-s{k}": "PUSH"}
        if k == 0:
            want = {S.SYNCER_CTL_CONSUMER: "CTL", S.SYNCER_HB_CONSUMER: "HB", **want}
        assert {n: kind for n, (kind, _) in got.items()} == want
        init, push = got[f"syncer-init-s{k}"][1], got[f"syncer-push-s{k}"][1]
        assert init.durable_name == init.name == f"syncer-init-s{k}"
        assert _filters(init) == sorted(S.init("r1", f) for f in own)
        assert _filters(push) == sorted(S.push_fragment_all("r1", f) for f in own)
        assert push.headers_only is False and push.ack_policy == api.AckPolicy.EXPLICIT
        seen_init += _filters(init)
        seen_push += _filters(push)
        if k == 0:
            assert _filters(got[S.SYNCER_CTL_CONSUMER][1]) == sorted(S.syncer_ctl_filters("r1"))
            assert _filters(got[S.SYNCER_HB_CONSUMER][1]) == sorted(S.syncer_hb_filters("r1"))
    # every fragment is consumed by exactly one shard (the INIT work queue refuses overlapping filters)
    assert sorted(seen_init) == sorted(S.init("r1", f) for f in range(P))
    assert sorted(seen_push) == sorted(S.push_fragment_all("r1", f) for f in range(P))


def test_bad_shard_arguments_name_the_flag():
    with pytest.raises(ConfigError, match="--shard "):
        syncer_consumer_configs("r1", shard=2, shards=2, fragments=4)
    with pytest.raises(ConfigError, match="--shards 5 exceeds --fragments 4"):
        syncer_consumer_configs("r1", shard=0, shards=5, fragments=4)
    with pytest.raises(ConfigError, match="fragment count"):
        syncer_consumer_configs("r1", shard=1, shards=2)


async def _consumer_names(js, run: str) -> dict[str, list[str]]:
    out = {}
    for kind in ("CTL", "HB", "INIT", "PUSH"):
        out[kind] = sorted([c.name async for c in _consumers(js, S.stream(run, kind))])
    return out


async def _consumers(js, stream: str):
    for c in await js.consumers_info(stream):
        yield c


async def test_shards_provisioning_one_run_at_once_all_succeed_and_deliver_only_their_fragments(nats_url, run_id):
    """Four shards of one run (P = 4) start at the same moment, each on its own connection: every
    provision_run succeeds, the run holds each shard's two consumers (CTL's only once), and a push or
    INIT chunk of fragment f is delivered to shard f mod 4's consumers only."""
    N, P = 4, 4
    conns = [await nats.connect(nats_url) for _ in range(N)]
    try:
        reports = await asyncio.gather(*(
            provision_run(c.jetstream(), run_id, LIMITS, push_headers_only=False, shard=k, shards=N, fragments=P, **QUIET)
            for k, c in enumerate(conns)))
        for k, r in enumerate(reports):
            assert f"consumer {S.stream(run_id, 'PUSH')}/syncer-push-s{k}" in r.created
        js = conns[0].jetstream()
        names = await _consumer_names(js, run_id)
        assert names == {"CTL": [S.SYNCER_CTL_CONSUMER], "HB": [S.SYNCER_HB_CONSUMER],
                         "INIT": [f"syncer-init-s{k}" for k in range(N)],
                         "PUSH": [f"syncer-push-s{k}" for k in range(N)]}
        # again, all at once: everything is found, nothing conflicts
        again = await asyncio.gather(*(
            provision_run(c.jetstream(), run_id, LIMITS, push_headers_only=False, shard=k, shards=N, fragments=P, **QUIET)
            for k, c in enumerate(conns)))
        assert all(not r.created for r in again)
        for f in range(P):
            await js.publish(S.push(run_id, "a", f), b"x", headers={S.MSG_ID: f"p{f}"})
            await js.publish(S.init(run_id, f), b"y", headers={S.MSG_ID: f"i{f}"})
        for k in range(N):
            for kind, name, subject in (("PUSH", f"syncer-push-s{k}", S.push(run_id, "a", k)),
                                        ("INIT", f"syncer-init-s{k}", S.init(run_id, k))):
                sub = await js.pull_subscribe_bind(name, stream=S.stream(run_id, kind))
                msgs = await sub.fetch(10, timeout=2)
                assert [m.subject for m in msgs] == [subject], (name, [m.subject for m in msgs])
                for m in msgs:
                    await m.ack()
    finally:
        await remove_run(conns[0].jetstream(), run_id)
        for c in conns:
            await c.close()


async def test_two_shards_racing_to_create_a_bucket_with_other_settings_get_a_conflict_not_an_error(nats_url, run_id):
    """The streams agree, the state bucket's history differs: one shard wins, the other is told which
    field conflicts (ProvisionConflict, whether it lost the race at the check or at the create)."""
    a, b = await nats.connect(nats_url), await nats.connect(nats_url)
    try:
        results = await asyncio.gather(
            provision_run(a.jetstream(), run_id, LIMITS, shard=0, shards=2, fragments=2, **QUIET),
            provision_run(b.jetstream(), run_id, RunLimits.small(state_history=LIMITS.state_history + 3), shard=1,
                          shards=2, fragments=2, **QUIET),
            return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1 and isinstance(errors[0], ProvisionConflict), results
        assert errors[0].field == "history" and errors[0].what == f"kv {S.kv_bucket(run_id, 'state')}"
    finally:
        await remove_run(a.jetstream(), run_id)
        await a.close()
        await b.close()


@pytest.mark.parametrize("first, then", [(1, 2), (2, 1), (2, 3)])
async def test_a_shard_started_with_another_shard_count_is_refused_and_changes_nothing(nc, run_id, first, then):
    """One run, one --shards: a process started with another count would consume fragments another
    shard owns. Shard 0 (or the unsharded syncer) provisioned first; a process with another count is
    told which flag conflicts, and no consumer of it was created."""
    js = nc.jetstream()
    try:
        await provision_run(js, run_id, LIMITS, shard=0, shards=first, fragments=6, **QUIET)
        before = await _consumer_names(js, run_id)
        with pytest.raises(ProvisionConflict) as exc:
            await provision_run(js, run_id, LIMITS, shard=then - 1, shards=then, fragments=6, **QUIET)
        assert exc.value.field == "shards" and exc.value.wanted == then, exc.value
        assert "shards" in str(exc.value)
        assert await _consumer_names(js, run_id) == before
        # the same count is fine (another shard of the run)
        if first > 1:
            await provision_run(js, run_id, LIMITS, shard=1, shards=first, fragments=6, **QUIET)
    finally:
        await remove_run(js, run_id)
