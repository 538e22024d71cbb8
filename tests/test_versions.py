"""The version rules (schemas/versions.py), one test per rule, no broker: which protocols a process accepts
(an accepted mix; a refused one named with both sides' protocol and release, before the schema), what the
hello, the session and the state state, and the old state format (tests/fixtures/state-format-1/, written
by the code before versioned state) read and migrated. The same rules end to end: tests/test_versions_e2e.py."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import orjson
import pytest

from yeto.schemas import codec, versions
from yeto.schemas.errors import SchemaError
from yeto.schemas.layout import layout_fingerprint
from yeto.schemas.versions import VersionError
from yeto.services.syncer.checkpoint import MANIFEST, CheckpointDir, CheckpointError, CheckpointState
from yeto.services.syncer.recording import InputRecorder
from yeto.services.syncer.actions import WriteSession
from yeto.services.syncer.events import Hello
from yeto.services.syncer.rounds import RoundMachine

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
OLD = ROOT / "tests" / "fixtures" / "state-format-1"
LAYOUT = [{"name": "embed.weight", "shape": [4, 2], "dtype": "float32"}]
GEN = "0123456789abcdef"
MINE = versions.software()


def _hello(**kw) -> dict:
    msg = codec.make("hello", run="r1", island="c", gen=GEN, layout=LAYOUT, layout_fingerprint=layout_fingerprint(LAYOUT),
                     push_dtype="auto", bulk_dtype="auto", world={"ranks": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1, "nodes": 1},
                     host="h")
    msg.update(kw)
    return msg


# ---- the software release ------------------------------------------------------------------------------

def test_software_is_the_package_version_as_pyproject_states_it():
    version = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert MINE == f"yeto-nats {version}"
    assert versions.SOFTWARE_RE.fullmatch(MINE)   # what the hello and session schemas allow


# ---- protocol: the accepted mix ----------------------------------------------------------------------------

def test_accepted_mix_same_protocol_any_release_and_no_release_at_all():
    # Another release speaking protocol 1 is admitted: the release is reported, never compared.
    for software in ("yeto-nats 0.1.0", "yeto-nats 0.9.3", None):
        msg = _hello() if software is None else _hello(software=software)
        kind, got = codec.decode_typed(orjson.dumps(msg), ("hello", "heartbeat", "ack"))
        assert kind == "hello" and got.get("software") == software
    assert versions.ACCEPTED_PROTOCOLS == (1, 1) and versions.accepts_protocol(codec.PROTOCOL_VERSION)
    # The session a syncer pins carries its release; one written before versioning (none) still reads.
    session = codec.examples("session")[0]
    assert codec.validate("session", session)["software"] == "yeto-nats 0.1.0"
    session.pop("software")
    codec.validate("session", session)


def test_widening_the_accepted_range_is_one_edit(monkeypatch):
    # The rule alone: with (1, 2) a protocol-2 hello passes the version check (the schema of protocol 2 is
    # that release's own to bring, so the check is called directly here).
    monkeypatch.setattr(versions, "ACCEPTED_PROTOCOLS", (1, 2))
    versions.check_protocol("hello", _hello(v=2), from_island=True)
    with pytest.raises(VersionError, match=r"accepts 1\.\.2"):
        versions.check_protocol("hello", _hello(v=3), from_island=True)


# ---- protocol: the refused mix, both versions named --------------------------------------------------------

def test_a_hello_of_a_newer_protocol_is_refused_in_one_line_naming_both_versions():
    raw = orjson.dumps(_hello(v=2, software="yeto-nats 0.2.0", something_new={"x": 1}))
    with pytest.raises(VersionError) as ei:
        codec.decode_typed(raw, ("hello", "heartbeat", "ack"))
    err = ei.value
    text = str(err)
    assert text == (f"hello: island speaks protocol 2 (yeto-nats 0.2.0), this syncer accepts 1..1 ({MINE}) "
                    f"(field 'v', value 2)")
    assert "\n" not in text
    # a SchemaError like any refusal (counted, taped), with its own code and the field to blame
    assert isinstance(err, SchemaError) and err.code == "protocol_version" and err.field == "v" and err.value == 2
    # what the syncer needs to answer the island that sent it
    assert (err.kind, err.island, err.gen) == ("hello", "c", GEN)


@pytest.mark.parametrize("v", [0, 2, 99])
def test_every_kind_refuses_another_protocol_before_its_schema(v):
    for kind in codec.KINDS:
        msg = codec.examples(kind)[0]
        msg["v"] = v
        with pytest.raises(VersionError, match=f"speaks protocol {v} ") as ei:
            codec.validate(kind, msg)
        sender, reader = ("island", "syncer") if kind in codec.ISLAND_KINDS else ("syncer", "island")
        assert f"{kind}: {sender} speaks protocol {v} (" in str(ei.value) and f"this {reader} accepts 1..1" in str(ei.value)


def test_an_island_refuses_a_session_of_another_protocol_naming_both():
    session = codec.examples("session")[0]
    session.update(v=2, software="yeto-nats 0.2.0")
    with pytest.raises(VersionError) as ei:
        codec.decode("session", orjson.dumps(session))
    assert str(ei.value).startswith(f"session: syncer speaks protocol 2 (yeto-nats 0.2.0), this island accepts 1..1 "
                                    f"({MINE})")


def test_a_stated_release_that_is_not_one_is_not_echoed():
    # The refusal comes before the schema: a `software` the schema would refuse never reaches the line.
    for bad in ("x" * 65, "evil\nline", 42, ""):
        with pytest.raises(VersionError) as ei:
            codec.validate("hello", _hello(v=2, software=bad))
        assert "(software not stated)" in str(ei.value) and "\n" not in str(ei.value)
    # in protocol 1 the schema refuses it naming the field
    with pytest.raises(SchemaError) as ei:
        codec.validate("hello", _hello(software="evil\nline"))
    assert ei.value.field == "software" and not isinstance(ei.value, VersionError)


def test_a_v_that_is_not_an_integer_is_the_schemas_to_refuse():
    for v in ("2", 2.0, True, None):
        with pytest.raises(SchemaError) as ei:
            codec.validate("hello", _hello(v=v))
        assert not isinstance(ei.value, VersionError) and ei.value.field == "v"


# ---- what each process states ----------------------------------------------------------------------------

def _pin(software: str | None) -> dict:
    from tests.test_golden_rounds import config

    m = RoundMachine(config(software=software))
    acts = m.handle(Hello("a", GEN, LAYOUT + [{"name": "w", "shape": [2], "dtype": "float32"}],
                          layout_fingerprint(LAYOUT + [{"name": "w", "shape": [2], "dtype": "float32"}]),
                          "auto", "auto", 0.0))
    (ws,) = [a for a in acts if isinstance(a, WriteSession)]
    return ws.session


def test_the_session_a_syncer_pins_states_its_release():
    session = _pin(MINE)
    assert session["software"] == MINE and codec.validate("session", session)
    # The software is not part of the layout agreement: the fingerprints are those of a session without it.
    plain = _pin(None)
    assert "software" not in plain   # (the golden fixtures' machine, which states none, is unchanged)
    assert {k: v for k, v in session.items() if k != "software"} == plain


def test_an_islands_join_record_states_the_release_its_hello_stated():
    from tests.test_golden_rounds import config
    from yeto.services.syncer.actions import Tape
    from yeto.services.syncer.events import event_from_json, event_to_json

    lay = LAYOUT + [{"name": "w", "shape": [2], "dtype": "float32"}]
    m = RoundMachine(config(software=MINE))

    def joins(acts):
        return [a.event for a in acts if isinstance(a, Tape) and a.event["kind"] == "join"]

    hello = Hello("a", GEN, lay, layout_fingerprint(lay), "auto", "auto", 0.0, software="yeto-nats 0.2.0")
    assert event_from_json(event_to_json(hello)) == hello   # recorded on the tape as fed, replayed the same
    (rec,) = joins(m.handle(hello))
    assert rec["reason"] == "admitted" and rec["detail"] == {"software": "yeto-nats 0.2.0"}
    (rec,) = joins(m.handle(Hello("a", "f" * 16, lay, layout_fingerprint(lay), "auto", "auto", 1.0, software=MINE)))
    assert rec["reason"].startswith("new generation") and rec["detail"] == {"software": MINE}
    # a hello that states none (0.1.0 before versioning): no detail, and its event JSON is what it was then
    old = Hello("b", "b" * 16, lay, layout_fingerprint(lay), "auto", "auto", 2.0)
    assert "software" not in event_to_json(old)
    (rec,) = joins(m.handle(old))
    assert "detail" not in rec


def test_the_tape_start_record_states_protocol_format_and_the_state_resumed():
    from tests.test_golden_rounds import config

    rec = InputRecorder("p1").start(config(software=MINE), None, 0.0)["detail"]
    assert rec["config"]["software"] == MINE and rec["protocol"] == 1 and rec["state_format"] == versions.STATE_FORMAT
    assert "resumed_state" not in rec
    resumed = {"format": 1, "software": None, "migrated_from": 1}
    rec = InputRecorder("p1").start(config(), {"session": {}}, 0.0, resumed_state=resumed)["detail"]
    assert rec["resumed_state"] == resumed
    codec.validate("event", {"v": 1, "run": "golden", **InputRecorder("p").start(config(), None, 0.0)})


def test_what_a_syncer_writes_states_format_and_release(tmp_path):
    ck = CheckpointDir(tmp_path)
    st = CheckpointState(run="r1", session_fingerprint="s" * 64, layout_fingerprint="l" * 64, versions={0: 0})
    import torch

    ck.commit(st, {0: (torch.zeros(3), torch.zeros(3))})
    doc = orjson.loads((tmp_path / MANIFEST).read_bytes())
    assert doc["format"] == versions.STATE_FORMAT == 2 and doc["software"] == MINE
    back = ck.read_state()
    assert back == st and back.software == MINE and back.migrated_from is None
    ck.write_intent(0, {"merge": {}})
    intent = orjson.loads(ck.intent_path(0).read_bytes())
    assert intent["format"] == 2 and intent["software"] == MINE
    # the state KV's commit record (Cut.write_commit_record stamps it)
    rec = versions.stamp({"committed_step": 3, "versions": {"0": 2}, "format": 1, "software": "stale"})
    assert list(rec)[:2] == ["format", "software"] and rec["format"] == 2 and rec["software"] == MINE


# ---- state: the old format resumed, a newer one refused ------------------------------------------------------

def test_the_old_state_format_is_read_and_migrated_in_memory(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD, ckpt)
    raw = orjson.loads((ckpt / MANIFEST).read_bytes())
    assert raw["format"] == 1 and "software" not in raw   # really the old format, as 1c3f0e2 wrote it
    st = CheckpointDir(ckpt).read_state()
    assert st.migrated_from == 1 and st.software is None
    assert (st.run, st.committed_step, st.versions, st.final) == ("statev1", 3, {0: 2, 1: 1}, False)
    assert set(st.version_digests) == {0, 1} and [r["kind"] for r in st.tape] == ["merge", "commit"]
    # the merge intents of format 1 (both stale: their versions are committed) read the same way
    for fid in (0, 1):
        intent = CheckpointDir(ckpt).read_intent(fid)
        assert intent["migrated_from"] == 1 and intent["format"] == 2 and intent["merge"]["version"] <= st.versions[fid]
    # the state KV's commit record of that moment has no format field at all: format 1
    commit = orjson.loads((OLD / "kv-commit.json").read_bytes())
    assert "format" not in commit and versions.check_state_format(commit, "commit") == 1
    assert versions.migrate_state(commit, "commit")["migrated_from"] == 1
    # the session written then has no `software` and still validates
    assert "software" not in codec.validate("session", orjson.loads((OLD / "session.json").read_bytes()))
    # reading changed nothing on disk: the next commit writes format 2
    assert orjson.loads((ckpt / MANIFEST).read_bytes()) == raw


def test_a_state_format_of_a_later_release_is_refused_naming_both(tmp_path):
    later = {"format": 3, "software": "yeto-nats 0.3.0", "committed_step": 9}
    with pytest.raises(versions.StateFormatError) as ei:
        versions.check_state_format(later, "the state KV's commit record")
    assert str(ei.value).startswith("the state KV's commit record is state format 3 (written by yeto-nats 0.3.0), "
                                    f"this syncer resumes formats 1..2 ({MINE})")
    (tmp_path / MANIFEST).write_bytes(orjson.dumps({**orjson.loads((OLD / MANIFEST).read_bytes()), **later}))
    with pytest.raises(CheckpointError, match="state format 3 .*resumes formats 1..2"):
        CheckpointDir(tmp_path).read_state()
    with pytest.raises(versions.StateFormatError, match="not an integer"):
        versions.state_format({"format": "2"})
