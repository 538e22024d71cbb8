"""Every subject, stream, bucket, consumer name and `Nats-Msg-Id` of a run is built here, and only here.

Layout (run R, island I, fragment F), docs/design.md §3.1:

    yeto.R.ctl.hello.I | ctl.pull | ctl.to.I        -> stream CTL
    yeto.R.ctl.set                                  -> no stream (a request)
    yeto.R.ctl.hb.I | ctl.ack.I                     -> stream HB (1 msg per subject)
    yeto.R.push.I.F | init.F                        -> streams PUSH, INIT
    yeto.R.bcast.F.<chunk> | final.F.<chunk>        -> streams BCAST, FINAL (1 msg per subject)
    yeto.R.steplog.I | events.<kind>                -> streams STEPLOG, EVENTS

Subjects and state are per fragment, so syncer shards own fragments with no protocol change (§10). The
JetStream API subjects a client publishes to by hand are built here too: `js_api` (`$JS.API`, or
`$JS.<domain>.API`), `consumer_msg_next` (a pull request), `kv_key` (a KV write as a plain publish).
"""
from __future__ import annotations

from .ids import check_island, check_run, check_token

PREFIX = "yeto"
MSG_ID = "Nats-Msg-Id"

STREAM_KINDS = ("CTL", "HB", "PUSH", "INIT", "BCAST", "FINAL", "STEPLOG", "EVENTS")
KV_KINDS = ("members", "state", "ckpt")   # ckpt: the syncer's committed params, its alone


# The streams other identities may publish into too (an island on its own subjects of CTL, PUSH, INIT,
# STEPLOG): JetStream de-duplicates by Nats-Msg-Id per *stream*, whatever the subject, so an id of ours
# there can be taken by someone else's publish first (docs/design.md §3.5). BCAST, FINAL, EVENTS and the KV buckets
# take only the syncer's writes in a secured run. schemas/publish.py re-sends under a fresh id there.
SHARED_STREAM_TOKENS = ("ctl", "push", "init", "steplog")


def in_shared_stream(subject: str) -> bool:
    """Whether `subject` (of any run) lies in a stream that other identities also publish into."""
    parts = subject.split(".", 3)
    return len(parts) >= 3 and parts[0] == PREFIX and parts[2] in SHARED_STREAM_TOKENS


def _i(value: int, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        from .errors import IdError

        raise IdError("must be a non-negative integer", field=field, value=value)
    return value


def root(run: str) -> str:
    return f"{PREFIX}.{check_run(run)}"


# ---- streams, buckets, consumers ----------------------------------------------------------------

def stream(run: str, kind: str) -> str:
    if kind not in STREAM_KINDS:
        raise ValueError(f"unknown stream kind {kind!r}; one of {STREAM_KINDS}")
    return f"YETO_{check_run(run)}_{kind}"


def kv_bucket(run: str, kind: str) -> str:
    if kind not in KV_KINDS:
        raise ValueError(f"unknown KV kind {kind!r}; one of {KV_KINDS}")
    return f"yeto_{check_run(run)}_{kind}"


def stream_subjects(run: str, kind: str) -> list[str]:
    r = root(run)
    return {
        # Heartbeats and final acks have a stream of their own that keeps the newest per subject (HB): a
        # flood on one island's subjects is one message to read, never a queue in front of the others'
        # (docs/design.md §3.1). Only the newest of each matters. Hellos stay on CTL: an island's CTL consumers
        # start at its hello's stream sequence.
        "CTL": [f"{r}.ctl.hello.*", f"{r}.ctl.pull", f"{r}.ctl.to.*"],
        "HB": [f"{r}.ctl.hb.*", f"{r}.ctl.ack.*"],
        "PUSH": [f"{r}.push.*.*"],
        "INIT": [f"{r}.init.*"],
        "BCAST": [f"{r}.bcast.*.*"],
        "FINAL": [f"{r}.final.*.*"],
        "STEPLOG": [f"{r}.steplog.*"],
        "EVENTS": [f"{r}.events.*"],
    }[kind]


SYNCER_CTL_CONSUMER = "syncer-ctl"
SYNCER_HB_CONSUMER = "syncer-hb"
SYNCER_INIT_CONSUMER = "syncer-init"
SYNCER_PUSH_CONSUMER = "syncer-push"


# An island's two durable consumers on CTL have fixed names, one per island, and one filter subject
# each: nats-py then creates them on `$JS.API.CONSUMER.CREATE.<CTL>.<name>.<filter>`, and the server
# refuses a config whose name or filter differs from those tokens. So the subject names both, and the
# permissions of `yeto auth init` can confine an island to its own two consumers and their filters
# (services/auth.py). A new generation replaces them (schemas.provision.ensure_island_consumers); the
# generation that owns one is in its metadata (`ISLAND_GEN_KEY`). The prefixes differ, so no island
# id can make one island's name equal another's (`isl-x` never equals `pull-y`).
ISLAND_GEN_KEY = "yeto_gen"
ISLAND_CONSUMER_KINDS = ("pull", "to")


def island_pull_consumer(island: str) -> str:
    """Island I's consumer of the pulls (`ctl.pull`, the same for every island)."""
    return f"pull-{check_island(island)}"


def island_to_consumer(island: str) -> str:
    """Island I's consumer of the messages to it (`ctl.to.I`: manifest, error, shutdown)."""
    return f"isl-{check_island(island)}"


def island_consumer(island: str, kind: str) -> str:
    if kind not in ISLAND_CONSUMER_KINDS:
        raise ValueError(f"unknown island consumer kind {kind!r}; one of {ISLAND_CONSUMER_KINDS}")
    return island_pull_consumer(island) if kind == "pull" else island_to_consumer(island)


def island_consumer_filter(run: str, island: str, kind: str) -> str:
    if kind not in ISLAND_CONSUMER_KINDS:
        raise ValueError(f"unknown island consumer kind {kind!r}; one of {ISLAND_CONSUMER_KINDS}")
    return pull(run) if kind == "pull" else to_island(run, island)


# ---- subjects -------------------------------------------------------------------------------------

def hello(run: str, island: str) -> str:
    return f"{root(run)}.ctl.hello.{check_island(island)}"


def heartbeat(run: str, island: str) -> str:
    return f"{root(run)}.ctl.hb.{check_island(island)}"


def ack(run: str, island: str) -> str:
    return f"{root(run)}.ctl.ack.{check_island(island)}"


def pull(run: str) -> str:
    return f"{root(run)}.ctl.pull"


def to_island(run: str, island: str) -> str:
    return f"{root(run)}.ctl.to.{check_island(island)}"


def settings(run: str) -> str:
    """`yeto run set`'s request subject: core NATS, in no stream (every owning syncer shard answers the live
    request; what it applied is kept in its state KV `settings` key, so a standby that takes over keeps it)."""
    return f"{root(run)}.ctl.set"


def syncer_ctl_filters(run: str) -> list[str]:
    """What the syncer reads of CTL: hellos (heartbeats and final acks are on HB: `syncer_hb_filters`)."""
    return [f"{root(run)}.ctl.hello.*"]


def syncer_hb_filters(run: str) -> list[str]:
    r = root(run)
    return [f"{r}.ctl.hb.*", f"{r}.ctl.ack.*"]


def island_ctl_filters(run: str, island: str) -> list[str]:
    return [pull(run), to_island(run, island)]


def push(run: str, island: str, fragment: int) -> str:
    return f"{root(run)}.push.{check_island(island)}.{_i(fragment, 'fragment')}"


def run_all(run: str) -> str:
    """Every subject of the run (a tap on the whole run, or a permission)."""
    return f"{root(run)}.>"


def push_island_all(run: str, island: str) -> str:
    """Every push subject of island I (its publish permission)."""
    return f"{root(run)}.push.{check_island(island)}.*"


def push_all(run: str) -> str:
    return f"{root(run)}.push.*.*"


def push_fragment_all(run: str, fragment: int) -> str:
    """Every island's push subject of one fragment (the syncer's purge after a commit)."""
    return f"{root(run)}.push.*.{_i(fragment, 'fragment')}"


def init(run: str, fragment: int) -> str:
    return f"{root(run)}.init.{_i(fragment, 'fragment')}"


def init_all(run: str) -> str:
    return f"{root(run)}.init.*"


def bcast(run: str, fragment: int, chunk: int) -> str:
    return f"{root(run)}.bcast.{_i(fragment, 'fragment')}.{_i(chunk, 'chunk')}"


def bcast_all(run: str) -> str:
    return f"{root(run)}.bcast.*.*"


def bcast_fragment(run: str, fragment: int) -> str:
    return f"{root(run)}.bcast.{_i(fragment, 'fragment')}.*"


def final(run: str, fragment: int, chunk: int) -> str:
    return f"{root(run)}.final.{_i(fragment, 'fragment')}.{_i(chunk, 'chunk')}"


def final_all(run: str) -> str:
    return f"{root(run)}.final.*.*"


def steplog(run: str, island: str) -> str:
    return f"{root(run)}.steplog.{check_island(island)}"


def steplog_all(run: str) -> str:
    return f"{root(run)}.steplog.*"


def events(run: str, kind: str) -> str:
    return f"{root(run)}.events.{check_token(kind, 'kind')}"


def events_all(run: str) -> str:
    return f"{root(run)}.events.*"


# ---- JetStream API subjects ----------------------------------------------------------------------

def js_api(domain: str | None = None) -> str:
    """The JetStream API prefix: `$JS.API`, or `$JS.<domain>.API` to reach another domain's JetStream."""
    return "$JS.API" if domain is None else f"$JS.{check_token(domain, 'domain')}.API"


def consumer_msg_next(stream_name: str, consumer: str, domain: str | None = None) -> str:
    """The subject of a pull request (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`)."""
    return f"{js_api(domain)}.CONSUMER.MSG.NEXT.{check_token(stream_name, 'stream')}.{check_token(consumer, 'consumer')}"


def js_ack(stream_name: str, consumer: str = "*") -> str:
    """Every ack subject of a consumer's deliveries (`$JS.ACK.<stream>.<consumer>.>`; a permission)."""
    return f"$JS.ACK.{check_token(stream_name, 'stream')}.{consumer if consumer == '*' else check_token(consumer, 'consumer')}.>"


def js_flow_control(stream_name: str) -> str:
    """The flow-control and heartbeat replies of an ordered consumer on a stream (a permission)."""
    return f"$JS.FC.{check_token(stream_name, 'stream')}.>"


def kv_key(run: str, kind: str, key: str) -> str:
    """The subject a write of `key` in the run's `kind` bucket is published on (`$KV.<bucket>.<key>`)."""
    return f"$KV.{kv_bucket(run, kind)}.{key}"


def parse(run: str, subject: str) -> tuple[str, ...]:
    """Split a subject of run `run` into its tokens after `yeto.R.`; raise on a foreign subject."""
    r = root(run) + "."
    if not subject.startswith(r):
        raise ValueError(f"subject {subject!r} is not under {r!r}")
    return tuple(subject[len(r):].split("."))


# ---- Nats-Msg-Id keys (per attempt; docs/design.md §3.5) ----------------------------------------

def pull_msg_id(fragment: int, step: int, attempt: int, seq: int) -> str:
    return f"pull.{fragment}.{step}.{attempt}.{seq}"


def push_msg_id(island: str, gen: str, fragment: int, step: int, attempt: int, try_: int, chunk: int) -> str:
    return f"push.{check_island(island)}.{gen}.{fragment}.{step}.{attempt}.{try_}.{chunk}"


def init_msg_id(fragment: int, chunk: int, gen: str) -> str:
    # The INIT island's generation is part of the key: a restarted INIT island resends, and must not be
    # swallowed by the duplicate window as if it were the first process's bytes.
    return f"init.{fragment}.{gen}.{chunk}"


def bcast_msg_id(fragment: int, version: int, chunk: int, resend: int | None = None) -> str:
    # A re-send of a committed version (the syncer's re-broadcast) needs an id of its own: within the
    # duplicate window JetStream would drop the original id, and the chunk would stay lost.
    base = f"bcast.{fragment}.{version}.{chunk}"
    return base if resend is None else f"{base}.r{resend}"


def final_msg_id(fragment: int, version: int, chunk: int) -> str:
    return f"final.{fragment}.{version}.{chunk}"


def hello_msg_id(island: str, gen: str) -> str:
    return f"hello.{check_island(island)}.{gen}"


def hello_again_msg_id(island: str, gen: str, n: int) -> str:
    """The n-th hello a generation sends again (the syncer lost its record of the island): a new id,
    or JetStream's duplicate window would drop it as the first hello's copy."""
    return f"{hello_msg_id(island, gen)}.again.{_i(n, 'n')}"


def heartbeat_msg_id(island: str, gen: str, seq: int) -> str:
    return f"hb.{check_island(island)}.{gen}.{seq}"


def leaving_msg_id(island: str, gen: str) -> str:
    """The last heartbeat of a generation, the one that says it stops (`leaving`): one per generation."""
    return f"hb.{check_island(island)}.{gen}.leaving"


def ack_msg_id(island: str, gen: str, final_step: int, resend: int = 0) -> str:
    # A re-send (the island still waits for its shutdown) needs its own id: the duplicate window would drop it.
    base = f"ack.{check_island(island)}.{gen}.{final_step}"
    return f"{base}.{resend}" if resend else base


def to_island_msg_id(island: str, kind: str, key: str) -> str:
    return f"to.{check_island(island)}.{kind}.{key}"


def steplog_msg_id(island: str, gen: str, step: int) -> str:
    return f"steplog.{check_island(island)}.{gen}.{step}"


def event_msg_id(kind: str, key: str) -> str:
    return f"event.{kind}.{key}"


def final_fragment(run: str, fragment: int) -> str:
    return f"{root(run)}.final.{_i(fragment, 'fragment')}.*"
