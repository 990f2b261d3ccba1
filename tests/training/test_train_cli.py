"""`polar train`'s command line without a model: its defaults are the config's, and what it
builds from its options (fast: the training itself is replaced)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import typer
from typer.testing import CliRunner

from polar_training import commands
from polar_training.config import AdvantageConfig, LossConfig, TrainConfig

#: CLI parameter -> config field, where the names differ
RENAMED = {"dtype": "compute_dtype"}
#: CLI parameter -> how its default stands for the config's (tis_cap: 0 on the command line is None)
SAME_AS = {"tis_cap": lambda cli, cfg: (cli or None) == cfg}


def _config_defaults() -> dict[str, object]:
    out: dict[str, object] = {}
    for cls in (TrainConfig, AdvantageConfig, LossConfig):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
    return out


def _app() -> typer.Typer:
    app = typer.Typer()
    commands.register(app)
    app.command("noop", hidden=True)(lambda: None)  # a second command: typer keeps "train" as a subcommand
    return app


def test_every_cli_default_equals_the_configs() -> None:
    """Each option of `polar train` that is also a config field defaults to the field's default
    (a CLI default changed alone, e.g. --keep-zero-variance by default, fails here)."""
    cfg = _config_defaults()
    params = inspect.signature(commands.train_command).parameters
    checked = []
    for name, p in params.items():
        field = RENAMED.get(name, name)
        if field not in cfg or p.default is inspect.Parameter.empty:
            continue
        same = SAME_AS.get(name, lambda a, b: a == b)
        assert same(p.default, cfg[field]), f"--{name.replace('_', '-')}: CLI default {p.default!r}, config {cfg[field]!r}"
        checked.append(name)
    assert {"drop_zero_variance", "lr", "clip_high", "tis_cap", "dtype", "scale_std", "max_staleness"} <= set(checked)


def test_the_parsed_command_line_builds_the_default_config(tmp_path, monkeypatch) -> None:
    """Parsed as a user runs it (flag pairs such as --drop-zero-variance/--keep-zero-variance
    included), no options give exactly ``TrainConfig()``."""
    seen = {}

    def fake_run(job, console=None):
        seen["job"] = job
        raise SystemExit(0)

    monkeypatch.setattr("polar_training.run.run_training", fake_run)
    traj = tmp_path / "t.parquet"
    traj.write_bytes(b"")
    res = CliRunner().invoke(_app(), ["train", "--model", str(tmp_path), "-t", str(traj), "-o", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert seen["job"].config == TrainConfig()
    res = CliRunner().invoke(_app(), ["train", "--model", str(tmp_path), "-t", str(traj), "-o", str(tmp_path / "run"),
                                      "--keep-zero-variance", "--tis-cap", "0"])
    assert res.exit_code == 0, res.output
    assert seen["job"].config.adv.drop_zero_variance is False and seen["job"].config.loss.tis_cap is None
