"""The staleness bound: admission control keeps every trained group within k versions, groups are
never split, stragglers move on within the bound or are dropped whole (well under a second)."""

from __future__ import annotations

import pytest

from polar_runtime.loop.staleness import Admission, simulate

UNEVEN = [10.0, 12.0, 30.0, 11.0]  # a straggler every fourth group


@pytest.mark.parametrize("k", [0, 1, 2])
def test_admission_control_holds_the_bound(k: int) -> None:
    r = simulate(k, groups_per_step=2, steps=6, rollout_s=UNEVEN, train_s=15.0, slots=4)
    assert r.trained_groups == 12 and r.dropped == 0
    assert max(r.ages) <= k
    if k:
        assert max(r.ages) == k  # the bound is used, not just respected


def test_without_admission_control_the_bound_breaks() -> None:
    r = simulate(1, groups_per_step=2, steps=6, rollout_s=UNEVEN, train_s=15.0, slots=4, enforce=False)
    assert max(r.ages) > 1


def test_asynchronous_is_faster_and_idles_less_than_synchronous() -> None:
    sync = simulate(0, 2, 6, UNEVEN, 15.0, slots=4)
    one = simulate(1, 2, 6, UNEVEN, 15.0, slots=4)
    assert set(sync.ages) == {0}
    assert one.wall < sync.wall and one.server_idle < sync.server_idle and one.trainer_idle < sync.trainer_idle


def test_a_group_is_never_split_and_a_late_one_moves_within_the_bound_or_is_dropped_whole() -> None:
    a = Admission(k=1, groups_per_step=2)
    g0, g1 = a.admit("a", 0, 0), a.admit("b", 0, 0)
    assert (g0.batch, g1.batch) == (0, 0)
    g2 = a.admit("c", 0, 0)  # batch 1 from v0: age 1, allowed
    assert g2 is not None and g2.batch == 1
    a.admit("d", 0, 0)
    assert not a.can_admit(0, 0)  # batch 2 from v0 would be age 2
    a.finish("a")
    assert a.take_batch(0) is None  # "b" still running: the batch waits, never trains half a group set
    assert a.defer_stragglers(0) == []  # "b" moves to batch 1 (age 1)
    assert a.groups["b"].batch == 1
    assert not a.can_admit(0, 0) and a.next_batch(0) == 2  # batch 0 is closed: its freed slot is not refilled
    a.finish("b"), a.finish("c"), a.finish("d")
    assert [g.gid for g in a.take_batch(0)] == ["a"]  # the closed batch trains with the group that finished
    # batch 1 now holds b, c and d: all three are trained by step 1 (a group is never split)
    assert sorted(g.gid for g in a.take_batch(1)) == ["b", "c", "d"]
    late = Admission(k=0, groups_per_step=1)
    late.admit("x", 0, 0)
    assert late.defer_stragglers(0) == ["x"] and late.dropped == ["x"] and not late.groups
