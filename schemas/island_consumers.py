"""An island's two durable consumers on CTL (`pull-I`, `isl-I`): created per generation, owned by the
generation in their metadata, replaced by a newer process of the island and never taken back by an
older one (ConsumerTaken). I/O shells around `stream_configs.island_consumer_config`."""
from __future__ import annotations


from nats.js import api
from nats.js.errors import APIError, NotFoundError

from . import subjects as S
from .ids import check_island
from .ids import check_run as _check_run_id

from .provision_base import (ProvisionConflict, ProvisionError, ProvisionReport, RunNotProvisioned,
                             consumer_info_or_none, server_refused, stream_info_or_none)
from .stream_configs import ISLAND_ACK_WAIT_S, ISLAND_INACTIVE_S, config_conflicts, island_consumer_config


class ConsumerTaken(ProvisionError):
    """Another generation of the island owns the consumer (this process was superseded)."""

    def __init__(self, name: str, owner: str | None):
        self.name, self.owner = name, owner
        super().__init__(f"consumer {name} belongs to generation {owner} of this island")


def consumer_owner(info: api.ConsumerInfo | None) -> str | None:
    """The generation that owns an island consumer (its metadata), None when absent or unmarked."""
    if info is None:
        return None
    return (info.config.metadata or {}).get(S.ISLAND_GEN_KEY)


async def island_consumer_owner(js, run: str, island: str, kind: str) -> tuple[bool, str | None]:
    """(exists, owning generation) of island I's consumer `kind`. Raises on no answer."""
    info = await consumer_info_or_none(js, S.stream(run, "CTL"), S.island_consumer(island, kind))
    return info is not None, consumer_owner(info)


# Tries of one consumer's (delete,) create: another process of the island may be doing the same.
ISLAND_CONSUMER_TRIES = 5


async def ensure_island_consumer(
    js, run: str, island: str, gen: str, kind: str, start_seq: int | None = None, *, replace: bool = True,
    ack_wait_s: float = ISLAND_ACK_WAIT_S, inactive_s: float = ISLAND_INACTIVE_S,
    report: ProvisionReport | None = None,
) -> ProvisionReport:
    """Make island I's consumer `kind` one of generation `gen` (see island_consumer_config).

    Kept as it is when `gen` owns it already (its position too). Owned by another generation (an
    earlier process of the island): deleted and created anew when `replace` (a new process takes
    over), else ConsumerTaken (this process was superseded and must not take it back). A concurrent
    creator is retried a few times. Bind to it with
    `js.pull_subscribe_bind(S.island_consumer(I, kind), stream=stream(run, "CTL"))`.
    """
    _check_run_id(run)
    cfg = island_consumer_config(run, island, gen, kind, start_seq, ack_wait_s=ack_wait_s, inactive_s=inactive_s)
    report = report or ProvisionReport(run)
    ctl = S.stream(run, "CTL")
    what = f"consumer {ctl}/{cfg.name}"
    last: Exception | None = None
    for _ in range(ISLAND_CONSUMER_TRIES):
        info = await consumer_info_or_none(js, ctl, cfg.name)
        if info is not None:
            owner = consumer_owner(info)
            if owner == gen:
                conflicts = [(what, ctl, f, e, w) for f, e, w in config_conflicts(info.config, cfg, "consumer")
                             if f != "deliver_policy"]  # its start is where it was created; it kept its place
                if conflicts:
                    raise ProvisionConflict(run, conflicts)
                report.note_found(what)
                return report
            if not replace:
                raise ConsumerTaken(cfg.name, owner)
            try:
                await js.delete_consumer(ctl, cfg.name)
            except NotFoundError:
                pass
        try:
            await js.add_consumer(ctl, config=cfg)
        except APIError as exc:  # created meanwhile by another process: look again
            last = exc
            continue
        report.note_created(what)
        return report
    raise server_refused(what, last) if last is not None else ProvisionError(f"creating {what} failed")


async def ensure_island_consumers(
    js, run: str, island: str, gen: str, start_seq: int | None = None,
    *, ack_wait_s: float = ISLAND_ACK_WAIT_S, inactive_s: float = ISLAND_INACTIVE_S,
) -> ProvisionReport:
    """Both of island I's consumers on CTL (`pull-I` and `isl-I`) for generation `gen`, replacing
    an earlier generation's (see ensure_island_consumer)."""
    _check_run_id(run)
    check_island(island)
    ctl = S.stream(run, "CTL")
    if await stream_info_or_none(js, ctl) is None:
        raise RunNotProvisioned(run, [f"stream {ctl}"], 0.0)
    report = ProvisionReport(run)
    for kind in S.ISLAND_CONSUMER_KINDS:
        await ensure_island_consumer(js, run, island, gen, kind, start_seq, ack_wait_s=ack_wait_s,
                                     inactive_s=inactive_s, report=report)
    return report


async def remove_island_consumers(js, run: str, island: str, gen: str) -> list[str]:
    """Delete island I's consumers that generation `gen` owns (never a later generation's); return
    their names."""
    ctl = S.stream(run, "CTL")
    gone = []
    for kind in S.ISLAND_CONSUMER_KINDS:
        name = S.island_consumer(island, kind)
        if consumer_owner(await consumer_info_or_none(js, ctl, name)) != gen:
            continue
        try:
            await js.delete_consumer(ctl, name)
            gone.append(name)
        except NotFoundError:
            pass
    return gone
