"""The transfer task family of issue 41 (``benchmarks/tasks/transfer/``): the files are generate.py's
output, train and eval sets are disjoint, the eval kinds are what the manifest says (seconds; the
oracle/nop check of every task is ``polar tasks check`` on the four sets, see benchmarks/history/transfer.md)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_testing.benchmarks import BENCHMARKS, load_benchmark

FAMILY = BENCHMARKS / "tasks" / "transfer"


@pytest.fixture(scope="module")
def bt():
    return load_benchmark("bench_transfer")


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("transfer_generate", FAMILY / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", params=["shell", "trivia"])
def family(request, bt):
    fam = bt.manifest(request.param)
    return request.param, fam, *bt.load_family(fam)


def test_the_files_are_generate_py_output(gen) -> None:
    assert gen.differences(FAMILY) == [], "run benchmarks/tasks/transfer/generate.py and commit its output"


def test_the_family_is_fit_to_measure_transfer(family, bt) -> None:
    name, fam, train, evals = family
    assert bt.family_problems(fam, train, evals) == []
    if name == "shell":
        assert len(train) >= 8 and len(evals) >= 4
        kinds = [e["kind"] for e in fam["eval"]]
        assert kinds.count("new-operation") * 2 >= len(kinds) and "same-operation" in kinds
        # what the task directories say of themselves agrees with the manifest
        import tomllib

        for side, entries in (("train", fam["train"]), ("eval", fam["eval"])):
            for e in entries:
                meta = tomllib.loads((FAMILY / side / e["id"] / "task.toml").read_text())["metadata"]
                assert meta["operation"] == e["operation"] and meta.get("kind", "") == e.get("kind", "")
    else:
        assert len(train) >= 4 and len(evals) >= 4
    assert {t.id for t in train}.isdisjoint(t.id for t in evals)


def test_a_broken_family_is_named_task_by_task(family, bt) -> None:
    name, fam, train, evals = family
    broken = copy.deepcopy(fam)
    twin = SimpleNamespace(id="twin", instruction="  " + train[0].instruction.upper() + " ")
    bad = [*evals, twin, SimpleNamespace(id=train[1].id, instruction="something new")]
    broken["eval"] += [{"id": "twin", "operation": "x", "kind": "same-operation"},
                       {"id": train[1].id, "operation": fam["train"][0]["operation"], "kind": "new-operation"},
                       {"id": "ghost", "operation": fam["train"][0]["operation"], "kind": "other"}]
    got = bt.family_problems(broken, train, bad)
    assert f"eval task twin has the instruction of train task {train[0].id}" in got
    assert f"eval task {train[1].id} has a train task's id" in got
    assert "eval task twin is marked same-operation but no train task asks 'x'" in got
    assert f"eval task {train[1].id} is marked new-operation but train tasks ask {fam['train'][0]['operation']!r}" in got
    assert "eval task ghost of the manifest does not load" in got and "eval task ghost has no kind" in " ".join(got)
    if name == "shell":  # too few new operations
        few = copy.deepcopy(fam)
        few["eval"] = [e for e in few["eval"] if e["kind"] == "same-operation"] + few["eval"][-1:]
        keep = {e["id"] for e in few["eval"]}
        assert any("eval tasks are new-operation" in p for p in
                   bt.family_problems(few, train, [t for t in evals if t.id in keep]))


def test_every_task_has_an_oracle_and_a_hidden_verifier(family) -> None:
    _, _, train, evals = family
    for t in [*train, *evals]:
        assert t.has_solution and t.has_tests and t.instruction.strip(), t.id
        assert len(t.instruction) < 200, f"{t.id}: keep instructions short for a 0.5B model"
