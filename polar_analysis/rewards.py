"""Rewards and run outcomes per session, from rollout results or a rewards file.

Sources (all keyed by ``session_id``):

- ``<capture_dir>/rollouts.parquet``, written by ``polar rollout``: columns ``task_id``,
  ``sample_index``, ``session_id``, ``group_id``, ``status``, ``reward`` (others ignored). Used
  automatically when present.
- a rewards file given with ``--rewards FILE``: Parquet, JSON Lines (one object per line) or CSV,
  with at least ``session_id`` and ``reward``; optional ``status``, ``task_id``, ``group_id``.

``status`` is normalised to what the trainer understands: ``ok``, ``timeout`` or ``failed``
(``ok``/``success``/``passed``/``completed``/``done`` -> ok; ``timeout``/``timed_out`` -> timeout;
anything else, e.g. ``error`` or ``crashed`` -> failed). A missing status means ``ok``. A session
listed twice keeps its last row. A sample marked ok whose reward is missing (its evaluator timed out
or could not start) becomes ``failed``: the run cannot be judged, so it must not teach anything.
"""

from __future__ import annotations

import io
from pathlib import Path

import polars as pl

ROLLOUTS_FILE = "rollouts.parquet"
_OK = ("ok", "success", "succeeded", "passed", "pass", "completed", "complete", "done", "resolved")
_TIMEOUT = ("timeout", "timed_out", "time_out", "timedout")


def default_rewards_path(capture_dir: str | Path | None) -> Path | None:
    if capture_dir is None:
        return None
    p = Path(capture_dir) / ROLLOUTS_FILE
    return p if p.is_file() else None


def normalize_status(expr: pl.Expr) -> pl.Expr:
    s = expr.cast(pl.String).str.to_lowercase().str.strip_chars()
    return (
        pl.when(s.is_null() | s.is_in(_OK))
        .then(pl.lit("ok"))
        .when(s.is_in(_TIMEOUT))
        .then(pl.lit("timeout"))
        .otherwise(pl.lit("failed"))
    )


def load_rewards(path: str | Path) -> pl.LazyFrame:
    """session_id, reward (f64), status (ok|timeout|failed), task_id, group_id: one row per session."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"rewards file {p} does not exist")
    suffix = p.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".ndjson", ".json", ".csv", ".tsv"):
        raise ValueError(f"rewards file {p}: expected .parquet, .jsonl or .csv")
    # Read once, eagerly: a running rollout replaces rollouts.parquet atomically after every sample,
    # and a lazy scan opens the file again at collect(), reading the new file's pages with the old
    # footer ("page header reported the wrong page size": the asynchronous loop hit it in CI).
    # One open gives a consistent snapshot; a rewards table is one row per sample, small.
    data = io.BytesIO(p.read_bytes())
    if suffix == ".parquet":
        lf = pl.read_parquet(data).lazy()
    elif suffix in (".jsonl", ".ndjson", ".json"):
        lf = pl.read_ndjson(data, infer_schema_length=None).lazy()
    else:
        lf = pl.read_csv(data, separator="\t" if suffix == ".tsv" else ",", infer_schema_length=None).lazy()
    names = lf.collect_schema().names()
    for needed in ("session_id", "reward"):
        if needed not in names:
            raise ValueError(f"rewards file {p} has no {needed!r} column (columns: {names})")
    cols = [
        pl.col("session_id").cast(pl.String),
        pl.col("reward").cast(pl.Float64, strict=False),
        normalize_status(pl.col("status") if "status" in names else pl.lit(None, pl.String)).alias("status"),
        (pl.col("task_id").cast(pl.String) if "task_id" in names else pl.lit(None, pl.String)).alias("task_id"),
        (pl.col("group_id").cast(pl.String) if "group_id" in names else pl.lit(None, pl.String)).alias("group_id"),
    ]
    unjudged = (pl.col("status") == "ok") & pl.col("reward").is_null()
    return (
        lf.select(cols)
        .drop_nulls("session_id")
        .unique("session_id", keep="last", maintain_order=True)
        .with_columns(pl.when(unjudged).then(pl.lit("failed")).otherwise(pl.col("status")).alias("status"))
    )


def resolve(capture_dir: str | Path | None, rewards: str | Path | None) -> pl.LazyFrame | None:
    """The rewards table to use: an explicit file, else the capture's rollouts.parquet, else None."""
    if rewards:
        return load_rewards(rewards)
    default = default_rewards_path(capture_dir)
    return load_rewards(default) if default else None
