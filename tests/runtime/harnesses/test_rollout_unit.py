"""The rollout runner without a model: tasks, shards, the reward rule, timeouts, resume, Parquet.

The harness here is the generic preset running a shell command, so every branch of the runner
(ok, failed, timeout, evaluator error) is exercised in a few seconds. The stand-in harness writes
capture records the way the proxy would, outside its work dir, so those tests run with the ``host``
sandbox backend (no isolation); the verifier and the built-in tasks run in the default sandbox.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import orjson
import polars as pl
import pytest

from polar_core.schema import CallRecord, valid_session_id
from polar_runtime import rollout as r
from polar_runtime.harnesses import Endpoint, get_preset


def test_builtin_tasks_load_and_have_evaluators():
    tasks = r.load_tasks("coding")
    assert len(tasks) >= 4 and all(t.has_tests and t.has_solution and t.root for t in tasks)
    assert [t.id for t in tasks[:2]] == ["hello-file", "make-dir"]  # dataset.toml order: the demo's two
    assert r.load_tasks(r.resolve_tasks_path("coding"))[0].id == tasks[0].id


def test_task_file_validation(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "a", "instruction": "x"}\n# comment\n\n{"task_id": "b", "prompt": "y", "files": {"f": "z"}}\n')
    tasks = r.load_tasks(p)
    assert [t.id for t in tasks] == ["a", "b"] and tasks[1].files == {"f": "z"}
    p.write_text('{"id": "a", "instruction": "x"}\n{"id": "a", "instruction": "y"}\n')
    with pytest.raises(ValueError, match="duplicate"):
        r.load_tasks(p)
    p.write_text('{"id": "a"}\n')
    with pytest.raises(ValueError, match=":1:"):
        r.load_tasks(p)


def test_shards_partition_the_tasks():
    tasks = [r.Task(f"task-{i}", "x") for i in range(40)]
    parts = [r.shard_tasks(tasks, i, 3) for i in range(3)]
    ids = [t.id for part in parts for t in part]
    assert sorted(ids) == sorted(t.id for t in tasks) and len(ids) == len(set(ids))
    assert all(len(p) > 5 for p in parts)
    assert [t.id for t in r.shard_tasks(list(reversed(tasks)), 1, 3)] == [t.id for t in reversed(parts[1])]
    assert r.parse_shard("1/3") == (1, 3) and r.parse_shard(None) == (0, 1)
    for bad in ("3/3", "a/2", "1/0"):
        with pytest.raises(ValueError):
            r.parse_shard(bad)


def test_ids_are_valid_session_ids_and_distinct():
    weird = ["fix add", "fix/add", "fix-add", "..x", "ünï", "a" * 300]
    sids = {r.session_id_for(t, 2, 5) for t in weird}
    assert len(sids) == len(weird) and all(valid_session_id(s) for s in sids)
    assert r.session_id_for("fix-add", 0, 3) == "fix-add.st0.s3"
    assert r.session_id_for("fix-add", 0, 3, attempt=2) == "fix-add.st0.s3.r2"
    assert r.group_id_for("fix-add", 1) == "fix-add.st1"


def _verify(task: r.Task, tmp_path: Path, timeout: float = 30.0) -> r.Evaluation:
    """The shorthand evaluator through the real path: generated tests/test.sh in the sandbox."""
    from polar_trial.sandbox import get_sandbox

    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    return r.verify(task, sandbox=get_sandbox("auto"), sample_dir=tmp_path, workdir_host=work,
                    agent_logs=tmp_path / "logs", timeout=timeout)


@pytest.mark.parametrize("evaluator,want", [
    ("true", (1.0, "pass")),
    ("echo 3 of 4 passed; echo 0.75", (0.75, "pass")),
    ("echo 0", (0.0, "fail")),
    ("echo ok: done", (1.0, "pass")),
    ("echo 0.9; exit 1", (0.0, "fail")),
    ("echo nan", (1.0, "pass")),
    ("echo 1e999", (None, "error")),  # a number, but not a finite one
])
def test_shorthand_reward_rule(evaluator, want, tmp_path):
    """exit 0: the number on the last line (partial credit) or 1; exit != 0: 0; a non-finite
    number is no reward -- the generated test.sh applies the rule, the verifier reads reward.txt."""
    ev = _verify(r.Task("t", "x", evaluator=evaluator), tmp_path)
    assert (ev.reward, ev.status) == want, ev.output


def test_evaluator_failures_are_recorded(tmp_path):
    ev = _verify(r.Task("t", "x", evaluator="no-such-command-polar"), tmp_path / "a")
    assert ev.reward is None and ev.status == "error" and "not found" in ev.output
    ev = _verify(r.Task("t", "x", evaluator="sleep 30"), tmp_path / "b", timeout=1.0)
    assert ev.reward == 0.0 and ev.status == "timeout" and ev.seconds < 10  # the sample's hang: 0
    ev = _verify(r.Task("t", "x", evaluator="python3 -c 'raise SystemExit(3)'"), tmp_path / "c")
    assert ev.reward == 0.0 and ev.status == "fail"
    assert _verify(r.Task("t", "x"), tmp_path / "d").status == "none"


def test_task_files_cannot_escape_the_work_dir(tmp_path):
    from polar_trial.sandbox import get_sandbox
    from polar_trial.tasks.environment import BuildError

    sb, builds = get_sandbox("auto"), tmp_path / "builds"
    with pytest.raises(ValueError, match="escapes"):
        r.task_from_dict({"id": "t", "instruction": "x", "files": {"../evil": "x"}})
    with pytest.raises(BuildError, match="escapes"):  # a Task built in code is checked at build time
        r.prepare_workdir(r.Task("t", "x", files={"../evil": "x"}), tmp_path / "w", sb, builds)
    assert not (tmp_path / "evil").exists() and not (builds / "evil").exists()
    r.prepare_workdir(r.Task("t2", "x", files={"a/b.txt": "hi"}, setup="cp a/b.txt c.txt"), tmp_path / "w", sb, builds)
    assert (tmp_path / "w" / "c.txt").read_text() == "hi"
    with pytest.raises(BuildError, match="exited 4"):
        r.prepare_workdir(r.Task("t3", "x", setup="exit 4"), tmp_path / "w2", sb, builds)


# A stand-in harness: writes the answer file unless the instruction says otherwise, appends one
# capture record per "call" the way the proxy does, and logs every start (to check resume).
FAKE_HARNESS = r"""
echo "$POLAR_SESSION" >> {starts}
echo "running as $POLAR_SESSION"
case {task} in
  *sleep*) sleep 30 ;;
  *crash*) echo boom >&2; exit 3 ;;
esac
python3 - "$POLAR_SESSION" {capdir} <<'EOF'
import json, sys, pathlib
sid, cap = sys.argv[1], pathlib.Path(sys.argv[2]) / "sessions"
cap.mkdir(parents=True, exist_ok=True)
with open(cap / (sid + ".jsonl"), "a") as f:
    for n in range(2):
        f.write(json.dumps({"record_type": "call", "session_id": sid, "call_index": n,
                            "prompt_token_ids": list(range(10 + n)), "sampled_token_ids": [1, 2, 3]}) + "\n")
    f.write(json.dumps({"record_type": "call", "session_id": sid, "call_index": 2, "status": "error",
                        "error_kind": "upstream_refused", "prompt_token_ids": [], "sampled_token_ids": []}) + "\n")
    f.write('{"record_type": "call", "session_id": "torn"')  # a torn last line is skipped
EOF
echo hello > answer.txt
"""


def make_cfg(tmp_path: Path, tasks: list[r.Task], **kw) -> r.RolloutConfig:
    cap = tmp_path / "captures"
    cmd = FAKE_HARNESS.replace("{starts}", str(tmp_path / "starts.log")).replace("{capdir}", str(cap))
    return r.RolloutConfig(
        tasks=tasks, preset=get_preset("generic", command=cmd),
        endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"), capture_dir=cap, sandbox="host",
        model="m", **{"samples": 2, "timeout": 6.0, "eval_timeout": 10.0, **kw},  # slack for a loaded machine
    )


TASKS = [
    r.Task("good", "write answer", evaluator='test -f answer.txt && test "$POLAR_STATUS" = ok '
           '&& grep -q "$POLAR_SESSION" "$POLAR_HARNESS_STDOUT" && echo 0.5'),
    r.Task("slow", "please sleep", evaluator="test -f answer.txt"),
    r.Task("bad-eval", "write answer", evaluator="python3 -c 'import nonexistent_polar_module'"),
    r.Task("crashy", "crash now", evaluator="true"),
]


def test_rollout_end_to_end_with_resume(tmp_path):
    cfg = make_cfg(tmp_path, TASKS, concurrency=2)
    seen = []
    df = r.run_rollout(cfg, on_result=seen.append)
    assert len(seen) == 8 and df.height == 8
    assert list(df.columns)[:12] == ["task_id", "sample_index", "session_id", "group_id", "step", "status",
                                     "reward", "calls", "prompt_tokens", "sampled_tokens", "wall_s",
                                     "evaluator_output"]
    on_disk = pl.read_parquet(cfg.capture_dir / "rollouts.parquet")
    assert on_disk.equals(df)
    by = {t: df.filter(pl.col("task_id") == t) for t in ("good", "slow", "bad-eval", "crashy")}
    g = by["good"]
    assert g["status"].to_list() == ["ok", "ok"] and g["reward"].to_list() == [0.5, 0.5]
    assert g["calls"].to_list() == [2, 2] and g["prompt_tokens"].to_list() == [21, 21]
    assert g["error_calls"].to_list() == [1, 1]
    assert g["sampled_tokens"].to_list() == [6, 6]
    assert g["session_id"].to_list() == ["good.st0.s0", "good.st0.s1"] and set(g["group_id"]) == {"good.st0"}
    s = by["slow"]  # killed, then still evaluated (no answer file -> 0.0)
    assert s["status"].to_list() == ["timeout"] * 2 and s["reward"].to_list() == [0.0, 0.0]
    assert all(w < 15 for w in s["wall_s"])
    b = by["bad-eval"]  # harness fine, evaluator crashed: a recorded 0.0, not a lost sample
    assert b["status"].to_list() == ["ok", "ok"] and b["reward"].to_list() == [0.0, 0.0]
    assert "nonexistent_polar_module" in b["evaluator_output"][0]
    c = by["crashy"]
    assert c["status"].to_list() == ["failed"] * 2 and "boom" in c["error"][0] and c["exit_code"][0] == 3

    starts = (tmp_path / "starts.log").read_text().split()
    assert len(starts) == 8
    # Resume: nothing finished runs again; one more sample per task runs only the new ones.
    df2 = r.run_rollout(cfg)
    assert df2.equals(df) and len((tmp_path / "starts.log").read_text().split()) == 8
    cfg.samples = 3
    df3 = r.run_rollout(cfg)
    assert df3.height == 12 and len((tmp_path / "starts.log").read_text().split()) == 12
    # --rerun failed: only the crashed samples run again; "good" left captures, so a new session.
    cfg.rerun = frozenset({"failed"})
    df4 = r.run_rollout(cfg)
    starts = (tmp_path / "starts.log").read_text().split()
    assert len(starts) == 15 and sorted(starts[-3:]) == ["crashy.st0.s0", "crashy.st0.s1", "crashy.st0.s2"]
    assert df4.height == 12 and df4.filter(pl.col("task_id") == "crashy")["attempt"].to_list() == [0, 0, 0]
    assert df4.filter(pl.col("task_id") != "crashy").equals(df3.filter(pl.col("task_id") != "crashy"))
    cfg.rerun, cfg.tasks = frozenset({"ok"}), TASKS[:1]
    df5 = r.run_rollout(cfg)
    good = df5.filter(pl.col("task_id") == "good").sort("sample_index")
    assert good["session_id"].to_list() == ["good.st0.s0.r1", "good.st0.s1.r1", "good.st0.s2.r1"]
    assert good["calls"].to_list() == [2, 2, 2]  # the new attempt's calls only


def test_crashed_attempt_gets_a_fresh_session(tmp_path):
    cfg = make_cfg(tmp_path, TASKS[:1], samples=1)
    stale = cfg.capture_dir / "sessions" / "good.st0.s0.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(orjson.dumps(CallRecord(session_id="good.st0.s0").to_dict()) + b"\n")
    df = r.run_rollout(cfg)
    assert df["session_id"].to_list() == ["good.st0.s0.r1"] and df["attempt"].to_list() == [1]
    assert df["calls"].to_list() == [2]  # the stale attempt's call is not counted
    assert stale.read_bytes().count(b"\n") == 1


def test_shared_directory_two_shards(tmp_path):
    tasks = [r.Task(f"t{i}", "write answer", evaluator="true") for i in range(6)]
    for i in range(2):
        cfg = make_cfg(tmp_path, r.shard_tasks(tasks, i, 2), samples=1)
        r.run_rollout(cfg)
    df = pl.read_parquet(tmp_path / "captures" / "rollouts.parquet")
    assert sorted(df["task_id"]) == [f"t{i}" for i in range(6)] and set(df["reward"]) == {1.0}
    rows = sorted((tmp_path / "captures" / "rollouts").glob("*.json"))
    assert len(rows) == 6 and json.loads(rows[0].read_text())["status"] == "ok"


def test_summary_table(tmp_path):
    cfg = make_cfg(tmp_path, TASKS[:2], samples=1)
    summary = r.summarize(r.run_rollout(cfg))
    assert summary.select("task_id", "ok", "timeout", "mean_reward").rows() == [
        ("good", 1, 0, 0.5), ("slow", 0, 1, 0.0)]


def test_interrupt_kills_running_harnesses_and_keeps_finished_results(tmp_path, ctrl_c):
    """Ctrl-C: harnesses (in process groups of their own) are killed at once; finished samples keep
    their results, interrupted ones have none, so the next run does exactly those."""
    import threading

    cfg = make_cfg(tmp_path, [TASKS[0], r.Task("long", "please sleep", evaluator="true")], samples=1, timeout=60)

    def on_result(row):
        if row["task_id"] == "good":  # the first sample is done: interrupt while "long" sleeps
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        r.run_rollout(cfg, on_result=on_result)
    assert time.monotonic() - t0 < 20
    df = pl.read_parquet(cfg.capture_dir / "rollouts.parquet")
    assert df["task_id"].to_list() == ["good"]
    todo, done = r.plan(cfg, r.ResultStore(cfg.capture_dir))
    assert [j.task.id for j in todo] == ["long"] and len(done) == 1


def test_interrupt_kills_a_harness_that_starts_after_it(tmp_path, monkeypatch, ctrl_c):
    """A sample still preparing when the interruption comes starts its harness only afterwards: it
    must die at once too. Before, the stop killed a snapshot of the running harnesses, this one ran
    on (to --timeout) and the main thread waited for it: SIGTERM to `polar rollout` hung past 60 s."""
    import threading

    cfg = make_cfg(tmp_path, [r.Task("late", "please sleep", evaluator="true")], samples=1, timeout=60)
    interrupted = threading.Event()
    real_terminate, real_run_sample = r.terminate_all, r.run_sample

    def terminate_all() -> int:  # the interruption's stop has run
        n = real_terminate()
        interrupted.set()
        return n

    def run_sample(*args, **kw):  # preparing until after the interruption, then the harness starts
        assert interrupted.wait(30)
        return real_run_sample(*args, **kw)

    monkeypatch.setattr(r, "terminate_all", terminate_all)
    monkeypatch.setattr(r, "run_sample", run_sample)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        r.run_rollout(cfg)
    took = time.monotonic() - t0
    assert took < 20, f"run_rollout returned {took:.0f} s after the interruption: the late harness ran on"
    assert not (cfg.capture_dir / "rollouts.parquet").exists() or pl.read_parquet(
        cfg.capture_dir / "rollouts.parquet").is_empty()


@pytest.mark.parametrize("name", ["coding", "followups"])
def test_builtin_tasks_pass_the_oracle_and_nop_check(name, tmp_path):
    """Every built-in task can give both verdicts, in the sandbox an agent gets: reward 1 after its
    reference solution (the oracle), less for the untouched work dir (nop) -- what the demo needs."""
    from polar_runtime.task_commands import check_tasks

    rows = check_tasks(r.load_tasks(name), work=tmp_path)
    assert [(row["task"], row["oracle"], row["verdict"]) for row in rows] == [
        (row["task"], 1.0, "ok") for row in rows]
    assert all(row["nop"] == 0.0 for row in rows)


FOLLOWUP_HARNESS = """
printf '%s|%s\\n' "${POLAR_RESUME:-0}" {task} >> turns.log
case {task} in *fail*) exit 4 ;; *slow*) sleep 30 ;; esac
"""


def test_followups_resume_the_same_session_until_one_fails(tmp_path):
    """Each follow-up starts the harness again in the same session, work dir and HOME, told to
    resume (POLAR_RESUME=1, a preset's own resume flag); a failed or timed-out turn ends the sample,
    and the sample's timeout covers all its turns."""
    tasks = [r.Task("chat", "first", followups=["second", "third"], evaluator="test $(wc -l < turns.log) = 3"),
             r.Task("broken", "first", followups=["now fail", "never"], evaluator="true"),
             r.Task("slow", "first", followups=["slow one", "never"], evaluator="true")]
    cfg = r.RolloutConfig(tasks=tasks, preset=get_preset("generic", command=FOLLOWUP_HARNESS),
                          endpoint=Endpoint(mode="base_url", base_url="http://127.0.0.1:9"),
                          capture_dir=tmp_path / "captures", model="m", samples=1, timeout=4.0, eval_timeout=10.0)
    df = r.run_rollout(cfg)
    rows = {row["task_id"]: row for row in df.iter_rows(named=True)}
    turns = lambda t: (Path(rows[t]["workdir"]) / "turns.log").read_text().splitlines()  # noqa: E731
    assert turns("chat") == ["0|first", "1|second", "1|third"]
    assert rows["chat"]["status"] == "ok" and rows["chat"]["turns"] == 3 and rows["chat"]["reward"] == 1.0
    assert turns("broken") == ["0|first", "1|now fail"]
    assert rows["broken"]["status"] == "failed" and rows["broken"]["turns"] == 2
    assert rows["broken"]["exit_code"] == 4 and "(turn 2 of 3)" in rows["broken"]["error"]
    assert rows["slow"]["status"] == "timeout" and rows["slow"]["turns"] == 2 and rows["slow"]["wall_s"] < 10
    logs = sorted(p.name for p in (Path(rows["chat"]["workdir"]).parent / "logs").iterdir())
    assert logs == sorted(f"generic{t}.{s}" for t in ("", ".turn1", ".turn2") for s in ("stdout", "stderr"))


def test_followups_are_validated():
    assert r.task_from_dict({"id": "a", "instruction": "x", "followups": ["y"]}).followups == ["y"]
    for bad in ("y", [""], [3]):
        with pytest.raises(ValueError, match="followups"):
            r.task_from_dict({"id": "a", "instruction": "x", "followups": bad})


def test_result_stores_of_concurrent_groups_gather_at_once(tmp_path):
    """The asynchronous loop makes one ResultStore per group, on one capture dir, and each gathers
    rollouts.parquet when its group ends. A temp name per process made two at once fail
    (FileNotFoundError on the rename: seen in the live asynchronous loop); FAILS with it restored."""
    import threading

    stores = [r.ResultStore(tmp_path) for _ in range(2)]
    stores[0].put(r.sample_key("a", 0, 0), {"task_id": "a", "step": 0, "sample_index": 0, "session_id": "a.st0.s0"})
    errors: list[BaseException] = []

    def gather(store: r.ResultStore) -> None:
        try:
            for _ in range(40):
                store.write_parquet()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=gather, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pl.read_parquet(tmp_path / r.ROLLOUTS_FILE).height == 1


def test_a_step_with_nothing_to_learn_from_runs_again_on_resume(tmp_path):
    """A loop step whose samples all failed with no model call (a vLLM that died) stops the loop;
    its stored results must not be reused by the resumed loop (they failed it again in 0.3 s, and
    only --fresh got past them). A step with a sample that reached the model keeps its results."""
    crashy = make_cfg(tmp_path / "a", [TASKS[3]], samples=2)
    r.run_rollout(crashy)
    store = r.ResultStore(crashy.capture_dir)
    assert r.failure_summary(store.rows(), "generic") and r.plan(crashy, store)[0] == []
    crashy.rerun = r.rerun_if_nothing_to_learn(crashy, store)
    assert [j.sample for j in r.plan(crashy, store)[0]] == [0, 1]

    good = make_cfg(tmp_path / "b", [TASKS[0]], samples=2)
    r.run_rollout(good)
    store = r.ResultStore(good.capture_dir)
    assert r.failure_summary(store.rows(), "generic") is None
    assert r.rerun_if_nothing_to_learn(good, store) == frozenset()
