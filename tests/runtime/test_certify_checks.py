"""polar certify's offline checks on a real recorded run, and the breaks they must catch.

The run: step 0 of a real ``polar demo`` with exact history (tests/fixtures/demo-run-exact: Pi on
Qwen2.5-Coder-0.5B, 8 sessions, 82 calls, 74 sampled tool calls), its trajectories rebuilt as the
loop builds them. Unbroken, every check the run exercises PASSes and the rest say NOT EXERCISED.
Then each break is injected into a copy of the captures or into the trajectories, as a bug in the
proxy, the builder or the trainer would leave them, and the check that owns the property must FAIL
with a number or a name that points at it: a wrong splice (an id of a re-sent answer changed in the
next prompt, which the proxy still calls ``history: exact``), an off-by-one loss mask, a temperature
the trainer does not apply, a dropped tool call.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from polar_core.schema import read_capture_lines
from polar_runtime.certify import checks as C
from polar_runtime.certify.delivery import check_logprob_agreement, check_policy_delivery

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "demo-run-exact"


def _records(captures: Path) -> dict[str, list[dict]]:
    return {p.stem: list(read_capture_lines(p)) for p in sorted((captures / "sessions").glob("*.jsonl"))}


def _write(captures: Path, sessions: dict[str, list[dict]]) -> None:
    shutil.rmtree(captures / "sessions", ignore_errors=True)
    (captures / "sessions").mkdir(parents=True)
    for sid, recs in sessions.items():
        (captures / "sessions" / f"{sid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def _build(out: Path, model_dir: Path) -> pl.DataFrame:
    """The loop's own trajectories of the captures under ``out/captures`` (phases.build_trajectories)."""
    from polar_runtime.loop.phases import StepData, build_trajectories

    rows = pl.read_parquet(out / "captures" / "rollouts.parquet")
    data = StepData(0, rows)
    build_trajectories(out, data, model_dir)
    return pl.read_parquet(data.trajectories)


def _copy_run(tmp: Path, edit=None) -> Path:
    out = tmp / "run"
    shutil.copytree(FIXTURE / "captures", out / "captures", ignore=shutil.ignore_patterns(".polar-cache"))
    if edit is not None:
        sessions = _records(out / "captures")
        edit(sessions)
        _write(out / "captures", sessions)
    return out


def _evidence(out: Path, model_dir: Path, traj: pl.DataFrame | None) -> C.Evidence:
    return C.Evidence.load(out / "captures", model_dir, trajectories=traj, cache_dir=out / "cache")


@pytest.fixture(scope="module")
def clean(tmp_path_factory, qwen05_dir):
    out = _copy_run(tmp_path_factory.mktemp("clean"))
    traj = _build(out, qwen05_dir)
    return out, traj


def _states(results: list[C.CheckResult]) -> dict[str, str]:
    return {r.name: r.state for r in results}


def test_the_recorded_run_passes_every_check_it_exercises(clean, qwen05_dir):
    out, traj = clean
    ev = _evidence(out, qwen05_dir, traj)
    results = [C.check_capture(ev), C.check_exact_history(ev), C.check_mask(ev), C.check_sampling(ev, 1.0),
               C.check_tool_calls(ev), C.check_reasoning(ev)]
    for r in results:
        print(f"{r.name:<14} {r.state:<14} {r.measured}")
    assert _states(results) == {"capture": "NOT EXERCISED", "exact history": "PASS", "mask": "PASS", "sampling": "PASS",
                                "tool calls": "PASS", "reasoning": "NOT EXERCISED"}
    by = {r.name: r for r in results}
    assert by["exact history"].value == 1.0 and by["exact history"].count >= 60  # 74 merges, all exact
    assert by["mask"].count > 1000 and by["mask"].failures == 0
    assert by["tool calls"].count >= 40 and by["tool calls"].value == 1.0
    assert by["sampling"].count == 79  # 82 calls, 3 cut by the timeout (status error)
    # no check may pass without its minimum: the capture check has no flows, the 0.5B does not reason
    for r in results:
        assert r.state != "PASS" or r.count >= r.minimum


def test_a_wrong_splice_fails_exact_history(tmp_path, qwen05_dir):
    """One id of a re-sent answer changed in the next prompt (the proxy spliced the wrong token) while
    the record still says ``history: exact``."""
    hit = {}

    def edit(sessions):
        recs = sessions["hello-file.st0.s0"]
        prev, nxt = recs[1], recs[2]
        at = len(prev["prompt_token_ids"]) + 2  # inside the answer the harness re-sent
        assert nxt["prompt_token_ids"][:at + 1] == (prev["prompt_token_ids"] + prev["sampled_token_ids"])[:at + 1]
        nxt["prompt_token_ids"][at] = (nxt["prompt_token_ids"][at] + 1) % 150000
        assert nxt["history"] == "exact"
        hit["call"] = f"{nxt['session_id']}#{nxt['call_index']}"

    out = _copy_run(tmp_path, edit)
    r = C.check_exact_history(_evidence(out, qwen05_dir, None))
    print(r.measured, r.details)
    assert r.state == "FAIL"
    assert any(d.startswith(hit["call"]) and "history=exact" in d for d in r.details)
    assert r.value is not None and r.value < 1.0


def test_an_off_by_one_mask_fails_the_mask_check(clean, qwen05_dir):
    out, traj = clean
    row = 0
    mask = list(traj["loss_mask"][row])
    shifted = [0] + mask[:-1]  # every masked token one position late
    broken = traj.with_columns(pl.Series("loss_mask", [shifted if i == row else list(m) for i, m in
                                                       enumerate(traj["loss_mask"].to_list())], dtype=traj["loss_mask"].dtype))
    r = C.check_mask(_evidence(out, qwen05_dir, broken))
    print(r.measured, r.details)
    assert r.state == "FAIL" and r.failures == 1
    assert r.details[0].startswith(traj["trajectory_id"][row]) and "first difference at masked token 0" in r.details[0]


def test_a_harness_side_call_is_not_required_in_a_training_sequence(tmp_path, qwen05_dir):
    """A harness's own side call (OpenCode's title call) is kept out of training by the builder
    (polar_core.compaction.HARNESS_SIDE_CALLS), so the mask check must not ask for it (opencode x
    tiny-r1 FAILed mask on its six title calls); a usable model call left out still fails."""
    def as_title_call(sessions):
        rec = sessions["hello-file.st0.s0"][-1]
        rec["normalized_request"]["messages"] = [
            {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
            {"role": "user", "content": "Generate a title for this conversation."}]

    out = _copy_run(tmp_path, as_title_call)
    traj = _build(out, qwen05_dir)
    r = C.check_mask(_evidence(out, qwen05_dir, traj))
    print(r.measured, r.details)
    assert r.state == "PASS", r.details
    dropped = traj.filter(pl.col("trajectory_id") != traj["trajectory_id"][0])
    r = C.check_mask(_evidence(out, qwen05_dir, dropped))
    assert r.state == "FAIL" and any("trained in 0 sequences" in d for d in r.details)


def test_a_temperature_the_trainer_does_not_apply_fails_sampling(clean, qwen05_dir):
    """The trajectory trains a sequence at another temperature than its calls were sampled at."""
    out, traj = clean
    broken = traj.with_columns(temperature=pl.when(pl.int_range(pl.len()) == 3).then(0.7).otherwise(pl.col("temperature")))
    r = C.check_sampling(_evidence(out, qwen05_dir, broken), 1.0)
    print(r.measured, r.details)
    assert r.state == "FAIL" and r.failures == 1
    assert traj["trajectory_id"][3] in r.details[0] and "temperature=0.7" in r.details[0]


def test_a_call_sampled_at_another_temperature_fails_sampling(tmp_path, qwen05_dir):
    """A harness-sent temperature the proxy did not enforce: the call was sampled at 0.7, the run's is 1."""

    def edit(sessions):
        rec = sessions["hello-file.st0.s1"][2]
        rec["sampling"] = dict(rec["sampling"], temperature=0.7)

    out = _copy_run(tmp_path, edit)
    r = C.check_sampling(_evidence(out, qwen05_dir, None), 1.0)
    print(r.measured, r.details)
    assert r.state == "FAIL" and r.failures == 1 and "hello-file.st0.s1#2" in r.details[0]
    assert "temperature=0.7" in r.details[0]


def test_a_dropped_tool_call_fails_the_tool_call_check(tmp_path, qwen05_dir):
    """The harness's next request lacks a tool call the model sampled (a translator that lost it)."""
    hit = {}

    def edit(sessions):
        recs = sessions["hello-file.st0.s0"]
        tc = recs[0]["output_tool_calls"][0]
        nxt = recs[1]
        for req in (nxt["normalized_request"], nxt["native_request"]):
            for m in req["messages"]:
                if m.get("tool_calls"):
                    m["tool_calls"] = [c for c in m["tool_calls"] if c.get("id") != tc["id"]]
        hit["call"] = f"{recs[0]['session_id']}#{recs[0]['call_index']}"

    out = _copy_run(tmp_path, edit)
    r = C.check_tool_calls(_evidence(out, qwen05_dir, None))
    print(r.measured, r.details)
    assert r.state == "FAIL" and r.failures == 1
    assert r.details[0].startswith(hit["call"]) and "did not come back" in r.details[0]


def test_not_exercised_is_never_pass_and_a_failure_always_fails():
    assert C.judge("exact history", 9, [], "9 re-sent").state == "NOT EXERCISED"
    assert C.judge("exact history", 10, [], "10 re-sent").state == "PASS"
    assert C.judge("exact history", 1, ["x"], "1 re-sent").state == "FAIL"


def test_logprob_agreement_grades_mismatch_kl_and_reports_the_worst_token():
    good = {"tokens": 500.0, "mismatch_kl": 4e-6, "max_abs_gap": 3e-4}
    assert check_logprob_agreement(good).state == "PASS"
    bad = check_logprob_agreement({"tokens": 500.0, "mismatch_kl": 0.14, "max_abs_gap": 2.5})
    assert bad.state == "FAIL" and "max per-token |diff| 2.50e+00" in bad.details[0]
    assert check_logprob_agreement({"tokens": 20.0, "mismatch_kl": 0.0, "max_abs_gap": 0.0}).state == "NOT EXERCISED"
    assert check_logprob_agreement(good, served_dtype="bfloat16").state == "MEASURED"


def test_policy_delivery_needs_the_push_the_canary_and_the_later_versions():
    new = {"state": "new", "alpha": 0.99, "separation": 300.0, "reason": ""}
    assert check_policy_delivery(1, None, new, [1, 1, 1]).state == "PASS"
    assert check_policy_delivery(1, None, new, [1, 0]).state == "FAIL"
    stale = dict(new, state="previous", alpha=0.01)
    r = check_policy_delivery(1, None, stale, [1, 1])  # a push that claimed success over the old weights
    assert r.state == "FAIL" and "0.010 x the predicted" in r.details[0]
    assert check_policy_delivery(None, None, None, [], "no update").state == "NOT EXERCISED"


def test_spread_rewards_gives_every_group_a_spread():
    from polar_runtime.certify.runner import spread_rewards

    frame = pl.DataFrame({"group_id": ["a", "a", "a", "b", "b"], "session_id": ["s1", "s2", "s2", "t1", "t2"],
                          "reward": [0.0] * 5, "status": ["timeout", "ok", "ok", "ok", "failed"]})
    got = spread_rewards(frame)
    assert got.columns == frame.columns and set(got["status"]) == {"ok"}
    assert got.group_by("group_id").agg(pl.col("reward").n_unique())["reward"].to_list() == [2, 2]


def test_the_delivery_step_trains_one_pair_of_one_group():
    from polar_runtime.certify.runner import delivery_pair

    frame = pl.DataFrame({"group_id": ["a", "b", "b", "b", "b", "c", "c"],
                          "session_id": ["s1", "t1", "t1", "t2", "t3", "u1", "u2"],
                          "reward": [0.0] * 7, "status": ["ok"] * 7})
    got = delivery_pair(frame)  # group a has one sample: no spread there; b's first two, every row of them
    assert got.columns == frame.columns
    assert got["session_id"].to_list() == ["t1", "t1", "t2"] and sorted(set(got["reward"])) == [0.0, 1.0]
    lone = frame.filter(pl.col("group_id") == "a")
    assert delivery_pair(lone).height == 1  # nothing to pair: the whole frame


def test_cells_and_shards():
    from polar_runtime.certify.commands import cells_of
    from polar_runtime.certify.runner import cell_name

    cells = cells_of(["pi-chat", "codex"], ["m1", "m2"], (0, 1))
    assert cells == [("pi-chat", "m1"), ("pi-chat", "m2"), ("codex", "m1"), ("codex", "m2")]
    halves = cells_of(["pi-chat", "codex"], ["m1", "m2"], (0, 2)) + cells_of(["pi-chat", "codex"], ["m1", "m2"], (1, 2))
    assert sorted(halves) == sorted(cells)
    assert cell_name("pi-chat", "/x/y/Qwen 0.5B") == "pi-chat__Qwen-0.5B"


def test_the_published_matrix_is_generated_from_the_committed_cells():
    """docs/certify.md's matrix region is exactly what the committed results render to (regenerate
    it with `polar certify --matrix` after committing a cell)."""
    from polar_runtime.certify import matrix

    assert matrix.region() == "\n" + matrix.render(matrix.load_results())
    # and the README's summary of it (a row per harness, a column per model)
    summary = matrix.region(matrix.README, matrix.SUMMARY_BEGIN, matrix.SUMMARY_END)
    assert summary == "\n" + matrix.render_summary(matrix.load_results())
    assert summary.count("\n| ") >= len(matrix.HARNESSES)


def test_a_failing_cell_stays_in_the_matrix_with_its_cause():
    from polar_runtime.certify import matrix

    check = {"name": "mask", "state": "FAIL", "measured": "10 sampled tokens", "count": 300, "minimum": 100,
             "value": 1.0, "failures": 1, "details": ["x/0.0: first difference at masked token 0"]}
    rep = {"harness": "codex", "model": "tiny-r1", "verdict": "FAIL", "error": None, "checks": [check],
           "harness_version": "@openai/codex@0.171.0", "vllm_version": "0.32.0", "date": "2026-12-07"}
    text = matrix.render({("codex", "tiny-r1"): rep})
    row = next(line for line in text.splitlines() if line.startswith("| codex | tiny-r1 |"))
    assert "**FAIL**" in row and "1 wrong of 300 tok" in row and "0.32.0" in row
    assert "- codex x tiny-r1: mask: x/0.0: first difference at masked token 0" in text
    assert "| pi-chat | tiny-r1 | not run yet |" in text
    summary = matrix.render_summary({("codex", "tiny-r1"): rep})
    assert "| codex | not run yet | **FAIL**: mask |" in summary


def test_certify_takes_the_loops_model_harness_sandbox_and_sampling_keys(tmp_path):
    from polar_runtime.certify.runner import DELIVERY_LR, SAMPLES, TASKS, certify_config
    from polar_runtime.loop.config import parse_config

    base = parse_config('[model]\nname = "tiny-r1"\nmax_model_len = 8192\n[harness]\nname = "codex"\ntimeout_s = 99\n'
                        '[sandbox]\nbackend = "docker"\n[sampling]\ntemperature = 0.8\n[tasks]\nsource = "coding"\n'
                        '[rollout]\nsamples_per_group = 8\niterations = 5\n[trainer]\nlr = 3e-7\n')
    cfg = certify_config(base, None, None, tmp_path)
    assert (cfg.model.name, cfg.model.max_model_len, cfg.harness.name, cfg.harness.timeout_s) == ("tiny-r1", 8192, "codex", 99)
    assert cfg.sandbox.backend == "docker" and cfg.sampling.temperature == 0.8
    assert (cfg.tasks.source, cfg.rollout.samples_per_group, cfg.rollout.iterations) == (TASKS, SAMPLES, 1)
    assert cfg.trainer.lr == DELIVERY_LR and cfg.harness.exact_history
    assert certify_config(base, "pi-chat", "tiny-qwen", tmp_path).harness.name == "pi-chat"
    assert base.rollout.samples_per_group == 8  # the caller's configuration is left alone


def test_a_history_the_harness_edited_is_named_not_graded(tmp_path, qwen05_dir):
    """A call whose harness sent another system prompt (recorded by the proxy as rendered, with its
    cause) is no splice failure: it is named and left out of the rate; the rest still pass."""

    def edit(sessions):
        rec = sessions["hello-file.st0.s1"][5]
        rec["normalized_request"]["messages"][0]["content"] += " Be brief."
        rec["prompt_token_ids"][5] = (rec["prompt_token_ids"][5] + 1) % 150000
        rec["history"], rec["history_cause"] = "rendered", "history_edited"

    out = _copy_run(tmp_path, edit)
    r = C.check_exact_history(_evidence(out, qwen05_dir, None))
    print(r.measured, r.details)
    assert r.state == "PASS" and r.value == 1.0 and r.count == 73
    assert "the harness edited its history: system_changed 1" in r.measured


def _fake_cell(root: Path, state: str) -> Path:
    from polar_runtime.certify.runner import CELL_FILE, ORDER, cell_name

    cell = root / cell_name("pi-chat", "tiny-qwen")
    cell.mkdir(parents=True)
    checks = [dict(C.judge(n, 100, [], "x").to_dict(), state=state if n == "mask" else "PASS") for n in ORDER]
    rep = {"harness": "pi-chat", "model": "tiny-qwen", "verdict": "FAIL" if state == "FAIL" else "PASS", "error": None,
           "checks": checks, "date": "2026-12-07", "run": {}}
    (cell / CELL_FILE).write_text(json.dumps(rep))
    return cell


@pytest.mark.parametrize("state,code", [("PASS", 0), ("FAIL", 1)])
def test_a_finished_cell_is_skipped_and_its_verdict_is_the_exit_status(tmp_path, state, code):
    """Resumption: a cell with its certify.json is not run again (nothing could run here: no server
    is reachable, and the run would take minutes); the exit status is 1 when a cell FAILed."""
    from typer.testing import CliRunner

    from polar_runtime.cli import app

    _fake_cell(tmp_path, state)
    res = CliRunner().invoke(app, ["certify", "--harness", "pi-chat", "--model", "tiny-qwen", "--out", str(tmp_path)])
    assert res.exit_code == code, res.output
    assert "done before" in res.output and "skipped" in res.output
    summary = json.loads((tmp_path / "certify-report.json").read_text())
    assert [c["verdict"] for c in summary["cells"]] == [state]


def test_a_rollout_whose_samples_all_failed_is_still_judged_by_its_calls(tmp_path):
    """Claude Code on tiny-r1 ends every sample in an error (four answers cut at max_tokens) after
    making its calls; the loop refuses such a step (LoopError), certify judges its calls. Once the
    cell stopped at the rollout after the push, leaving policy delivery unjudged."""
    import polars as pl

    from polar_analysis.rewards import ROLLOUTS_FILE
    from polar_runtime.certify.runner import judged_rollout
    from polar_runtime.loop.groups import LoopError

    class Placement:
        captures = tmp_path

        def rollout(self, step, ids, version):
            raise LoopError(f"rollout step {step} produced nothing to learn from: all 1 samples failed")

    pl.DataFrame({"step": [0, 1], "session_id": ["a.st0.s0", "a.st1.s0"], "calls": [3, 4],
                  "status": ["failed", "failed"]}).write_parquet(tmp_path / ROLLOUTS_FILE)
    run: dict = {}
    rows = judged_rollout(Placement(), 1, ["a"], 1, run, "after_push_note")
    assert [r["session_id"] for r in rows] == ["a.st1.s0"] and rows[0]["calls"] == 4
    assert "nothing to learn from" in run["after_push_note"]
    pl.DataFrame({"step": [1], "session_id": ["a.st1.s0"], "calls": [0], "status": ["failed"]}).write_parquet(
        tmp_path / ROLLOUTS_FILE)
    with pytest.raises(LoopError):  # no call at all: nothing to judge, the cell stops
        judged_rollout(Placement(), 1, ["a"], 1, {}, "after_push_note")


def test_a_dropped_answer_is_no_broken_exact_claim_but_an_unnamed_edit_fails():
    """The record's ``history: exact`` is checked against its ids for every re-sent answer; an
    answer the harness dropped (Qwen Code on tiny-r1: reasoning-only answers) was not re-sent, so it
    is counted as the harness's edit, not as a false claim. A user turn the harness edited with no
    named cause (``other``) still FAILs."""
    class Ev:
        def __init__(self, rows):
            self.rows = rows
            self.by_id = {r["call_id"]: {"history": "exact"} for r in rows}

        def drift(self):
            return self.rows

    def row(i, cause, detail=None):
        return {"call_id": f"c{i}", "session_id": "s", "call_index": i, "cause": cause, "detail": detail,
                "prompt_divergence": None, "answer_divergence": 0}

    exact = [row(i, "none") for i in range(12)]
    r = C.check_exact_history(Ev(exact + [row(12, "answer_dropped")]))
    assert r.state == "PASS", r.details
    assert "answer_dropped 1" in r.measured and r.count == 12
    r = C.check_exact_history(Ev(exact + [row(12, "other", "turn 2 (user) edited")]))
    assert r.state == "FAIL" and any("without a named cause" in d for d in r.details)
    assert any("recorded as history=exact" in d for d in r.details)  # a re-sent answer's claim is still checked


def test_reasoning_delivered_twice_fails_and_a_special_token_left_out_does_not(qwen05_dir):
    """The delivered reasoning must be text of the call's sampled ids, once. Measured with tiny-r1
    under OpenCode: the model sampled ``<|video_pad|>`` mid-reasoning, the engine's streamed text left
    it out, and the proxy then sent the derendered reasoning whole after it (8,016 characters for
    4,015). The engine's text without the special token, or the derendered text with it, PASSes."""
    from polar_analysis.alignment import load_tokenizer

    tok = load_tokenizer(qwen05_dir)
    ids = tok.encode("Two plus two is four, so the file gets one line.") + [tok.convert_tokens_to_ids("<|video_pad|>")] \
        + tok.encode(" Writing it now.")
    engine = tok.decode(ids, skip_special_tokens=True)
    derendered = tok.decode(ids, skip_special_tokens=False)
    assert "<|video_pad|>" in derendered and "<|video_pad|>" not in engine

    class Ev:
        tokenizer = tok

        def __init__(self, delivered):
            note = "exact history: streamed reasoning differs from the derendered answer; the engine's text delivered"
            self.records = [{"call_id": f"c{i}", "session_id": "s", "call_index": i, "status": "ok",
                             "sampled_token_ids": ids, "output_reasoning": text, "output_text": "",
                             "translation_notes": [note] if i == 0 else []} for i, text in enumerate(delivered)]

        def successors(self):
            return {r["call_id"]: {"cause": "template_dropped_reasoning"} for r in self.records}

    r = C.check_reasoning(Ev([engine, derendered, "\n" + engine.strip() + "\n"]))
    assert r.state == "PASS", r.details
    assert "1 streamed apart from the derendered answer" in r.measured
    r = C.check_reasoning(Ev([engine + derendered, derendered, engine]))
    assert r.state == "FAIL" and r.failures == 1
    assert "s#0: delivered reasoning is not the sampled text: 102 characters delivered, the 18 sampled ids decode to 51" in r.details[0], r.details
    r = C.check_reasoning(Ev([engine, derendered, engine.replace("four", "five")]))  # not what was sampled
    assert r.state == "FAIL" and "s#2" in r.details[0]


def _sse(*events: dict, named: bool = False) -> bytes:
    return b"".join((f"event: {e['type']}\n" if named else "").encode() + b"data: " + json.dumps(e).encode() + b"\n\n"
                    for e in events)


def _bodies(reasoning: str, field: str) -> dict[str, bytes]:
    """A streamed answer in each provider's wire format, its text in the reasoning ``field`` or the
    answer's ``text`` field, as the proxy's translators write them (the shapes of the tiny-r1 flows)."""
    as_r = field == "reasoning"
    return {
        "openai_chat": _sse({"object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"reasoning" if as_r else "content": reasoning}}]}) + b"data: [DONE]\n\n",
        "anthropic": _sse({"type": "content_block_start", "index": 0,
                           "content_block": {"type": "thinking" if as_r else "text", "thinking" if as_r else "text": ""}},
                          {"type": "content_block_delta", "index": 0, "delta": {
                              "type": "thinking_delta", "thinking": reasoning} if as_r else {"type": "text_delta", "text": reasoning}},
                          named=True),
        "openai_responses": _sse({"type": "response.reasoning_text.delta" if as_r else "response.output_text.delta",
                                  "delta": reasoning}, named=True),
        "google": _sse({"candidates": [{"content": {"parts": [{"text": reasoning, "thought": True} if as_r
                                                              else {"text": reasoning}]}}]}),
    }


def test_reasoning_the_harness_got_as_answer_text_or_cut_fails(tmp_path, qwen05_dir):
    """The record holds the answer before translation; the saved flow holds what the harness got. A
    translator that sends reasoning as answer text, or not whole, FAILs reasoning with the numbers;
    each provider's reasoning field PASSes (on the nine tiny-r1 cells' flows: 228 of 228 answers
    found in their reasoning field, in all four wire formats)."""
    from mitmproxy import io
    from mitmproxy.test import tflow

    from polar_analysis.alignment import load_tokenizer
    from polar_core.flowmeta import META_KEY

    tok = load_tokenizer(qwen05_dir)
    reasoning = "The file needs one line, so I write first and stop there."
    ids = tok.encode(reasoning)

    def judge(bodies: dict[str, bytes]):
        path = tmp_path / "flows.mitm"
        records = []
        with open(path, "wb") as fh:
            w = io.FlowWriter(fh)
            for i, (provider, body) in enumerate(bodies.items()):
                f = tflow.tflow(resp=True)
                f.response.content = body
                f.metadata[META_KEY] = {"call_id": f"c{i}", "session": "s", "call_index": i}
                w.add(f)
                records.append({"call_id": f"c{i}", "session_id": "s", "call_index": i, "status": "ok",
                                "provider": provider, "sampled_token_ids": ids, "output_reasoning": reasoning,
                                "output_text": "", "translation_notes": []})
        ev = C.Evidence(tmp_path, records, None, None, flows=path, tokenizer=tok)
        ev._drift = [{"call_id": f"n{r['call_id']}", "prev_call_id": r["call_id"], "cause": "template_dropped_reasoning"}
                     for r in records]
        return C.check_reasoning(ev)

    r = judge(_bodies(reasoning, "reasoning"))
    assert r.state == "PASS" and r.count == 4, r.details
    r = judge(_bodies(reasoning, "text"))
    assert r.state == "FAIL" and r.failures == 4, r.details
    assert all("reasoning delivered as answer text (46 characters in the answer field, 0 as reasoning)" in d
               for d in r.details), r.details
    r = judge(_bodies(reasoning[:30], "reasoning"))
    assert r.state == "FAIL" and r.failures == 4
    assert "reasoning not delivered whole: 23 characters in the harness's reasoning field for 46 sampled" in r.details[0]


def test_a_tool_call_the_harness_filled_in_comes_back_named_and_a_changed_one_fails():
    """Claude Code re-sends the model's Edit call with ``"replace_all": false`` filled in: the call
    came back (every sampled argument unchanged) and the added key is named; an argument the harness
    changed, or a call it left out, still FAILs."""
    sampled = {"id": "t1", "name": "Edit", "arguments": json.dumps({"file_path": "n.txt", "new_string": "x"})}

    class Ev:
        flows = None

        def __init__(self, sent_args):
            self.records = [{"call_id": "c0", "session_id": "s", "call_index": 0, "status": "ok", "provider": "anthropic",
                             "output_tool_calls": [sampled]}]
            self.later = {"call_id": "c1", "native_request": {"messages": [{"content": [{"id": "t1"}]}]},
                          "normalized_request": {"messages": [{"role": "assistant", "tool_calls": [
                              {"id": "t1", "function": {"name": "Edit", "arguments": json.dumps(sent_args)}}]}]}}
            self.by_id = {"c0": self.records[0], "c1": self.later}

        def successors(self):
            return {"c0": {"call_id": "c1", "session_id": "s", "call_index": 1, "cause": "tool_call_edited"}}

    r = C.check_tool_calls(Ev({"file_path": "n.txt", "new_string": "x", "replace_all": False}))
    assert r.failures == 0 and "1/1 sampled tool calls came back" in r.measured
    assert "arguments the harness added: replace_all 1" in r.measured
    r = C.check_tool_calls(Ev({"file_path": "m.txt", "new_string": "x", "replace_all": False}))
    assert r.state == "FAIL" and "did not come back" in r.details[0]
