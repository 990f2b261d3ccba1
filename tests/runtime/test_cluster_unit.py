"""The Ray placement's parts that need no cluster (seconds): one machine never imports Ray, the
``[placement]`` keys are validated, the driver's sample store keeps what it was given, a node's
archive carries its captures and logs but not the work dirs, and a hostile archive cannot write
outside its target."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from polar_runtime.loop import config as c


def test_one_machine_never_imports_ray() -> None:
    code = ("import sys, polar_runtime, polar_runtime.cli, polar_runtime.loop.placement, polar_runtime.loop.loop\n"
            "from polar_runtime.loop import config as c, placement as p\n"
            "cfg = c.parse_config('out = \"/tmp/x\"')\n"
            "p.LocalPlacement(cfg, '/tmp/x')\n"
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_placement_keys_are_validated() -> None:
    cfg = c.parse_config('[placement]\nkind = "ray"\naddress = "auto"\nnode_dir = "/srv/polar"\nreplicas = ["http://a:8000"]\n')
    assert cfg.placement.kind == "ray" and cfg.placement.replicas == ["http://a:8000"] and cfg.placement.max_retries == 2
    for text, words in [('[placement]\nkind = "slurm"\n', "placement.kind"),
                        ('[placement]\nkind = "ray"\nnode_dir = "rel/dir"\n', "must be absolute"),
                        ('[placement]\ntrainer_cpus = 0\n', "trainer_cpus"),
                        ('[harness]\nname = "generic"\n', "harness.command")]:
        with pytest.raises(c.ConfigError, match=words):
            c.parse_config(text)


def test_ray_kind_resolves_to_the_cluster_placement() -> None:
    from polar_runtime.loop.placement import KINDS

    module, _, attr = KINDS["ray"].partition(":")
    pytest.importorskip("ray")
    import importlib

    assert getattr(importlib.import_module(module), attr).__name__ == "RayPlacement"


def test_sample_store_keeps_what_it_was_given(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    import polars as pl

    from polar_runtime.cluster.dispatch import SampleStore

    buf = io.BytesIO()
    pl.DataFrame({"session_id": ["a.st0.s0"], "input_ids": [[1, 2, 3]]}).write_ipc(buf)
    payload = {"row": {"session_id": "a.st0.s0", "sample_index": 0, "attempt": 1}, "versions": {3: 10, 4: 2},
               "trajectory": buf.getvalue(), "stats": {"sampled_tokens": 12}, "node_id": "n1"}
    SampleStore(tmp_path).put(SampleStore.key(0, "a", 0), payload)
    again = SampleStore(tmp_path).get("a.st0.s0")  # a fresh store: read back from disk
    assert again is not None and again["versions"] == {3: 10, 4: 2} and again["node_id"] == "n1"
    assert SampleStore(tmp_path).frame([again])["input_ids"].to_list() == [[1, 2, 3]]
    assert not list(tmp_path.glob(".*tmp"))


def test_archive_carries_captures_and_logs_not_work_dirs(tmp_path: Path) -> None:
    from polar_runtime.cluster.gather import archive_chunks, unpack, visible_node_dirs

    node = tmp_path / "nodes" / "n1"
    (node / "captures" / "sessions").mkdir(parents=True)
    (node / "captures" / "sessions" / "a.st0.s0.jsonl").write_text('{"x": 1}\n')
    (node / "captures" / "work" / "a.st0.s0").mkdir(parents=True)
    (node / "captures" / "work" / "a.st0.s0" / "big").write_text("scratch")
    (node / "logs").mkdir()
    (node / "logs" / "proxy.log").write_text("log")
    (tmp_path / "nodes" / "stray").mkdir()  # no captures: not a node directory
    assert visible_node_dirs(str(tmp_path / "nodes")) == ["n1"]
    files, size = unpack(archive_chunks(str(tmp_path / "nodes"), "n1"), tmp_path / "to" / "n1")
    assert files == 2 and size == len('{"x": 1}\n') + 3
    assert (tmp_path / "to" / "n1" / "sessions" / "a.st0.s0.jsonl").is_file()
    assert (tmp_path / "to" / "n1" / "node-logs" / "proxy.log").read_text() == "log"
    assert not (tmp_path / "to" / "n1" / "work").exists()


def test_unpack_refuses_paths_out_of_its_target(tmp_path: Path) -> None:
    from polar_runtime.cluster.gather import unpack

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("../escape.txt", "ok.txt"):
            data = json.dumps(name).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    files, _ = unpack(iter([buf.getvalue()]), tmp_path / "to")
    assert files == 1 and (tmp_path / "to" / "ok.txt").is_file() and not (tmp_path / "escape.txt").exists()
