"""Copy one rollout step of a real ``polar demo`` run into a small test fixture.

    .venv/bin/python scripts/make_run_fixture.py runs/iter4 tests/fixtures/demo-run-exact --step 0

Copies what a test needs to rebuild that step's trajectories and compare them with what the run
trained on, nothing else (no checkpoints, no flows, no work directories):

- ``captures/sessions/*.st<step>.*.jsonl``: the step's capture records, unchanged;
- ``captures/rollouts.parquet``: the step's rollout results (status, reward);
- ``trajectories/step-<step>.parquet``: the trajectories the demo built from them and trained on;
- ``report.json``: the demo's report, when the run has finished (its ``steps[step]`` holds the
  step's trajectory statistics);
- ``train/metrics.jsonl``: the first optimizer step's metrics of the GRPO step trained on this
  rollout step, and ``train/config.json``: that run's trainer configuration (from the checkpoint's
  trainer state), so a test replays it with the same settings.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def trained_on(train: Path, step: int) -> tuple[dict, dict]:
    """The metrics and configuration of the GRPO step trained on rollout ``step``: the checkpoint
    whose ``trajectories`` is that step's file."""
    import torch

    for ckpt in sorted(train.glob("step-*")):
        meta = json.loads((ckpt / "polar_checkpoint.json").read_text())
        if any(Path(t).name == f"step-{step}.parquet" for t in meta.get("trajectories", [])):
            break
    else:
        raise SystemExit(f"no checkpoint under {train} was trained on rollout step {step}")
    rows = [json.loads(line) for line in (train / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = next(r for r in rows if r["step"] == meta["step"])
    if "config" in meta:
        return metrics, meta["config"]
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", mmap=True, weights_only=False)
    return metrics, state["config"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--step", type=int, default=0)
    a = ap.parse_args()
    import polars as pl

    run, out, step = a.run.resolve(), a.out.resolve(), a.step
    sessions = sorted((run / "captures" / "sessions").glob(f"*.st{step}.*.jsonl"))
    if not sessions:
        raise SystemExit(f"no capture records of step {step} under {run}/captures/sessions")
    if out.exists():
        shutil.rmtree(out)
    (out / "captures" / "sessions").mkdir(parents=True)
    (out / "train").mkdir()
    for p in sessions:
        shutil.copy2(p, out / "captures" / "sessions" / p.name)
    rollouts = pl.read_parquet(run / "captures" / "rollouts.parquet").filter(pl.col("step") == step)
    rollouts.write_parquet(out / "captures" / "rollouts.parquet")
    (out / "trajectories").mkdir()
    shutil.copy2(run / "trajectories" / f"step-{step}.parquet", out / "trajectories" / f"step-{step}.parquet")
    if (run / "report.json").exists():
        shutil.copy2(run / "report.json", out / "report.json")
    metrics, config = trained_on(run / "train", step)
    (out / "train" / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    (out / "train" / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(sessions)} sessions, {rollouts.height} rollouts -> {out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
