"""Per-request trajectories: every usable call is its own sequence (prompt ids, then sampled ids).

The simplest faithful reconstruction: the sequence is exactly what the model saw and sampled, so
nothing depends on how the harness re-renders history. It costs one trainer sequence per call
(and recomputes the shared prefix every time), which is what prefix merging saves.
"""

from __future__ import annotations

import polars as pl

from polar_analysis.trajectories.common import (
    BuildStats,
    Sequence,
    by_session,
    collect_calls,
    count_skipped,
    sequences_frame,
)


def build(calls_lf: pl.LazyFrame) -> tuple[pl.DataFrame, BuildStats]:
    stats = BuildStats(mode="per-request")
    seqs: list[Sequence] = []
    calls = collect_calls(calls_lf)
    stats.calls = len(calls)
    for session_id, session_calls in by_session(calls):
        stats.sessions += 1
        n = 0
        for call in session_calls:
            if count_skipped(call, stats):
                continue
            seq = Sequence(session_id=session_id, chain_index=0, segment_index=n)
            seq.start(call)
            seqs.append(seq)
            n += 1
        stats.chains += 1 if n else 0
    return sequences_frame(seqs, stats), stats
