"""The staleness bound of asynchronous rollouts, and admission control (used by ``asynchronous.py``).

Versions: the trainer's step t turns policy v_t = t into t+1 and trains batch t. A group admitted
while the server serves version v and placed in batch b is trained by step b, from policy b: its
age is ``b - v`` (the versions between the policy trained and the oldest policy that produced any
of its tokens; tokens sampled after a push mid-group are younger, never older).
``max_off_policy_steps = k`` bounds every trained group's age by k; k = 0 is the synchronous loop.

- **Admission**: a group is placed, whole, in the first batch with a free slot (``groups_per_step``
  per batch), and started only if that batch's index minus the served version is at most k. Nothing
  is started that would have to be discarded for age: the bound holds by construction.
- **Groups are never split**: a group belongs to one batch, all of its samples.
- **Stragglers**: when batch b is due (the trainer is at step b) and one of its groups has not
  finished, the group may move to batch b+1 only if it stays within the bound (b+1 - v <= k);
  otherwise it is dropped whole, and counted. Batch b is then *closed*: it trains with the groups
  that finished, and no group is admitted into it any more (its freed slot would only delay it).

:func:`simulate` runs the schedule on a clock (rollout and step durations given) and reports the
ages of trained groups, drops and the idle fractions of trainer and server; the tests use it with
admission control removed to see the bound break.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Group:
    gid: str
    version: int  # the served version when it started (the oldest of its tokens)
    batch: int
    done: bool = False


@dataclass
class Admission:
    k: int
    groups_per_step: int
    groups: dict[str, Group] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    enforce: bool = True  # False only in tests: the bound's test must fail without admission control
    closed: set[int] = field(default_factory=set)  # batches whose stragglers were moved on or dropped

    def next_batch(self, trainer_step: int) -> int:
        """The first batch (from the one the trainer is on) with a free slot."""
        load = Counter(g.batch for g in self.groups.values())
        b = trainer_step
        while load[b] >= self.groups_per_step or b in self.closed:
            b += 1
        return b

    _next_batch = next_batch

    def can_admit(self, served_version: int, trainer_step: int) -> bool:
        return not self.enforce or self._next_batch(trainer_step) - served_version <= self.k

    def admit(self, gid: str, served_version: int, trainer_step: int) -> Optional[Group]:
        if not self.can_admit(served_version, trainer_step):
            return None
        g = Group(gid, served_version, self._next_batch(trainer_step))
        self.groups[gid] = g
        return g

    def finish(self, gid: str) -> None:
        self.groups[gid].done = True

    def take_batch(self, trainer_step: int) -> Optional[list[Group]]:
        """Batch ``trainer_step`` when every group in it has finished, else None. Stragglers of a full
        batch wait; the caller decides when a straggler is late (:meth:`defer_stragglers`)."""
        mine = [g for g in self.groups.values() if g.batch == trainer_step]
        full = len(mine) >= self.groups_per_step or trainer_step in self.closed
        if not full or not all(g.done for g in mine):
            return None
        for g in mine:
            del self.groups[g.gid]
        self.closed.discard(trainer_step)
        return mine

    def defer_stragglers(self, trainer_step: int) -> list[str]:
        """Move the unfinished groups of batch ``trainer_step`` to the next batch when the bound allows,
        else drop them whole; returns the dropped ids."""
        dropped = []
        for g in [g for g in self.groups.values() if g.batch == trainer_step and not g.done]:
            if trainer_step + 1 - g.version <= self.k:
                g.batch = trainer_step + 1
            else:
                del self.groups[g.gid]
                dropped.append(g.gid)
        self.dropped += dropped
        self.closed.add(trainer_step)
        return dropped

    def to_dict(self) -> dict[str, Any]:
        """What resume needs (the loop's state file): admitted groups, drops, closed batches."""
        return {"groups": [dataclasses.asdict(g) for g in self.groups.values()], "dropped": list(self.dropped),
                "closed": sorted(self.closed)}

    def restore(self, data: dict[str, Any]) -> None:
        """Admitted groups come back unfinished: the placement returns their finished samples at once."""
        self.groups = {g["gid"]: Group(g["gid"], int(g["version"]), int(g["batch"])) for g in data.get("groups", [])}
        self.dropped = list(data.get("dropped", []))
        self.closed = set(int(b) for b in data.get("closed", []))


@dataclass
class SimResult:
    ages: Counter  # trained groups by age
    dropped: int
    trained_groups: int
    wall: float
    trainer_idle: float  # fraction of wall time
    server_idle: float


def simulate(k: int, groups_per_step: int, steps: int, rollout_s: list[float] | float, train_s: float,
             push_s: float = 0.0, slots: int = 2, enforce: bool = True) -> SimResult:
    """The schedule on a clock: ``slots`` groups run at once on the server; a group takes the next
    of ``rollout_s`` (cycled); the trainer steps when its batch is complete; a push pauses rollouts
    for ``push_s``. k = 0 waits for each push before admitting the next batch (synchronous)."""
    durations = rollout_s if isinstance(rollout_s, list) else [rollout_s]
    adm = Admission(k, groups_per_step, enforce=enforce)
    t, version, trainer_step = 0.0, 0, 0
    running: dict[str, float] = {}  # gid -> finish time
    trainer_busy_until: Optional[float] = None
    pushed_at: list[float] = []
    ages: Counter = Counter()
    trained = n = 0
    trainer_busy = server_busy = 0.0
    while trainer_step < steps:
        # admit while slots are free and the bound allows
        while len(running) < slots and adm.can_admit(version, trainer_step):
            gid = f"g{n}"
            g = adm.admit(gid, version, trainer_step)
            if g is None:
                break
            running[gid] = t + durations[n % len(durations)]
            n += 1
        # the trainer takes its batch when complete
        if trainer_busy_until is None:
            batch = adm.take_batch(trainer_step)
            if batch is not None:
                for g in batch:
                    ages[trainer_step - g.version] += 1
                trained += len(batch)
                trainer_busy_until = t + train_s
        events = list(running.values()) + ([trainer_busy_until] if trainer_busy_until is not None else [])
        if not events:
            raise RuntimeError("the schedule is stuck (nothing running, nothing to train)")
        t_next = min(events)
        dt = t_next - t
        server_busy += dt if running else 0.0
        trainer_busy += dt if trainer_busy_until is not None else 0.0
        t = t_next
        for gid, end in list(running.items()):
            if end <= t:
                del running[gid]
                adm.finish(gid)
        if trainer_busy_until is not None and trainer_busy_until <= t:
            trainer_busy_until = None
            trainer_step += 1
            version = trainer_step  # the push (its pause is counted as server idle)
            if push_s:
                for gid in running:
                    running[gid] += push_s
                t += push_s
            pushed_at.append(t)
    return SimResult(ages, len(adm.dropped), trained, t, 1 - trainer_busy / t if t else 0.0,
                     1 - server_busy / t if t else 0.0)
