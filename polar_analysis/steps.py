"""Which rollout step a captured call belongs to, and which policy versions served a step.

The rollout runner names each sample's session ``<task>.st<step>.s<sample>`` (``polar_runtime/rollout.py``),
so a call's step is read from its session id, never from a report. What ``scripts/check_demo.py``
(the pushed version on the next step's calls) and ``polar certify`` (policy delivery: every call
after a push carries the new version) both read.
"""

from __future__ import annotations

import polars as pl

#: a call's rollout step, from its session id (null for sessions the runner did not name)
STEP_OF = pl.col("session_id").str.extract(r"\.st(\d+)\.").cast(pl.Int64)


def calls_per_step(calls: pl.DataFrame) -> dict[int, int]:
    """Captured calls per rollout step (``calls``: a collected calls frame)."""
    return {k: v for k, v in calls.group_by(STEP_OF.alias("step")).len().iter_rows() if k is not None}


def versions_of_step(calls: pl.DataFrame, step: int) -> list[int | None]:
    """The ``policy_version`` of every call of rollout step ``step``, in capture order."""
    return calls.filter(STEP_OF == step)["policy_version"].to_list()
