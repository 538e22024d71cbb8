"""When `yeto broker` restarts a nats-server that exited on its own (docs/design.md §7): a pure policy, no I/O.

Fed "node i exited at t" and "node i started at t", it answers how long to wait before the restart:
1 s, then doubling up to 30 s while a node keeps dying soon after its start (a config or disk fault should
not spin), back to 1 s once a node stayed up `stable_s` (60 s) before it died. The others keep serving
meanwhile; the shell (services/cmd_broker.py) does the waiting, the restart and the logging.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Node:
    started_at: float | None = None
    quick_deaths: int = 0          # exits within stable_s of the start, in a row
    restarts: int = 0
    due: float | None = None       # when the pending restart is due (None: running or not yet seen dead)

    def started(self, now: float) -> None:
        self.started_at, self.due = now, None

    def died(self, now: float, policy: RestartPolicy) -> float:
        """Seen dead at `now`, for the first time since its start: schedule the restart, return its delay."""
        lived = None if self.started_at is None else now - self.started_at
        self.quick_deaths = 0 if lived is not None and lived >= policy.stable_s else self.quick_deaths + 1
        delay = min(policy.max_s, policy.first_s * 2 ** self.quick_deaths)
        self.due = now + delay
        self.restarts += 1
        return delay


@dataclass
class RestartPolicy:
    first_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0
    nodes: dict[int, _Node] = field(default_factory=dict)

    def _node(self, i: int) -> _Node:
        return self.nodes.setdefault(i, _Node())

    def started(self, i: int, now: float) -> None:
        self._node(i).started(now)

    def exited(self, i: int, now: float) -> float:
        """Node i is seen dead at `now` (once per death): the delay before its restart."""
        n = self._node(i)
        if n.due is not None:              # already scheduled: the same death seen again
            return max(0.0, n.due - now)
        return n.died(now, self)

    def due(self, i: int, now: float) -> bool:
        n = self._node(i)
        return n.due is not None and now >= n.due

    def pending(self, i: int) -> bool:
        return self._node(i).due is not None

    def restarts(self, i: int) -> int:
        return self._node(i).restarts
