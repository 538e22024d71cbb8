"""The syncer shell carries out the round machine's actions from one typed table (`SyncerService.ACTIONS`),
as the machine keeps one handler per event type (`RoundMachine.handlers`): every action type it can emit has
exactly one handler there, each a coroutine function of the shell, and nothing else is in the table. A new
action without a handler fails here, not as an "unhandled action" in a running syncer."""
from __future__ import annotations

import inspect

import pytest

from yeto.services.syncer import actions
from yeto.services.syncer.service import SyncerService

pytestmark = pytest.mark.pure


def _action_types() -> set[type]:
    return {c for _, c in inspect.getmembers(actions, inspect.isclass)
            if issubclass(c, actions.Action) and c is not actions.Action}


def test_every_action_type_has_one_handler():
    table = SyncerService.ACTIONS
    assert set(table) == _action_types()
    for kind, handler in table.items():
        assert inspect.iscoroutinefunction(handler), f"{kind.__name__}: {handler!r} is not a coroutine function"


def test_the_long_actions_run_as_tasks_and_the_rest_in_order():
    # merges, version 0 and the final cuts feed their completion back as events: their handlers only start
    # a task (intake never stops); every other handler is the shell's own method for that action
    long = {actions.Merge, actions.CommitV0, actions.PublishFinal, actions.PublishShardFinal}
    for kind, handler in SyncerService.ACTIONS.items():
        own = getattr(SyncerService, handler.__name__, None) is handler
        assert own != (kind in long), kind.__name__
