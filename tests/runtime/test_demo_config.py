"""``polar demo`` is the loop with a built-in configuration: the configuration is the documented demo
defaults, every flag sets its key, ``--print-config`` prints what runs, and the run directory is
resumed when interrupted, replaced when finished. Fast: no server starts."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_runtime import demo
from polar_runtime.cli import app
from polar_runtime.loop.config import LoopConfig, parse_config
from polar_runtime.loop.state import LoopState
from polar_training.config import LossConfig

#: The demo's defaults as the README and `polar demo --help` document them (CPU): 2 built-in coding
#: tasks x 4 samples of Pi on the 0.5B, one update, answers capped at 256 tokens, 150 s per run.
DOCUMENTED = {
    "out": "runs/demo", "notebooks": True,
    "model": {"name": "qwen2.5-coder-0.5b-instruct", "max_model_len": 16384, "kv_cache_gib": 1.0,
              "tool_parser": "lenient", "gpu": None},
    "harness": {"name": "pi-chat", "timeout_s": None, "concurrency": 2, "exact_history": True, "command": ""},
    "tasks": {"source": "coding", "ids": [], "limit": 2},
    "rollout": {"samples_per_group": 4, "groups_per_step": 0, "iterations": 1, "final_rollout": True},
    "sampling": {"temperature": 1.0, "seed": 0, "max_tokens": None},
    "trainer": {"lr": 1e-6, "kl_coef": None, "lora_rank": 0, "server_during_train": "auto", "keep_checkpoints": 2},
    "eval": {"every": 0, "samples": 4, "tasks": "", "ids": []},
    "sandbox": {"backend": "auto", "pids": 4096, "allow_internet": False},
    "placement": {"kind": "local", "address": "", "node_dir": "", "node_resource": "", "replicas": [],
                  "trainer_cpus": 1, "trainer_gpus": 0, "max_retries": 2},
    "schedule": {"max_off_policy_steps": 0, "groups_in_flight": 0},
}

#: A value other than the built-in one for every flag: (command-line words, key, value in the config).
FLAGS = [
    (["--harness", "claude-code"], "harness.name", "claude-code"),
    (["--model", "tiny-qwen"], "model.name", "tiny-qwen"),
    (["--tasks", "t.jsonl"], "tasks.source", "t.jsonl"),
    (["--task", "a", "--task", "b"], "tasks.ids", ["a", "b"]),
    (["--n-tasks", "5"], "tasks.limit", 5),
    (["--samples", "3"], "rollout.samples_per_group", 3),
    (["--iterations", "4"], "rollout.iterations", 4),
    (["--max-tokens", "64"], "sampling.max_tokens", 64),
    (["--temperature", "0.7"], "sampling.temperature", 0.7),
    (["--seed", "-1"], "sampling.seed", -1),
    (["--timeout", "33"], "harness.timeout_s", 33.0),
    (["--concurrency", "3"], "harness.concurrency", 3),
    (["--lr", "2e-5"], "trainer.lr", 2e-5),
    (["--kl-coef", "0.25"], "trainer.kl_coef", 0.25),
    (["--max-model-len", "4096"], "model.max_model_len", 4096),
    (["--tool-parser", "hermes"], "model.tool_parser", "hermes"),
    (["--server-during-train", "keep"], "trainer.server_during_train", "keep"),
    (["--gpu"], "model.gpu", True),
    (["--no-notebooks"], "notebooks", False),
    (["--lora-rank", "8"], "trainer.lora_rank", 8),
    (["--no-exact-history"], "harness.exact_history", False),
    (["--eval-every", "2"], "eval.every", 2),
    (["--eval-samples", "6"], "eval.samples", 6),
]


def _get(cfg: LoopConfig, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _printed(args: list[str]) -> LoopConfig:
    res = CliRunner().invoke(app, ["demo", *args, "--print-config"])
    assert res.exit_code == 0, res.output
    return parse_config(res.stdout, "printed")


def test_builtin_config_is_the_documented_demo_defaults() -> None:
    cfg = demo.builtin_config()
    assert cfg.to_dict() == DOCUMENTED
    cfg.model.gpu = False  # what the absent keys resolve to on a CPU
    assert (cfg.resolved_max_tokens(), cfg.resolved_timeout(), cfg.resolved_kl_coef()) == (256, 150.0, 0.0)
    cfg.rollout.iterations = 2  # a second update starts away from the reference: the recipe's KL
    assert cfg.resolved_kl_coef() == LossConfig.kl_coef


def test_print_config_without_flags_runs_the_builtin_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _printed([])
    assert cfg.out == str(tmp_path / "runs" / "demo")  # resolved once, against the cwd
    cfg.out = "runs/demo"
    assert cfg == demo.builtin_config()


@pytest.mark.parametrize("words,key,value", FLAGS, ids=[f[1] for f in FLAGS])
def test_each_demo_flag_sets_its_key_and_only_it(words: list[str], key: str, value, tmp_path: Path) -> None:
    base = _printed(["--out", str(tmp_path)])
    cfg = _printed(["--out", str(tmp_path), *words])
    assert _get(cfg, key) == value
    section, _, field = key.rpartition(".")
    target = _get(base, section) if section else base
    setattr(target, field, value)
    assert cfg == base  # nothing else moved


def test_every_flag_is_mapped_or_named_as_the_demos_own() -> None:
    own = {"keep", "fresh", "checkpoint_every", "print_config"}  # the run directory, a kept no-op, printing
    params = set(inspect.signature(demo.demo_command).parameters)
    assert params - own == set(demo.FLAG_KEYS)
    assert {f"{k}" for k in (".".join(v) for v in demo.FLAG_KEYS.values())} == {key for _, key, _ in FLAGS} | {"out"}


def test_a_flag_out_of_range_is_refused_with_its_key(tmp_path: Path) -> None:
    from polar_runtime.loop.config import ConfigError

    with pytest.raises(ConfigError, match="trainer.server_during_train must be one of auto, keep, stop"):
        demo.demo_config(server_during_train="sometimes")
    res = CliRunner().invoke(app, ["demo", "--out", str(tmp_path), "--server-during-train", "sometimes", "--print-config"])
    assert res.exit_code == 2 and "server_during_train" in res.output


def _state(out: Path, next_step: int, pending: dict | None = None) -> None:
    LoopState(next_step=next_step, pending=pending).save(out)
    (out / "captures").mkdir()


def test_an_interrupted_run_is_resumed_and_a_finished_one_replaced(tmp_path: Path) -> None:
    cfg = demo.builtin_config()  # iterations = 1: steps 0 and 1
    out = tmp_path / "run"
    out.mkdir()
    _state(out, next_step=1)
    demo.prepare_out(cfg, out, keep=False, fresh=False)
    assert (out / "captures").is_dir()  # resumed: nothing removed
    (out / "loop-state.json").unlink()
    LoopState(next_step=1, pending={"step": 0}).save(out)
    demo.prepare_out(cfg, out, keep=False, fresh=False)
    assert (out / "captures").is_dir()  # a trained step whose push was cut: resumed too
    LoopState(next_step=2).save(out)
    demo.prepare_out(cfg, out, keep=True, fresh=False)
    assert (out / "captures").is_dir()  # finished, --keep
    demo.prepare_out(cfg, out, keep=False, fresh=False)
    assert not (out / "captures").exists() and (out / "logs").is_dir()  # finished: replaced
    _state(out, next_step=0)
    demo.prepare_out(cfg, out, keep=False, fresh=True)
    assert not (out / "captures").exists()  # --fresh: removed though interrupted
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()


def test_fresh_stops_what_a_killed_run_left_running_before_removing_its_record(tmp_path: Path) -> None:
    import subprocess

    from polar_runtime.loop.placement import ChildRecord

    out = tmp_path / "run"
    _state_dir = out / "captures"
    _state_dir.mkdir(parents=True)
    LoopState(next_step=0).save(out)
    left = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a vLLM a kill -9 left behind
    try:
        ChildRecord(out).add("vllm", left.pid, group=True)
        demo.prepare_out(demo.builtin_config(), out, keep=False, fresh=True)
        assert left.wait(10) == -9 and not _state_dir.exists()
    finally:
        if left.poll() is None:
            left.kill()
            left.wait()
