"""docs/design.md §4.10: `yeto syncer --outer sparseloco` and its parameters, checked naming the flag and the
value, pinned in the session (schemas/outer_mode.py) so islands follow the syncer's mode; a pin without
the field is a dense run."""
from __future__ import annotations

import pytest

from yeto.schemas import codec
from yeto.schemas import outer_mode as OM
from yeto.schemas.errors import ConfigError, WireError
from yeto.schemas.layout import build_session
from yeto.schemas.messages import Session
from yeto.schemas.sparse_spec import SparseSpec
from yeto.services.cli import build_parser
from yeto.services.cmd_syncer import run as run_syncer
from yeto.services.syncer.config import SyncerConfig

LAYOUT = [{"name": "w", "shape": [8, 8], "dtype": "float32"}, {"name": "b", "shape": [8], "dtype": "float32"}]


def session() -> dict:
    return build_session(LAYOUT, 1, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=4096,
                         init_island="a", sync_every=2, created=1.0)


def test_defaults_are_sparseloco_s_and_dense_is_none():
    assert OM.check_outer("diloco") is None
    pin = OM.check_outer("sparseloco")
    assert pin == {"mode": "sparseloco", "tile": 64, "k": 64, "chunk_1d": 64, "k_1d": 64, "value_bits": 2,
                   "beta": 0.95}
    parsed = OM.parse_pin(pin)
    assert parsed.spec == SparseSpec() and parsed.beta == 0.95


@pytest.mark.parametrize("kw, flag, value", [
    (dict(mode="sparse"), "--outer", "sparse"),
    (dict(tile=65), "--sparse-tile", 65),
    (dict(tile=0), "--sparse-tile", 0),
    (dict(k=4097), "--sparse-k", 4097),
    (dict(chunk_1d=5000), "--sparse-chunk-1d", 5000),
    (dict(k_1d=65), "--sparse-k-1d", 65),
    (dict(value_bits=3), "--sparse-value-bits", 3),
    (dict(beta=1.5), "--sparse-beta", 1.5),
    (dict(beta=float("nan")), "--sparse-beta", float("nan")),
])
def test_a_bad_parameter_is_refused_naming_its_flag_and_value(kw, flag, value):
    mode = kw.pop("mode", "sparseloco")
    with pytest.raises(ConfigError) as err:
        OM.check_outer(mode, **kw)
    assert err.value.field == flag and repr(value) in str(err.value)


def test_yeto_syncer_parses_the_flags_and_refuses_a_bad_one_before_connecting(capsys):
    args = build_parser().parse_args(["syncer", "--run", "r"])
    assert args.outer == "diloco" and (args.sparse_tile, args.sparse_k, args.sparse_beta) == (64, 64, 0.95)
    args = build_parser().parse_args(["syncer", "--run", "r", "--outer", "sparseloco", "--sparse-k", "5000",
                                      "--nats", "nats://127.0.0.1:9"])
    assert run_syncer(args) == 2
    err = capsys.readouterr().err
    assert "--sparse-k" in err and "5000" in err and "Traceback" not in err
    args = build_parser().parse_args(["syncer", "--run", "r", "--outer", "dense", "--nats", "nats://127.0.0.1:9"])
    assert run_syncer(args) == 2
    assert "'--outer'" in capsys.readouterr().err


def test_syncer_config_checks_its_outer_object_and_names_the_flag():
    base = dict(run="r", islands=1, fragments=1, sync_every=1, total_steps=1)
    assert SyncerConfig(**base).sparse is None
    assert SyncerConfig(**base, outer=OM.check_outer("sparseloco", k=8)).sparse.spec.k == 8
    with pytest.raises(ConfigError, match="--outer"):
        SyncerConfig(**base, outer={"mode": "sparseloco", "tile": 64})


def test_the_pin_round_trips_through_the_schema_and_the_typed_message():
    dense = session()
    assert OM.pin(dense, None) is dense and OM.from_session(dense) is None
    # an older pin (no `outer` key) is valid and reads as dense
    assert Session.decode(codec.encode("session", dense)).outer is None
    pinned = OM.pin(dense, OM.check_outer("sparseloco", tile=8, k=4, chunk_1d=8, k_1d=8, beta=0.5))
    assert pinned["session_fingerprint"] != dense["session_fingerprint"]   # another mode, another session
    wire = codec.encode("session", pinned)
    back = Session.decode(wire)
    assert back.outer == pinned["outer"] and Session.from_wire(back.to_wire()) == back
    got = OM.from_session(codec.decode("session", wire))
    assert got.spec == SparseSpec(tile=8, k=4, chunk_1d=8, k_1d=8) and got.beta == 0.5


def test_a_pinned_outer_object_that_does_not_check_is_refused_naming_the_field():
    pinned = OM.pin(session(), OM.check_outer("sparseloco"))
    for key, value in (("mode", "other"), ("value_bits", 3), ("tile", 100), ("extra", 1)):
        bad = {**pinned, "outer": {**pinned["outer"], key: value}}
        with pytest.raises(WireError):
            codec.decode("session", _raw(bad))
    # what the schema cannot see (k beyond the tile) the parser refuses, naming the field
    with pytest.raises(WireError, match="outer.k"):
        OM.parse_pin({**pinned["outer"], "tile": 4, "k": 17})


def _raw(msg: dict) -> bytes:
    import json
    return json.dumps(msg).encode()


def test_the_machine_pins_its_outer_mode_in_the_session_it_writes():
    from yeto.schemas.layout import layout_fingerprint
    from yeto.services.syncer.actions import WriteSession
    from yeto.services.syncer.events import Hello
    from yeto.services.syncer.rounds import RoundMachine

    fp = layout_fingerprint(LAYOUT)
    base = dict(run="r", islands=1, fragments=1, sync_every=2, total_steps=1, chunk_bytes=4096)
    for outer in (None, OM.check_outer("sparseloco", k=8)):
        m = RoundMachine(SyncerConfig(**base, outer=outer))
        acts = m.handle(Hello("a", "a1" * 8, LAYOUT, fp, "auto", "auto", 0.0))
        (ws,) = [a for a in acts if isinstance(a, WriteSession)]
        codec.validate("session", ws.session)
        assert ws.session.get("outer") == outer and OM.from_session(ws.session) == OM.parse_pin(outer)


def test_a_follower_shard_adopts_only_a_session_of_its_own_outer_mode():
    from yeto.services.syncer.actions import AdoptSession
    from yeto.services.syncer.events import SessionSeen
    from yeto.services.syncer.rounds import RoundMachine

    base = dict(run="r", islands=1, fragments=2, sync_every=2, total_steps=2, shard=1, shards=2)
    sparse = OM.pin(build_session(LAYOUT, 2, run="r", push_dtype="f32", bulk_dtype="f32", chunk_bytes=4096,
                                  init_island="a", sync_every=2), OM.check_outer("sparseloco"))
    dense = {k: v for k, v in sparse.items() if k != "outer"}
    for outer, seen, adopts in ((None, sparse, False), (OM.check_outer("sparseloco", k=8), sparse, False),
                                (None, dense, True), (OM.check_outer("sparseloco"), sparse, True)):
        m = RoundMachine(SyncerConfig(**base, outer=outer))
        acts = m.handle(SessionSeen(seen, 0.1))
        assert bool([a for a in acts if isinstance(a, AdoptSession)]) == adopts
        if not adopts:
            assert m.counters["rejected.session_record"] == 1
            (err,) = [a.event for a in acts if getattr(a, "event", {}).get("kind") == "error"]
            assert err["detail"] == {"code": "outer_mismatch", "field": "outer"}


def test_yeto_syncer_refuses_speculate_with_the_sparse_mode(capsys):
    args = build_parser().parse_args(["syncer", "--run", "r", "--outer", "sparseloco", "--speculate", "on",
                                      "--nats", "nats://127.0.0.1:9"])
    assert run_syncer(args) == 2
    assert "--speculate" in capsys.readouterr().err
