"""Trajectory builders, one module per mode (``per_request``, ``prefix_merge``; shared parts in
``common``). ``build`` is the one-call entry point used by the CLI, notebooks and the demo."""

from __future__ import annotations

from typing import Any

MODES = ("per-request", "prefix-merge")


def build(calls_lf: Any, mode: str = "prefix-merge", *, strict: bool = False, template: Any = None, rewards: Any = None,
          tokenizer_fingerprint: str | None = None):
    """(trajectory DataFrame, BuildStats) for a calls frame; ``rewards`` is a table from
    ``polar_analysis.rewards.load_rewards`` / ``resolve`` (or None); ``tokenizer_fingerprint``
    (``polar_core.tokenizer_identity``) is stamped on every sequence for the trainer to check."""
    from polar_analysis.trajectories import common, per_request, prefix_merge

    if mode == "per-request":
        df, stats = per_request.build(calls_lf)
    elif mode == "prefix-merge":
        df, stats = prefix_merge.build(calls_lf, strict=strict, template=template)
    else:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    return common.stamp_tokenizer(common.attach_rewards(df, rewards), tokenizer_fingerprint), stats
