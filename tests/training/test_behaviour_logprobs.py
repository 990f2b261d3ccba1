"""The trainer's logprobs against vLLM's, on two real captures of ``polar demo`` (Pi +
Qwen2.5-Coder-0.5B): ``demo-run`` (recorded without exact history) and ``demo-run-exact`` (recorded
with it, the default since issue 14), both in tests/fixtures.

The step-0 trajectories are rebuilt from the committed capture records with today's builder, as the
demo builds them (prefix merging, the 0.5B's template facts, rewards attached), and the trainer's
own code computes what it reports: its logprobs before the update (``fill_old_logprobs``) and the
``mismatch_kl`` of ``grpo_token_loss`` / ``Accumulated.metrics``. Where a token is trained in the
context it was sampled in, the float32 trainer must reproduce vLLM's (float32, CPU) logprob; the
``mismatch_kl`` must be the one the recorded run reported (train/metrics.jsonl).

``demo-run`` was recorded without exact history: every merge is ``content_changed`` (Pi re-sent
each answer as text, re-rendered to other ids), so later turns were sampled after another rendering
of the history than the merged sequence holds, and their logprobs differ (mismatch_kl 0.14). That
known gap is a strict expected failure on that capture, and the same tests must pass on
``demo-run-exact``, where every call after the first of a session had its history spliced from
the ids the model sampled (``history == "exact"``), so every sampled token is in its own context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest
import torch

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RUNS = ("demo-run", "demo-run-exact")
TOL = 1e-3  # nats, per token: float32 trainer vs float32 vLLM on CPU (measured: ~1e-5)


def _step0_records(run: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((run / "captures" / "sessions").glob("*.st0.*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]


def exact_history(run: Path) -> bool:
    """Sampled with exact history: every call after the first of its session had its history
    spliced from the ids the model sampled. (``demo-run`` has no ``history`` field at all.)"""
    return all(r.get("history") == "exact" for r in _step0_records(run) if r["call_index"] > 0)


@pytest.fixture(scope="module", params=RUNS)
def run(request) -> Path:
    return FIXTURES / request.param


@dataclass
class Measured:
    frame: pl.DataFrame  # the rebuilt trajectories, in the trainer's (prepared) row order
    stats: dict
    trainer: list[torch.Tensor]  # per row: the trainer's logprob of each sampled token
    vllm: list[torch.Tensor]  # per row: vLLM's (the captured behaviour logprobs)
    metrics: dict[str, float]  # Accumulated.metrics() over the whole batch


@pytest.fixture(scope="module")
def rebuilt(run, qwen05_dir, tmp_path_factory):
    """Step 0's trajectories rebuilt from the committed captures, as ``polar demo`` builds them."""
    from polar_analysis import alignment, frames, rewards
    from polar_analysis.trajectories import common, prefix_merge

    records = _step0_records(run)
    sids = sorted({r["session_id"] for r in records})
    lf = frames.calls(run / "captures", cache_dir=tmp_path_factory.mktemp("frames-cache"), rewards=None).filter(
        pl.col("session_id").is_in(sids))
    template = alignment.template_info_for(alignment.get_renderer(qwen05_dir), lf)
    df, stats = prefix_merge.build(lf, template=template)
    table = rewards.load_rewards(run / "captures" / rewards.ROLLOUTS_FILE).filter(pl.col("session_id").is_in(sids))
    df = common.attach_rewards(df, table)
    if all("sampling" not in r for r in records):
        # Recorded before capture records carried the effective sampling (schema 1), so today's
        # builder flags every sequence. The requests carried no sampling fields and the 0.5B's
        # generation_config.json sets none, so vLLM sampled plainly at T=1 (top-k/top-p off): what
        # the recorded run's trainer assumed for its frame without sampling columns. The per-token
        # checks below (1e-3 on every token sampled in its own context) would fail under any other
        # distribution.
        assert df["sampling_issue"].str.contains("captured before schema version 2").all()
        df = df.with_columns(temperature=pl.lit(1.0), top_k=pl.lit(0, pl.Int32), top_p=pl.lit(1.0),
                             sampling_issue=pl.lit(None, pl.String))
    else:  # the proxy enforced plain sampling at T=1 on every call, and the records say so
        assert df["sampling_issue"].is_null().all()
        assert {(r["sampling"]["temperature"], r["sampling"]["top_k"], r["sampling"]["top_p"]) for r in records} == {
            (1.0, 0, 1.0)}
    return df, stats.as_dict() | {"coverage": stats.coverage}


def _train_config(run: Path) -> dict:
    """The recorded run's trainer settings that decide which rows it trained on."""
    path = run / "train" / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="module")
def measured(run, qwen05_dir, rebuilt) -> Measured:
    """One no-grad pass of the 0.5B (float32) over every rebuilt sequence, through the trainer's code
    with the recorded run's settings (lr 1e-6, token budget 8192). KL is off: it does not enter
    mismatch_kl. Rows of groups the recorded run dropped (all alike in reward) are not measured."""
    from polar_training.loss import grpo_token_loss
    from polar_training.trainer import Accumulated, GRPOTrainer, TrainConfig, load_model

    frame, stats = rebuilt
    cfg = TrainConfig(lr=1e-6, token_budget=_train_config(run).get("token_budget", 8192))
    cfg.loss.kl_coef = 0.0
    # The rows the recorded run trained on, as it chose them: demo-run (before the setting existed)
    # trained on every group; demo-run-exact dropped the groups whose rewards were all alike, and
    # measuring only its trained rows (6.3k of 18.6k tokens) takes ~1/3 of the time (352 s -> CI).
    cfg.adv.drop_zero_variance = _train_config(run).get("adv", {}).get("drop_zero_variance", False)
    torch.manual_seed(0)
    trainer = GRPOTrainer(load_model(str(qwen05_dir), "float32"), cfg)
    prep = trainer.prepare(frame)
    assert len(prep.minibatches) == 1  # num_minibatches 1: seq_index is the row of prep.frame
    acc = Accumulated()
    seq, trainer_lp, vllm_lp = [], [], []
    for mb in prep.minibatches[0]:
        trainer.fill_old_logprobs([mb])
        # The first update's statistics: logp == old_logp (no optimizer step has been taken yet).
        acc.add(grpo_token_loss(mb.old_logp, mb.behaviour_logp, mb.advantages, mb.weights, cfg.loss,
                                old_logp=mb.old_logp), None, mb.n_tokens)
        seq.append(mb.seq_index)
        trainer_lp.append(mb.old_logp.float())
        vllm_lp.append(mb.behaviour_logp.float())
    acc.reduce()
    seq, trainer_all, vllm_all = torch.cat(seq), torch.cat(trainer_lp), torch.cat(vllm_lp)
    rows = range(prep.frame.height)  # tokens of one sequence stay in order inside its bin
    return Measured(prep.frame, stats, [trainer_all[seq == i] for i in rows], [vllm_all[seq == i] for i in rows],
                    acc.metrics())


def _sampled_spans(row: dict) -> list[tuple[int, int]]:
    """(call index, number of sampled tokens) of each sampled span, in sequence order."""
    return [(c, e - s) for c, s, e, kind in zip(row["span_call_index"], row["span_start"], row["span_end"],
                                                row["span_kind"]) if kind == "sampled"]


def test_rebuilt_trajectories_are_what_the_run_trained_on(run, rebuilt):
    """The rebuild from the captures gives the batch the recorded run built and trained on (its
    trajectories/step-0.parquet, and its report's step-0 statistics where the run finished)."""
    frame, stats = rebuilt
    assert stats["coverage"] == 1.0
    written = pl.read_parquet(run / "trajectories" / "step-0.parquet").sort("trajectory_id")
    ours = frame.sort("trajectory_id")
    assert ours["trajectory_id"].to_list() == written["trajectory_id"].to_list()
    for col in ("input_ids", "loss_mask", "reward"):
        assert ours[col].to_list() == written[col].to_list(), col
    if (run / "report.json").exists():
        report = json.loads((run / "report.json").read_text())["steps"][0]["trajectories"]
        for key in ("calls", "sessions", "sequences", "merges", "breaks", "sampled_tokens", "covered_tokens",
                    "sequence_tokens", "merge_kinds"):
            assert stats[key] == report[key], key
        assert frame.height == report["sequences"]
        assert sum(sum(m) for m in frame["loss_mask"].to_list()) == report["sampled_tokens"]
    # behaviour logprobs sit exactly on the sampled ids, as captured
    records = {(r["session_id"], r["call_index"]): r for r in _step0_records(run)}
    for row in frame.iter_rows(named=True):
        spans = [(c, s, e) for c, s, e, kind in zip(row["span_call_index"], row["span_start"], row["span_end"],
                                                    row["span_kind"]) if kind == "sampled"]
        assert len(spans) == row["n_calls"]
        for c, s, e in spans:
            rec = records[(row["session_id"], c)]
            assert row["input_ids"][s:e] == rec["sampled_token_ids"]
            assert row["logprobs"][s:e] == pytest.approx(rec["sampled_logprobs"], abs=1e-6)
            assert all(row["loss_mask"][s:e])


def _trained_rows(run: Path, frame: pl.DataFrame) -> list[int]:
    """Rows the recorded run trained on: all, or (``--drop-zero-variance``, as ``polar demo`` trains)
    those of groups whose rewards differ."""
    if not _train_config(run).get("adv", {}).get("drop_zero_variance", False):
        return list(range(frame.height))
    varied = set(frame.group_by("group_id").agg(pl.col("reward").n_unique().alias("n")).filter(pl.col("n") > 1)["group_id"])
    return [i for i, g in enumerate(frame["group_id"].to_list()) if g in varied]


def test_trainer_reports_the_recorded_mismatch_kl(run, measured):
    """The trainer's mismatch_kl on the rebuilt batch is the one the recorded run reported."""
    from polar_training.config import LossConfig
    from polar_training.loss import LOG_RATIO_CLAMP

    reported = json.loads((run / "train" / "metrics.jsonl").read_text().splitlines()[0])
    rows = _trained_rows(run, measured.frame)
    assert rows
    vllm, trainer = torch.cat([measured.vllm[i] for i in rows]), torch.cat([measured.trainer[i] for i in rows])
    gap = vllm - trainer
    assert gap.numel() == reported["n_sampled_tokens"] > 500
    assert sum(len(measured.frame["input_ids"][i]) for i in rows) == reported["n_input_tokens"]
    assert float(gap.mean()) == pytest.approx(reported["mismatch_kl"], abs=1e-4)  # measured: 5e-8 apart
    tis = torch.exp((trainer - vllm).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=LossConfig().tis_cap)
    assert float(tis.mean()) == pytest.approx(reported["tis_weight_mean"], abs=1e-4)
    # and the trainer's own accumulated statistic is that mean over the sampled tokens it measured
    m = measured.metrics
    everything = torch.cat(measured.vllm) - torch.cat(measured.trainer)
    assert m["n_sampled_tokens"] == everything.numel()
    assert m["mismatch_kl"] == pytest.approx(float(everything.mean()), abs=1e-6)


def test_unmerged_calls_packed_together_match_vllm(measured):
    """Single-call sequences, packed with the others into one micro-batch (position-id resets):
    every sampled token's logprob equals vLLM's."""
    rows = [i for i, n in enumerate(measured.frame["n_calls"].to_list()) if n == 1]
    assert len(rows) >= 2
    gap = torch.cat([measured.vllm[i] - measured.trainer[i] for i in rows])
    assert gap.numel() > 50 and gap.abs().max() < TOL


def test_first_turn_of_every_merged_sequence_matches_vllm(measured):
    """The first call's answer is trained in exactly the context it was sampled in."""
    merged = [(i, r) for i, r in enumerate(measured.frame.iter_rows(named=True)) if r["n_calls"] > 1]
    assert len(merged) >= 2
    for i, row in merged:
        n_first = _sampled_spans(row)[0][1]
        gap = measured.vllm[i] - measured.trainer[i]
        assert n_first > 0 and gap[:n_first].abs().max() < TOL, row["trajectory_id"]


def test_every_token_trained_in_the_context_it_was_sampled_in_matches_vllm(run, measured):
    """The property the trainer needs, per sampled span of every (merged) sequence: where the tokens
    before the span are exactly the call's own prompt, the trainer reproduces vLLM's logprobs.
    Spans after a non-exact merge (content_changed: the history was re-rendered) are outside the
    property (see the strict xfail below); exact-history captures make every span satisfy it.

    The capture predates recorded sampling parameters (schema 1); its requests carried none and
    the 0.5B's generation_config.json has none, so vLLM sampled plainly at T=1, which is what the
    trainer assumes for a frame without sampling columns."""
    prompt = {(r["session_id"], r["call_index"]): r["prompt_token_ids"] for r in _step0_records(run)}
    checked = skipped = 0
    for i, row in enumerate(measured.frame.iter_rows(named=True)):
        gap = (measured.trainer[i] - measured.vllm[i]).abs()
        k = 0
        for ci, s, e, kind in zip(row["span_call_index"], row["span_start"], row["span_end"], row["span_kind"]):
            if kind != "sampled":
                continue
            if row["input_ids"][:s] == prompt[(row["session_id"], ci)]:
                assert gap[k : k + e - s].max() < TOL, (row["trajectory_id"], ci, gap[k : k + e - s].max())
                checked += e - s
            else:
                skipped += e - s
            k += e - s
        assert k == gap.numel()
    assert checked > 200
    assert skipped == 0 if exact_history(run) else skipped > 0  # the non-exact capture has both kinds


def test_later_turns_of_merged_sequences_match_vllm(run, measured, request):
    """Every sampled token of every merged sequence, later turns included, has vLLM's logprob, and
    the trainer's mismatch_kl is <= 1e-3: the product's promise once the history vLLM saw is the ids
    the model sampled. It must fail on the capture recorded without exact history."""
    if not exact_history(run):
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "captured without exact history: later turns were sampled after Pi's re-rendered history "
            "(content_changed merges), so the trainer's context differs (measured mismatch_kl 0.14)")))
    merged = [i for i, n in enumerate(measured.frame["n_calls"].to_list()) if n > 1]
    assert merged
    gap = torch.cat([measured.vllm[i] - measured.trainer[i] for i in merged])
    assert gap.abs().max() < TOL
    assert abs(measured.metrics["mismatch_kl"]) < TOL
