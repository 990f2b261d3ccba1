"""Where a GRPO step's credit went, per answer token, and how each task's answer moved after it.

Issue 41's trivia controls learned "answer yes" across yes/no questions, even on training questions
whose answer is "no". This reads why from a loop's run directory, with nothing re-derived: the
trajectories of step N (the ids and served logprobs the loop trained on), their advantages computed
by the trainer's own ``training.advantages.compute_advantages`` with the loop's settings, and the
trajectories of step N+1 (the same tasks sampled by the updated policy).

For every sample, its *answer token* is the first sampled token of its last sampled span (the final
answer's first token: for a one-call trivia answer, "yes", "Yes", "no", ...). Then:

* **credit** of a token: the sum of the advantages of the samples whose answer starts with it, per
  task and pooled over every group of the step. GRPO pushes a token up in proportion to that sum
  (token-mean aggregation, the loss's default); the pooled sum is what the update sees when the
  contexts are alike (a 1,390-token harness prompt that differs in a 10-token question).
* **move** of a token in a task: its served first-token logprob at step N+1 minus at step N, where
  the task sampled it in both steps (same task, same prompt: the logprob is the context's, whichever
  sample carries it).
* **which credit predicts the move**: for each (task, token) with a move and a non-zero credit, does
  the sign of the task's own credit match the sign of the move, and does the sign of the pooled
  credit? If the update followed each question, the task's own credit would predict it; if it
  followed the surface form across questions, the pooled one does.

    .venv/bin/python benchmarks/answer_credit.py runs/transfer-trivia-balanced-seed0 --step 0 \
        --json benchmarks/results/transfer_answer_credit_trivia-balanced_seed0.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polar_core.paths import model_dir_for  # noqa: E402
from training.advantages import compute_advantages  # noqa: E402
from training.config import AdvantageConfig  # noqa: E402


def answers(traj: pl.DataFrame) -> pl.DataFrame:
    """One row per sequence: task_id, group_id, session_id, the answer token (first sampled id of
    the last sampled span) and its served logprob, the answer's sampled ids."""
    rows: dict[str, list[Any]] = defaultdict(list)
    for r in traj.iter_rows(named=True):
        spans = [(s, e) for s, e, k in zip(r["span_start"], r["span_end"], r["span_kind"]) if k == "sampled" and e > s]
        if not spans:
            continue
        start, end = spans[-1]
        rows["task_id"].append(r["task_id"])
        rows["group_id"].append(r["group_id"])
        rows["session_id"].append(r["session_id"])
        rows["token"].append(int(r["input_ids"][start]))
        rows["logprob"].append(float(r["logprobs"][start]))
        rows["answer_ids"].append([int(i) for i in r["input_ids"][start:end]])
    schema = {"task_id": pl.String, "group_id": pl.String, "session_id": pl.String, "token": pl.Int64,
              "logprob": pl.Float64, "answer_ids": pl.List(pl.Int64)}
    return pl.DataFrame(dict(rows), schema=schema)


def credit(traj: pl.DataFrame, cfg: AdvantageConfig | None = None) -> pl.DataFrame:
    """Per (task, answer token): samples, their summed advantage (the trainer's), the served logprob."""
    cfg = cfg or AdvantageConfig(drop_zero_variance=True)  # as the loop trains (polar_runtime.loop.phases)
    adv = compute_advantages(traj, cfg).select("session_id", "advantage").unique("session_id")
    a = answers(traj).join(adv, on="session_id", how="left").with_columns(pl.col("advantage").fill_null(0.0))
    return (a.group_by("task_id", "token", maintain_order=True)
            .agg(pl.len().alias("samples"), pl.col("advantage").sum().alias("credit"),
                 pl.col("logprob").mean().alias("logprob"))
            .sort("task_id", "token"))


def moves(before: pl.DataFrame, after: pl.DataFrame, cfg: AdvantageConfig | None = None) -> dict[str, Any]:
    """Credit at step N, pooled and per task, against each (task, token)'s logprob move to step N+1."""
    c = credit(before, cfg)
    pooled = c.group_by("token").agg(pl.col("credit").sum().alias("pooled_credit"), pl.col("samples").sum())
    later = answers(after).group_by("task_id", "token").agg(pl.col("logprob").mean().alias("logprob_after"))
    table = (c.join(pooled.select("token", "pooled_credit"), on="token", how="left")
             .join(later, on=["task_id", "token"], how="left")
             .with_columns((pl.col("logprob_after") - pl.col("logprob")).alias("move")))
    judged = table.filter(pl.col("move").is_not_null() & (pl.col("move").abs() > 1e-3))
    own = judged.filter(pl.col("credit").abs() > 1e-9)
    pool = judged.filter(pl.col("pooled_credit").abs() > 1e-9)
    # the cases where the two disagree in sign decide between the explanations
    split = judged.filter((pl.col("credit").abs() > 1e-9) & (np.sign(pl.col("credit")) != np.sign(pl.col("pooled_credit"))))

    def agree(df: pl.DataFrame, col: str) -> dict[str, int]:
        hits = int((np.sign(df[col].to_numpy()) == np.sign(df["move"].to_numpy())).sum()) if df.height else 0
        return {"agree": hits, "of": df.height}

    return {
        "table": table.to_dicts(),
        "pooled": pooled.sort("pooled_credit", descending=True).to_dicts(),
        "own_credit_predicts_move": agree(own, "credit"),
        "pooled_credit_predicts_move": agree(pool, "pooled_credit"),
        "where_they_disagree": {"own": agree(split, "credit"), "pooled": agree(split, "pooled_credit")},
    }


def model_dir(run: Path) -> Path:
    """The loop's model directory (its tokenizer decodes the answer tokens), as the loop found it."""
    name = tomllib.loads((run / "loop.toml").read_text())["model"]["name"]
    found = model_dir_for(name)
    if found is None:
        raise SystemExit(f"no built model directory for {name!r} (polar serve builds it)")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a polar loop run directory (trajectories/step-N.parquet)")
    ap.add_argument("--step", type=int, default=0, help="the step whose credit is read; its move is to step+1")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)
    paths = [a.run / "trajectories" / f"step-{a.step + k}.parquet" for k in (0, 1)]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        ap.error(f"missing: {', '.join(missing)}")
    res = moves(*(pl.read_parquet(p) for p in paths))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir(a.run))
    for row in res["table"] + res["pooled"]:
        row["text"] = tok.decode([row["token"]])
    print(f"{'task':<16}{'token':<10}{'samples':>8}{'credit':>9}{'pooled':>9}{'lp N':>8}{'lp N+1':>8}{'move':>8}")
    for r in res["table"]:
        after = "" if r["logprob_after"] is None else f"{r['logprob_after']:8.2f}"
        move = "" if r["move"] is None else f"{r['move']:+8.2f}"
        print(f"{r['task_id']:<16}{r['text']!r:<10}{r['samples']:>8}{r['credit']:>+9.2f}{r['pooled_credit']:>+9.2f}"
              f"{r['logprob']:8.2f}{after:>8}{move:>8}")
    print("pooled credit per answer token: " + ", ".join(f"{r['text']!r} {r['pooled_credit']:+.2f} ({r['samples']})"
                                                         for r in res["pooled"]))
    for key in ("own_credit_predicts_move", "pooled_credit_predicts_move"):
        print(f"{key}: {res[key]['agree']} of {res[key]['of']}")
    d = res["where_they_disagree"]
    print(f"where own and pooled credit disagree in sign: own right {d['own']['agree']} of {d['own']['of']}, "
          f"pooled right {d['pooled']['agree']} of {d['pooled']['of']}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"run": str(a.run), "step": a.step, **res}, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
