"""What the trainer saw, token by token: ``<train out>/tokens/step-NNNNNN.parquet`` per rollout batch.

For every sampled token it trains (loss mask 1), the trainer writes the behaviour logprob vLLM
returned, its own logprob of the same token, the advantage and the token's weight in the loss.
``polar view`` shows them next to each other (hover a token), and ``polar certify``'s logprob
check can read the same numbers instead of recomputing them. One file per :meth:`GRPOTrainer.fit`
call (one rollout batch), named after the first optimizer step that batch makes (the ``step`` of
its first row in ``metrics.jsonl``, and of the checkpoint ``step-NNNNNN`` it leads to).

Columns (one row per trained token):

==================  =======  ====================================================================
``step``            int64    the optimizer step that trained the token (its mini-batch's)
``trajectory_id``   str      the sequence (trajectories/step-K.parquet's ``trajectory_id``)
``session_id``      str      the sample
``position``        int32    index of the token in the sequence's ``input_ids``
``token_id``        int32    the token
``behaviour_logprob`` f32    vLLM's logprob when it sampled the token (the trajectory's ``logprobs``)
``trainer_logprob`` float32  the trainer's logprob of it before this batch's first update, under the
                             weights that served it when the run is on-policy (``old_logp`` when
                             computed, else the first forward of its mini-batch)
``advantage``       float32  the sample's advantage, as trained
``loss_weight``     float64  the token's aggregation weight in its mini-batch's loss
==================  =======  ====================================================================

A token of the sequence that is not in the file was not trained: its loss mask is 0 (prompt,
tool results, template glue: the trajectory's spans say which) or its sequence was left out;
``step-NNNNNN.json`` beside the Parquet names those sequences and why (``zero_variance``: the
group's rewards were all equal; ``stale``: older than ``max_staleness``; ``not_recorded``: over
the size bound below).

Size bound: at most :data:`MAX_SEQUENCES` sequences per batch (chosen by a hash of the
trajectory id, so every rank of a sharded run picks the same ones and a rerun picks them again),
and only the newest :data:`KEEP_FILES` batches are kept. A row costs ~12 bytes in Parquet (the
demo-run-exact step: 511 tokens in 6.3 kB); 256 sequences of 4,096 sampled tokens are ~12 MB per
batch, 50 batches ~0.6 GB at most. Under ``torchrun`` each rank writes the tokens of its own bins
(``step-NNNNNN.rank-R.parquet``).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

#: sequences recorded per rollout batch (the rest are named in the JSON as ``not_recorded``)
MAX_SEQUENCES = 256
#: batches kept (older files are removed when a new one is written)
KEEP_FILES = 50
TOKENS_DIR = "tokens"


def file_stem(step: int) -> str:
    return f"step-{step:06d}"


def _pick(ids: list[str], limit: int) -> set[str]:
    """The ``limit`` ids with the smallest CRC-32: stable across processes (unlike ``hash``)."""
    if len(ids) <= limit:
        return set(ids)
    return set(sorted(ids, key=lambda t: (zlib.crc32(t.encode()), t))[:limit])


class TokenRecorder:
    """Collects the trained tokens of one rollout batch while :meth:`GRPOTrainer.fit` runs."""

    def __init__(self, out: str | os.PathLike, rank: int = 0, world: int = 1,
                 max_sequences: int = MAX_SEQUENCES, keep_files: int = KEEP_FILES) -> None:
        self.dir = Path(out) / TOKENS_DIR
        self.rank, self.world = rank, world
        self.max_sequences, self.keep_files = max_sequences, keep_files
        self.active = False
        self._rows: dict[str, list[Any]] = {}
        self._keep: set[str] = set()
        self._first_step = 0
        self._left_out: dict[str, str] = {}
        self._sessions: dict[str, str] = {}

    def begin(self, prep: Any, first_step: int) -> None:
        """A new batch: ``prep`` is the trainer's :class:`Prepared`, ``first_step`` the step it makes first."""
        ids = prep.frame["trajectory_id"].to_list() if "trajectory_id" in prep.frame.columns else []
        sessions = prep.frame["session_id"].to_list() if "session_id" in prep.frame.columns else [""] * len(ids)
        self._sessions = dict(zip(ids, sessions))
        self._keep = _pick(ids, self.max_sequences)
        self._left_out = dict(getattr(prep, "left_out", {}) or {})
        self._left_out.update({t: "not_recorded" for t in ids if t not in self._keep})
        self._first_step = first_step
        self._rows = {k: [] for k in ("step", "trajectory_id", "session_id", "position", "token_id", "behaviour_logprob",
                                      "trainer_logprob", "advantage", "loss_weight")}
        self.active = True

    def add(self, mb: Any, trainer_logp: Any, step: int) -> None:
        """The tokens of one micro-batch; ``trainer_logp`` [K] is the trainer's logprob of each."""
        if not self.active or mb.is_padding or mb.seq_ids is None or mb.target_positions is None:
            return
        seq = mb.seq_index.tolist()
        tids = [mb.seq_ids[k] for k in seq]
        keep = [i for i, t in enumerate(tids) if t in self._keep]
        if not keep:
            return
        cols = {
            "position": mb.target_positions.tolist(), "token_id": mb.target_ids.tolist(),
            "behaviour_logprob": mb.behaviour_logp.float().tolist(), "trainer_logprob": trainer_logp.detach().float().cpu().tolist(),
            "advantage": mb.advantages.float().tolist(), "loss_weight": mb.weights.double().tolist(),
        }
        r = self._rows
        for i in keep:
            r["step"].append(step)
            r["trajectory_id"].append(tids[i])
            r["session_id"].append(self._sessions.get(tids[i], ""))
            for k, v in cols.items():
                r[k].append(v[i])

    def finish(self) -> Path | None:
        """Write the batch's file (nothing when no step was taken); returns its path."""
        if not self.active:
            return None
        self.active = False
        import polars as pl

        self.dir.mkdir(parents=True, exist_ok=True)
        stem = file_stem(self._first_step)
        suffix = f".rank-{self.rank}" if self.world > 1 else ""
        frame = pl.DataFrame(self._rows, schema={
            "step": pl.Int64, "trajectory_id": pl.String, "session_id": pl.String, "position": pl.Int32,
            "token_id": pl.Int32, "behaviour_logprob": pl.Float32, "trainer_logprob": pl.Float32,
            "advantage": pl.Float32, "loss_weight": pl.Float64})
        target = self.dir / f"{stem}{suffix}.parquet"
        tmp = target.with_name(f".{target.name}.tmp")
        frame.write_parquet(tmp)
        tmp.replace(target)
        if self.rank == 0:
            meta = {"step": self._first_step, "tokens": frame.height, "sequences_recorded": len(self._keep),
                    "left_out": self._left_out, "bound": {"max_sequences": self.max_sequences, "keep_files": self.keep_files}}
            tmp = self.dir / f".{stem}.json.tmp"
            tmp.write_text(json.dumps(meta, indent=1))
            tmp.replace(self.dir / f"{stem}.json")
        self._prune()
        self._rows = {}
        return target

    def _prune(self) -> None:
        stems = sorted({p.name.split(".")[0] for p in self.dir.glob("step-*.parquet")})
        for old in stems[: max(0, len(stems) - self.keep_files)]:
            for p in self.dir.glob(f"{old}.*"):
                if self.rank == 0 or p.name.endswith(f".rank-{self.rank}.parquet"):
                    p.unlink(missing_ok=True)


def read_tokens(train_dir: str | os.PathLike, step: int | None = None) -> Any:
    """The recorded tokens of a run's trainer directory as one Polars frame (every kept batch, or
    the one whose first step is ``step``); empty when none were recorded."""
    import polars as pl

    d = Path(train_dir) / TOKENS_DIR
    pattern = f"{file_stem(step)}*.parquet" if step is not None else "step-*.parquet"
    files = sorted(d.glob(pattern)) if d.is_dir() else []
    return pl.concat([pl.read_parquet(f) for f in files]) if files else pl.DataFrame()


def gap_of(tokens: Any) -> dict[str, float]:
    """``behaviour_gap``'s figures from a recorded batch (``tokens``: :func:`read_tokens`' frame):
    ``tokens``, ``mismatch_kl`` (mean of vLLM's logprob minus the trainer's) and ``max_abs_gap``,
    over the trained tokens (zero-variance groups are not trained, so not in the record)."""
    import polars as pl

    if tokens is None or not tokens.height:
        return {"tokens": 0.0, "mismatch_kl": float("nan"), "max_abs_gap": float("nan")}
    gap = (pl.col("behaviour_logprob").cast(pl.Float64) - pl.col("trainer_logprob").cast(pl.Float64))
    row = tokens.select(gap.mean().alias("m"), gap.abs().max().alias("x")).row(0)
    return {"tokens": float(tokens.height), "mismatch_kl": float(row[0]), "max_abs_gap": float(row[1])}
