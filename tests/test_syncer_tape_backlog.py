"""docs/design.md §4.9: tape records that are not a commit's (dispositions, errors) had 3 publish attempts and
were dropped when EVENTS could not take them for a moment (a stream-leader election, a broker
restart). Now one that misses its short budget waits in an in-order backlog that the syncer retries in
the background (intake still never waits on it), and lands once EVENTS is back.

A real syncer; EVENTS is made unavailable the blunt way (deleted, then created again with its own
configuration, as it comes back after an election), which a publisher sees as an election: no
responder for a few seconds.
"""
from __future__ import annotations

import pytest

from yeto.schemas import subjects as S
from yeto.schemas.provision import remove_run
from yeto.schemas.publish import ELECTION_S
from tests.e2e_procs import wait_until
from tests.scripted import SyncerProc, syncer_status, tape, wait_tape


@pytest.mark.timeout(180)
async def test_tape_records_missed_while_events_is_unavailable_are_written_later_in_order(nc, nats_url, run_id, tmp_path):
    js = nc.jetstream(timeout=10)
    syncer = SyncerProc(nats_url, run_id, tmp_path / "ckpt", "--islands", "1", "--fragments", "1", "--sync-every", "1",
                        "--total-steps", "2", "--status-every", "0.3", log=tmp_path / "syncer.log").start()
    events = S.stream(run_id, "EVENTS")

    def bad(island: str) -> str:
        return f"ctl message on {S.hello(run_id, island)}"

    try:
        async def up():
            assert syncer.proc.poll() is None, syncer.output()[-3000:]
            try:
                return (await syncer_status(js, run_id)) is not None
            except Exception:  # not provisioned yet
                return False

        await wait_until(up, 90, "the syncer's first status record")
        cfg = (await js.stream_info(events)).config
        await js.delete_stream(events)
        # bad input while EVENTS is gone: rejected, and its tape record misses the direct budget
        for island in ("x1", "x2"):
            await js.publish(S.hello(run_id, island), b"not json", headers={S.MSG_ID: f"bad-{island}"})

        async def rejected():
            st = await syncer_status(js, run_id)
            return st is not None and st["counters"].get("rejected", 0) >= 2

        await wait_until(rejected, 30, "both hellos rejected")

        async def deferred():
            # both tape records missed their direct budget (3 attempts; with no responder, as here, up to
            # TAPE_DIRECT_ELECTION_S): the old syncer dropped them here, this one keeps them in its
            # backlog. Polled, not slept on: the counter says when, on a quiet or a loaded machine.
            assert syncer.proc.poll() is None, syncer.output()[-3000:]
            st = await syncer_status(js, run_id)
            return st is not None and st["counters"].get("tape_deferred", 0) >= 2

        await wait_until(deferred, 30, "both tape records in the backlog")
        await js.add_stream(cfg)  # EVENTS is back
        await js.publish(S.hello(run_id, "x3"), b"not json", headers={S.MSG_ID: "bad-x3"})
        await wait_tape(js, run_id, lambda r: r.get("island") == "x3", kind="error", timeout=60)
        errors = [r for r in await tape(js, run_id, "error") if r.get("island", "").startswith("x")]
        # nothing lost, nothing doubled, in the order they happened
        assert [r["island"] for r in errors] == ["x1", "x2", "x3"], errors
        assert all(r["reason"].startswith(bad(r["island"])) for r in errors), errors
        # intake did not wait out an election per record: x2 was rejected right after x1 (a direct tape
        # write gives up "no responders" after TAPE_DIRECT_ELECTION_S, not publish_retry's ELECTION_S)
        assert errors[1]["t"] - errors[0]["t"] < ELECTION_S / 2, errors

        async def settled():
            st = await syncer_status(js, run_id)
            return st is not None and st["counters"].get("tape_retried", 0) >= 2 and st

        st = await wait_until(settled, 30, "the backlog's counters")
        assert st["counters"]["tape_deferred"] >= 2, st["counters"]
        assert st["counters"].get("tape_error", 0) == 0 and st["counters"].get("tape_dropped", 0) == 0, st["counters"]
    finally:
        syncer.stop()
        await remove_run(js, run_id)
