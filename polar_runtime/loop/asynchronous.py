"""Asynchronous rollouts: groups keep running while the trainer steps, at most k versions stale.

``schedule.max_off_policy_steps = k > 0``. Why: in the synchronous loop vLLM waits for every
training step and the trainer waits for every rollout (the slowest sample of a step holds both).
Here the trainer trains batch b while the groups of batches b+1 .. b+k are already rolling out.

The schedule (``staleness.Admission``, its rules documented there):

- batch b is trained by training step b; a group is started only when the batch it lands in is at
  most k batches ahead of the trainer (admission control: nothing started can come out too old,
  so no finished work is thrown away for age). Versions count in training steps; a step that makes
  no update does not advance the served version, so real ages are never above the admitted ones;
- a group belongs to one batch, all of its samples (a GRPO group is never split);
- a straggler: when the trainer waits for batch b and batch b+1 is complete, the unfinished groups
  of b move to b+1 if that keeps them within k, else they are dropped whole and counted; b then
  trains with the groups that finished (it is *closed*);
- every trained token's age is measured, not assumed: ``placement.sample_versions`` reads the
  policy_version the proxy recorded on each captured call; a trained group older than k stops the
  run (it would be a bug of admission control, and the bound is the promise of this mode);
- a push holds the proxy's gate only for the swap (``training/weights_push.py``: calls in flight
  finish, new ones wait, weights are reloaded, the gate reopens under the new version); groups in
  flight simply continue under the new version.

At most ``schedule.groups_in_flight`` groups run at once (0: ``groups_per_step``). Resume: the
admitted groups are in the state file (``schedule``); they run again in their batches and the
placement returns their finished samples without running them again.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from .groups import LoopError, groups_for, reward_summary, sample_versions_of
from .staleness import Admission

if TYPE_CHECKING:
    from .loop import Run


def _groups_per_batch(run: "Run", ids: list[str]) -> int:
    return len(groups_for(0, ids, run.cfg.rollout.groups_per_step))


def run_async(run: "Run", ids: list[str]) -> None:
    """Train batches ``state.next_step`` .. ``iterations - 1`` with rollouts running alongside; the
    final measuring rollout (step ``iterations``) is left to the synchronous path."""
    cfg, placement, state, log = run.cfg, run.placement, run.state, run.log
    k = cfg.schedule.max_off_policy_steps
    iterations = cfg.rollout.iterations
    gps = _groups_per_batch(run, ids)
    slots = cfg.schedule.groups_in_flight or gps
    adm = Admission(k, gps)
    adm.restore(state.schedule)
    taking = [t for t in state.schedule.get("taking", []) if int(t["batch"]) == state.next_step]
    if taking:  # killed while its batch trained: the batch is taken again, whole (its samples are stored)
        adm.restore({"groups": adm.to_dict()["groups"] + taking, "dropped": adm.dropped,
                     "closed": sorted(adm.closed | {state.next_step})})
    meta: dict[str, dict[str, Any]] = dict(state.schedule.get("meta", {}))  # gid -> {task, label}
    started: dict[str, int] = dict(state.schedule.get("started", {}))  # batch -> its own groups started
    dropped_at: dict[str, list[str]] = dict(state.schedule.get("dropped_at", {}))  # batch -> groups dropped
    done_q: "queue.Queue[tuple[str, Any, BaseException | None]]" = queue.Queue()
    running: set[str] = set()
    rows_of: dict[str, list[dict[str, Any]]] = {}
    restore = sorted(adm.groups, key=lambda g: (adm.groups[g].batch, g))
    if restore:
        log(f"resuming {len(restore)} admitted group(s): {', '.join(restore)}")

    def save(taken: list[dict[str, Any]] | None = None) -> None:
        state.schedule = {**adm.to_dict(), "meta": meta, "started": started, "dropped_at": dropped_at,
                          "taking": taken or []}
        run.save()

    def worker(gid: str, task: str, label: int, version: int) -> None:
        run.meter.rollout_started()
        try:
            done_q.put((gid, placement.rollout_group(label, task, version), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread, which raises it
            done_q.put((gid, None, exc))
        finally:
            run.meter.rollout_ended()

    def launch(gid: str) -> None:
        m = meta[gid]
        running.add(gid)
        threading.Thread(target=worker, args=(gid, m["task"], int(m["label"]), state.policy_version),
                         name=f"loop-group-{gid}", daemon=True).start()

    def admit_more() -> None:
        b = state.next_step
        while len(running) < slots:
            if restore:
                launch(restore.pop(0))
                continue
            nb = adm.next_batch(b)
            # versions in training steps: the served policy is the one after step b-1 (the push is
            # done before the trainer moves on), i.e. "b" in the Admission's terms
            if nb >= iterations or not adm.can_admit(b, b):
                return
            tasks = groups_for(nb, ids, cfg.rollout.groups_per_step)
            i = started.get(str(nb), 0)
            if i >= len(tasks):  # cannot happen (a batch with a free slot has an own task left): stop admitting
                return
            task = tasks[i]
            gid = f"{task}@b{nb}"
            adm.admit(gid, b, b)
            meta[gid] = {"task": task, "label": nb}
            started[str(nb)] = i + 1
            save()
            launch(gid)

    save()
    while state.next_step < iterations:
        b = state.next_step
        admit_more()
        batch = adm.take_batch(b)
        if batch is not None:
            t_step = time.monotonic()
            gids = sorted(g.gid for g in batch)
            rows = [r for g in gids for r in rows_of.pop(g)]
            # until the step is recorded finished, the state file keeps the batch (resume takes it again)
            save([{"gid": g.gid, "version": g.version, "batch": b} for g in batch])
            if not rows:
                rec = {"step": b, "policy_version": state.policy_version, "groups": gids, "rewards": reward_summary(rows),
                       "train": None, "push": None, "dropped": list(dropped_at.get(str(b), [])),
                       "note": ("every group of this batch was dropped" if dropped_at.get(str(b)) else
                                "no group left: its stragglers moved to the next batch (within the bound)")}
                run.finish(rec, b, t_step)
                save()
                continue
            versions = placement.sample_versions(rows)
            v = state.policy_version
            oldest = {g: min((min(versions.get(r["session_id"]) or {v: 0}) for r in rows if r.get("_gid") == g),
                             default=v) for g in gids}
            worst = max(v - o for o in oldest.values())
            if worst > k:
                raise LoopError(f"batch {b}: a trained group is {worst} versions behind the policy v{v}, over "
                                f"max_off_policy_steps = {k} (groups' oldest versions: {oldest}); admission control failed")
            rec = {"step": b, "policy_version": v, "groups": gids, "rewards": reward_summary(rows),
                   "sample_versions": sample_versions_of(rows, versions, v), "group_ages": {g: v - o for g, o in oldest.items()},
                   "train": None, "push": None, "note": None, "dropped": list(dropped_at.get(str(b), []))}
            for r in rows:
                r.pop("_gid", None)
            run.learn(b, rows, rec, t_step, versions)
            for g in gids:
                meta.pop(g, None)
            save()
            continue
        nxt = [g for g in adm.groups.values() if g.batch == b + 1]
        late = [g for g in adm.groups.values() if g.batch == b and not g.done]
        if late and nxt and len(nxt) >= gps and all(g.done for g in nxt):
            dropped = adm.defer_stragglers(b)
            moved = [g.gid for g in late if g.gid not in dropped]
            if dropped:
                run.dropped_total += len(dropped)
                dropped_at.setdefault(str(b), []).extend(dropped)
                cancel = getattr(placement, "cancel_group", None)
                for gid in dropped:
                    m = meta.pop(gid)
                    if cancel is not None:
                        cancel(int(m["label"]), m["task"])
            log(f"batch {b}: straggler(s) {', '.join(moved) or '-'} moved to batch {b + 1}, "
                f"{', '.join(dropped) or 'none'} dropped whole (over the bound of {k})")
            save()
            continue
        if not running:
            raise LoopError(f"the schedule is stuck at batch {b}: nothing running, nothing to train")
        gid, rows, exc = done_q.get()
        running.discard(gid)
        if exc is not None:
            raise exc
        if gid in adm.groups:  # a dropped group's late result is not trained on
            for r in rows:
                r["_gid"] = gid
            rows_of[gid] = rows
            adm.finish(gid)
    # what is still running was dropped: its results are not needed
