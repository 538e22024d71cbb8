"""The round machine's explicit state (services/syncer/machine_state.py, docs/design.md §4.1): one typed
`MachineState`, the phase moved only through `MachineState.enter` (which refuses a move the transition
table does not allow), rule parts that keep nothing of their own, and a handler for every event type.
No broker, no clock."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import orjson
import pytest

from yeto.services.syncer.events import EVENT_TYPES, Tick, event_from_json
from yeto.services.syncer.machine_state import TRANSITIONS, IllegalTransition, MachineState
from yeto.services.syncer.config import SyncerConfig
from yeto.services.syncer.rounds import RoundMachine
from yeto.services.syncer.state import Phase

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "rounds"
SYNCER = ROOT / "services" / "syncer"


def test_the_table_names_every_phase_and_only_phases():
    assert set(TRANSITIONS) == set(Phase)
    assert all(set(to) <= set(Phase) and frm not in to for frm, to in TRANSITIONS.items())
    assert TRANSITIONS[Phase.DONE] == frozenset()


def test_a_legal_transition_moves_the_phase():
    s = MachineState(next_step=1)
    for phase in (Phase.INIT, Phase.COMMITTING_V0, Phase.RUNNING, Phase.FINALIZING, Phase.DONE):
        s.enter(phase, "test")
        assert s.phase == phase


@pytest.mark.parametrize("frm,to", [(f, t) for f in Phase for t in Phase if t not in TRANSITIONS[f]])
def test_an_illegal_transition_raises_and_changes_nothing(frm, to):
    s = MachineState(next_step=1, phase=frm)
    with pytest.raises(IllegalTransition, match=f"{frm.value} -> {to.value}"):
        s.enter(to, "test")
    assert s.phase == frm


def _recorded(monkeypatch) -> list[tuple[Phase, Phase]]:
    seen: list[tuple[Phase, Phase]] = []
    real = MachineState.enter

    def enter(self, phase, why):
        seen.append((self.phase, phase))
        real(self, phase, why)

    monkeypatch.setattr(MachineState, "enter", enter)
    return seen


def test_the_golden_fixtures_take_only_legal_transitions_and_cover_the_lifecycle(monkeypatch):
    seen = _recorded(monkeypatch)
    for path in sorted(FIXTURES.glob("*.json")):
        fixture = orjson.loads(path.read_bytes())
        m = RoundMachine(SyncerConfig(**fixture["config"]))
        for step in fixture["steps"]:
            m.handle(event_from_json(step["event"]))
        assert m.phase == Phase.DONE, path.name
    assert seen and all(to in TRANSITIONS[frm] for frm, to in seen)
    assert set(seen) == {(Phase.PINNING, Phase.INIT), (Phase.INIT, Phase.COMMITTING_V0),
                         (Phase.COMMITTING_V0, Phase.RUNNING), (Phase.RUNNING, Phase.FINALIZING),
                         (Phase.FINALIZING, Phase.DONE)}


SESSION = {"fragments": [{}, {}], "layout_fingerprint": "f" * 64, "init_island": "a"}


def test_a_restored_finished_run_goes_from_running_to_done(monkeypatch):
    seen = _recorded(monkeypatch)
    cfg = SyncerConfig(run="r", islands=1, fragments=2, sync_every=2, total_steps=2)
    m = RoundMachine.restore(cfg, SESSION, {"0": 1, "1": 1}, 2, {}, now=5.0,
                             final={"final_step": 2, "versions": {"0": 1, "1": 1}, "finished": True})
    assert m.phase == Phase.RUNNING            # a restored state is built, not entered
    m.handle(Tick(6.0))
    assert seen == [(Phase.RUNNING, Phase.DONE)] and m.phase == Phase.DONE


def test_a_restored_unfinished_finalization_starts_finalizing():
    cfg = SyncerConfig(run="r", islands=1, fragments=2, sync_every=2, total_steps=2)
    m = RoundMachine.restore(cfg, SESSION, {"0": 1, "1": 1}, 2, {"a": {"gen": "a1" * 8}}, now=5.0,
                             final={"final_step": 2, "versions": {"0": 1, "1": 1}, "targets": {"a": "a1" * 8}})
    assert m.phase == Phase.FINALIZING and m.state.final.cut_out and m.state.resend_manifests


def test_only_enter_assigns_the_phase():
    """Every `.phase = ...` in services/syncer is MachineState.enter's own (the shell and the parts enter)."""
    where = []
    for path in sorted(SYNCER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and sub.attr == "phase":
                        where.append((path.name, node.lineno))
    enter = next(n for n in ast.walk(ast.parse((SYNCER / "machine_state.py").read_text()))
                 if isinstance(n, ast.FunctionDef) and n.name == "enter")
    assert len(where) == 1 and where[0][0] == "machine_state.py" and enter.lineno <= where[0][1] <= enter.end_lineno, where


RULES = ("membership", "init_rules", "round_rules", "pushes", "finalize", "sharding", "settings_rules", "rebroadcasts")


def test_every_event_type_has_a_handler_and_every_phase_a_tick():
    m = RoundMachine(SyncerConfig(run="r", islands=1, fragments=1, sync_every=1, total_steps=1))
    assert set(m.handlers) == set(EVENT_TYPES.values()) == set(RoundMachine.EVENTS)
    assert set(m.ticks) == set(Phase)
    assert all(callable(h) and not isinstance(h, str) for h in m.handlers.values())


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "yeto.services.syncer":
                out |= {a.name for a in node.names}
            elif node.module.startswith("yeto.services.syncer."):
                out.add(node.module.rsplit(".", 1)[1])
    return out


def test_rule_modules_are_plain_functions_over_state_config_output_with_no_cycle():
    """Each rule module is functions taking (s, cfg, out, ...): no class keeps rule state, no module-level
    state, none reaches back into the machine (rounds.py), and their imports of each other form no cycle."""
    graph = {}
    for name in RULES:
        tree = ast.parse((SYNCER / f"{name}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                assert issubclass(getattr(__import__(f"yeto.services.syncer.{name}", fromlist=[node.name]),
                                          node.name), Exception), f"{name}.{node.name}: rules keep no objects"
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_parse") and node.args.args:
                args = [a.arg for a in node.args.args]
                if args[:1] == ["s"]:
                    # a rule that emits takes (s, cfg, out, ...); a query that emits nothing takes what it reads
                    assert args[:3] == ["s", "cfg", "out"] or "out" not in args \
                        or node.name == "_machine_settings", (name, node.name, args)
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                value = node.value
                assert isinstance(value, (ast.Constant, ast.Tuple, ast.BinOp, ast.UnaryOp)), \
                    f"{name}: module-level state at line {node.lineno}"
        deps = _imports(SYNCER / f"{name}.py")
        assert "rounds" not in deps, f"{name} imports the machine"
        graph[name] = deps & set(RULES)
    done: set[str] = set()

    def visit(n, path):
        assert n not in path, f"import cycle among rule modules: {' -> '.join(path + [n])}"
        if n in done:
            return
        for d in graph[n]:
            visit(d, path + [n])
        done.add(n)
    for n in graph:
        visit(n, [])
    assert graph["sharding"] >= {"init_rules", "membership", "finalize"}   # the walk saw real edges


def test_the_state_holds_what_the_machine_knows():
    names = {f.name for f in dataclasses.fields(MachineState)}
    assert {"phase", "session", "members", "versions", "committed_step", "rounds", "final", "counters",
            "accepted_norms", "shard_finals", "now", "next_step"} <= names
