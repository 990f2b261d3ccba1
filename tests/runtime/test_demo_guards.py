"""The main job's guards, fast: relative paths become absolute before any child sees them, a step
that captured nothing stops the demo with the harness's own error, and a step without a learning
signal is skipped instead of trained."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from polar_runtime import demo
from polar_runtime import harnesses as h
from polar_runtime import rollout as r
from polar_runtime.loop.groups import groups_with_variance


def _row(sid: str, status: str, reward: float | None, calls: int, error: str | None = None,
         workdir: str = "/runs/x/captures/work/S/work", task: str = "t", sample: int = 0) -> dict:
    return dict(session_id=sid, task_id=task, sample_index=sample, group_id=f"{task}.st0", status=status,
                reward=reward, calls=calls, error=error, exit_code=1 if status == "failed" else 0,
                harness="pi-chat", workdir=workdir)


def test_failure_summary_names_the_harness_the_first_error_and_its_stderr_log() -> None:
    rows = [_row("t.st0.s1", "failed", None, 0, "later error", sample=1),
            _row("t.st0.s0", "failed", None, 0, '\nError: Model "polar/qwen" not found\n  at main', sample=0,
                 workdir="/runs/demo/captures/work/t.st0.s0/work")]
    msg = r.failure_summary(rows, "pi-chat")
    assert msg is not None
    assert msg.startswith("pi-chat: all 2 samples failed or timed out and no model call was captured")
    assert 'First sample t.st0.s0: Error: Model "polar/qwen" not found' in msg  # the first line, not the stack
    assert "stderr log: /runs/demo/captures/work/t.st0.s0/logs/pi-chat.stderr" in msg

    # exit 0 but nothing reached the proxy: as useless for training, and said so
    quiet = r.failure_summary([_row("a", "ok", 0.0, 0), _row("b", "ok", 1.0, 0, sample=1)], "pi-chat")
    assert quiet is not None and "no model call was captured" in quiet and "failed" not in quiet.split(".")[0]
    # one timeout among successes is a normal step
    assert r.failure_summary([_row("a", "timeout", 0.0, 3), _row("b", "ok", 1.0, 2, sample=1)], "pi-chat") is None
    # every sample timed out, with calls captured: still nothing the trainer can use
    assert "all 1 samples failed" in (r.failure_summary([_row("a", "timeout", 0.0, 3)], "pi-chat") or "")
    assert r.failure_summary([], "pi-chat") == "pi-chat: no samples ran"


def test_groups_with_variance_counts_only_samples_that_take_part() -> None:
    df = pl.DataFrame([
        _row("a0", "ok", 1.0, 2, task="a"), _row("a1", "ok", 0.0, 2, task="a", sample=1),  # signal
        _row("b0", "ok", 1.0, 2, task="b"), _row("b1", "ok", 1.0, 2, task="b", sample=1),  # all equal
        _row("c0", "ok", 1.0, 2, task="c"), _row("c1", "timeout", 0.0, 2, task="c", sample=1),  # 1 participant
        _row("d0", "ok", 0.0, 2, task="d"), _row("d1", "ok", 1.0, 0, task="d", sample=1),  # no calls captured
        _row("e0", "ok", None, 2, task="e"), _row("e1", "ok", 1.0, 2, task="e", sample=1),  # no verdict
    ])
    assert groups_with_variance(df.to_dicts()) == ["a.st0"]
    assert groups_with_variance(df.filter(pl.col("task_id") != "a").to_dicts()) == []


def test_relative_paths_become_absolute_at_every_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert demo.demo_config(out=Path("runs/demo")).out == str(tmp_path / "runs" / "demo")
    ep = h.Endpoint(mode="proxy", proxy_url="http://127.0.0.1:9", ca_cert=Path("ca.pem"))
    assert ep.ca_cert == tmp_path / "ca.pem"
    cfg = r.RolloutConfig(tasks=[], preset=h.get_preset("generic", "true"), endpoint=ep,
                          capture_dir=Path("runs/x"), model="m", work_root=Path("w"))
    assert (cfg.capture_dir, cfg.work) == (tmp_path / "runs" / "x", tmp_path / "w")
    monkeypatch.setenv("POLAR_HOME", "cache")
    assert h.paths.polar_home() == tmp_path / "cache"


@pytest.mark.parametrize("preset", sorted(h.presets()))
@pytest.mark.parametrize("mode", ["base_url", "proxy"])
def test_every_path_a_harness_is_given_is_absolute(preset: str, mode: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A preset prepared from relative dirs (as `polar demo` had them) hands the harness only absolute
    paths: its cwd, every env var naming a file or directory, every path inside the config files it
    writes for the harness. The harness runs in its work dir, where a relative HOME points nowhere."""
    monkeypatch.chdir(tmp_path)
    ep = h.Endpoint(mode=mode, base_url="http://127.0.0.1:9", proxy_url="http://127.0.0.1:9", ca_cert=Path("ca.pem"))
    session = h.Session(session_id="t.st0.s0", task="do it", workdir=Path("runs/demo/work/t/work"),
                        home=Path("runs/demo/work/t/home"), model="m", endpoint=ep)
    session.workdir.mkdir(parents=True)
    inv = h.get_preset(preset).prepare(session)
    assert Path(inv.cwd).is_absolute() and Path(inv.cwd) == tmp_path / "runs/demo/work/t/work"
    for key, value in inv.env.items():
        if key in ("PATH", "NODE_PATH") or "://" in value:
            continue
        if "/" in value:
            assert Path(value).is_absolute(), f"{preset}: {key}={value!r} is relative"
    home = tmp_path / "runs/demo/work/t/home"
    assert inv.env["HOME"] == str(home)
    for written in home.rglob("*"):  # config files the preset wrote for the harness
        if written.is_file() and written.suffix in (".json", ".toml", ".jsonc"):
            text = written.read_text()
            assert "runs/demo" not in text.replace(str(tmp_path / "runs/demo"), ""), f"{written}: {text[:300]}"


def test_memory_estimate_covers_the_measured_peaks_without_asking_for_what_is_freed(qwen05_dir) -> None:
    """Measured on the 0.5B in float32: 12.6 GB (11.7 GiB) peak on a fresh step, 10.4 GiB on a
    resumed step with KL since the reference is freed before the first backward and large buffers
    are mapped directly (18.4 GiB before). The estimate decides whether vLLM is stopped during a
    step, so it must not undershoot, nor ask for the 18.9 GiB it did while both were kept."""
    from polar_runtime.loop.phases import train_memory_estimate

    need = train_memory_estimate(qwen05_dir) / 2**30
    assert 11.7 <= need < 13
