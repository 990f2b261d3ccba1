"""The loop's TOML file: every error names the key and its line; the example parses to the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_runtime.loop import config as c


def _err(text: str) -> str:
    with pytest.raises(c.ConfigError) as ei:
        c.parse_config(text, "loop.toml")
    return str(ei.value)


def test_example_parses_to_the_defaults_and_the_demo_configuration() -> None:
    assert c.parse_config(c.example_toml()) == c.LoopConfig()
    from polar_runtime.demo import builtin_config

    # the loop's defaults are the demo's, but where a run goes and whether notebooks run
    demo = builtin_config()
    demo.out, demo.notebooks = c.LoopConfig().out, c.LoopConfig().notebooks
    assert demo == c.LoopConfig()


def test_to_toml_round_trips_any_configuration() -> None:
    cfg = c.LoopConfig(out='runs/a "quoted" \\ dir')
    cfg.tasks.ids, cfg.sampling.max_tokens, cfg.model.gpu, cfg.trainer.kl_coef = ["x", "y"], 64, False, 0.5
    assert c.parse_config(c.to_toml(cfg)) == cfg


def test_a_wrong_type_names_the_key_its_line_and_the_value() -> None:
    text = 'out = "runs/x"\n\n[rollout]\n# groups\nsamples_per_group = "4"\n'
    assert _err(text) == 'loop.toml:5: rollout.samples_per_group must be an integer, got "4" (a string)'
    assert _err("[rollout]\niterations = 1.5\n").startswith("loop.toml:2: rollout.iterations must be an integer")
    assert _err("[harness]\nexact_history = 1\n").startswith("loop.toml:2: harness.exact_history must be true or false")
    assert _err("[tasks]\nids = [1, 2]\n").startswith("loop.toml:2: tasks.ids must be an array of strings")
    assert "trainer must be a table" in _err('trainer = 3\n')
    # a float key takes an integer; a dotted key at the top level has its own line
    assert c.parse_config("[trainer]\nlr = 1\n").trainer.lr == 1.0
    assert _err('notebooks = true\nrollout.samples_per_group = "x"\n').startswith("loop.toml:2: rollout.samples_per_group")


def test_an_unknown_key_names_itself_its_line_and_the_known_ones() -> None:
    msg = _err("[model]\nname = \"m\"\n\n[rollout]\nsample = 4\n")
    assert msg.startswith("loop.toml:5: unknown key 'rollout.sample' (known in rollout: final_rollout, groups_per_step, iterations, samples_per_group)")
    assert _err("[rollouts]\nx = 1\n").startswith("loop.toml:1: unknown key 'rollouts'")
    # the same key name in another table is not mistaken for it
    assert _err("[model]\nname = \"m\"\n[harness]\nname = 3\n").startswith("loop.toml:4: harness.name must be a string")


def test_values_out_of_range_and_syntax_errors() -> None:
    assert _err("[rollout]\nsamples_per_group = 0\n") == "loop.toml:2: rollout.samples_per_group must be >= 1, got 0"
    assert _err("[trainer]\nserver_during_train = \"never\"\n").startswith(
        "loop.toml:2: trainer.server_during_train must be one of auto, keep, stop")
    assert _err("[sampling]\ntemperature = 0.0\n").startswith("loop.toml:2: sampling.temperature must be > 0")
    assert _err("[placement]\nkind = \"slurm\"\n").startswith("loop.toml:2: placement.kind must be")
    assert _err("[rollout\n").startswith("loop.toml: not valid TOML:") and "line 1" in _err("[rollout\n")


def test_key_lines_skip_multiline_values() -> None:
    text = 'a = """\nb = 1\n"""\n[t]\nlist = [\n  "x = 1",\n]\nb = 2\n'
    lines = c.key_lines(text)
    assert lines[("a",)] == 1 and ("b",) not in lines and lines[("t", "b")] == 8


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    p = tmp_path / "x.toml"
    p.write_text("[rollout]\niterations = 3\n")
    assert c.load_config(p).rollout.iterations == 3
    with pytest.raises(c.ConfigError, match="cannot read"):
        c.load_config(tmp_path / "missing.toml")


def test_eval_tasks_of_another_set_parse_and_ids_need_them() -> None:
    cfg = c.parse_config('[eval]\nevery = 2\ntasks = "benchmarks/tasks/transfer/eval"\nids = ["csv-price"]\n')
    assert (cfg.eval.tasks, cfg.eval.ids) == ("benchmarks/tasks/transfer/eval", ["csv-price"])
    assert c.LoopConfig().eval.tasks == ""  # default: the training tasks are evaluated
    assert _err('[eval]\nids = ["x"]\n').startswith("loop.toml:2: eval.ids selects tasks of eval.tasks")


def test_select_tasks_by_id_or_limit_and_refuses_a_missing_one() -> None:
    from types import SimpleNamespace

    from polar_runtime.loop.groups import LoopError
    from polar_runtime.loop.phases import pick_tasks as select_tasks

    ts = [SimpleNamespace(id=i) for i in ("a", "b", "c")]
    assert [t.id for t in select_tasks(ts, "src", ["c", "a"], 0)] == ["a", "c"]
    assert [t.id for t in select_tasks(ts, "src", [], 2)] == ["a", "b"]
    assert [t.id for t in select_tasks(ts, "src", [], 0)] == ["a", "b", "c"]
    with pytest.raises(LoopError, match=r"no task\(s\) \['z'\] in src"):
        select_tasks(ts, "src", ["a", "z"], 0)


def test_eval_tasks_are_part_of_a_runs_identity_and_older_states_read_as_the_default() -> None:
    from polar_runtime.loop.loop import _identity

    cfg = c.parse_config('[eval]\ntasks = "other"\n').to_dict()
    assert _identity(cfg)["eval.tasks"] == "other" != _identity(c.LoopConfig().to_dict())["eval.tasks"]
    older = c.LoopConfig().to_dict()  # a state written before the keys existed
    del older["eval"]["tasks"], older["eval"]["ids"]
    assert _identity(older) == _identity(c.LoopConfig().to_dict())
