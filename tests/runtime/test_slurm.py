"""`polar slurm`: the sbatch template renders to valid bash with the given values, refuses holes
and bad values, and, run against stand-ins for srun/scontrol/ray/polar, starts the Ray head first,
the workers with its address, waits for every node, then runs `polar loop CONFIG`."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from polar_runtime.cli import app
from polar_runtime.loop.slurm import TEMPLATE, SlurmJob, TemplateError, render


def job_config(tmp_path: Path) -> Path:
    return tmp_path / "my runs" / "loop.toml"


def _job(tmp_path: Path, **kw) -> SlurmJob:
    cfg = job_config(tmp_path)  # a space: the path must reach the loop quoted
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[placement]\nkind = "ray"\naddress = "auto"\n')
    return SlurmJob(**{"config": cfg, "nodes": 3, "cpus_per_node": 8, "venv": tmp_path / "venv",
                       "log_dir": tmp_path / "logs", **kw})


def test_rendered_script_is_bash_with_the_values(tmp_path):
    job = _job(tmp_path, gpus_per_node=2, time="1-02:00:00", partition="gpu", account="rl-team")
    script = render(job)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    assert "{{" not in script
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["#SBATCH --job-name=polar-loop", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                          "#SBATCH --cpus-per-task=8", "#SBATCH --time=1-02:00:00",
                          f"#SBATCH --output={tmp_path / 'logs'}/polar-loop-%j.out", "#SBATCH --gpus-per-node=2",
                          "#SBATCH --partition=gpu", "#SBATCH --account=rl-team"]
    # the shell sees the values as given (quoted where they are paths)
    head = script.split("PYTHON=", 1)[0].split("set -euo pipefail", 1)[1]
    out = subprocess.run(["bash", "-c", head + 'printf "%s|" "$VENV" "$CONFIG" "$NODES" "$CPUS" "$GPUS" "$RAY_PORT"'],
                         capture_output=True, text=True, check=True).stdout
    assert out == f"{tmp_path / 'venv'}|{job.config}|3|8|2|6379|"
    assert "--gpus-per-node" not in render(_job(tmp_path))  # no GPUs: none requested


def test_holes_and_bad_values_are_refused(tmp_path):
    with pytest.raises(TemplateError, match="nobody fills: site_setup"):
        render(_job(tmp_path), TEMPLATE.read_text() + "\n{{site_setup}}\n")
    for bad in ({"time": "4h"}, {"nodes": 0}, {"cpus_per_node": "8"}, {"job_name": "a b"}, {"partition": "x;rm"},
                {"gpus_per_node": -1}):
        with pytest.raises(TemplateError):
            render(_job(tmp_path, **bad))
    # a template of one's own may leave values unused
    assert render(_job(tmp_path), "#!/bin/bash\necho {{nodes}}\n") == "#!/bin/bash\necho 3\n"


def _exe(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


FAKE_RAY = '''import os
def _log(line):
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(line + "\\n")
def init(address=None, **kw):  # like Ray's: refused until the head is up
    if not nodes():
        raise ConnectionError("no head yet")
    _log(f"driver connects to {address}")
def nodes():  # the nodes that have joined so far
    with open(os.environ["STUB_LOG"]) as f:
        return [{"Alive": True} for line in f if line.endswith(" joined\\n")]
def shutdown():
    pass
'''


@pytest.fixture
def stubs(tmp_path):
    """srun/scontrol/hostname on PATH and a venv whose ray/polar/python log what they are asked."""
    bin_, venv = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_.mkdir()
    venv.mkdir(parents=True)
    (tmp_path / "fakeray" / "ray").mkdir(parents=True)
    (tmp_path / "fakeray" / "ray" / "__init__.py").write_text(FAKE_RAY)
    log = tmp_path / "stub.log"
    log.touch()
    _exe(bin_ / "scontrol", '#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "n1\\nn2\\nn3\\n"\n')
    _exe(bin_ / "hostname", '#!/bin/bash\necho "10.1.2.3 fe80::1"\n')
    _exe(bin_ / "srun", '#!/bin/bash\nwhile [ $# -gt 0 ]; do case "$1" in -w) host=$2; shift 2;; -*) shift;; *) break;; '
                        'esac; done\nSTUB_HOST=$host exec "$@"\n')
    # a node joins a second after its `ray start`: a script that did not wait would run the loop first
    _exe(venv / "ray", '#!/bin/bash\necho $$ >> "$STUB_LOG.pids"\necho "$STUB_HOST ray $*" >> "$STUB_LOG"\n'
                       'sleep 1\necho "$STUB_HOST joined" >> "$STUB_LOG"\nexec sleep 300\n')
    _exe(venv / "polar", '#!/bin/bash\necho "polar $* RAY_ADDRESS=$RAY_ADDRESS" >> "$STUB_LOG"\nexit "${STUB_RC:-0}"\n')
    _exe(venv / "python", f'#!/bin/bash\nPYTHONPATH={tmp_path / "fakeray"} exec {sys.executable} "$@"\n')
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "STUB_LOG": str(log), "SLURM_JOB_NODELIST": "n[1-3]"}
    return env, log


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _run(tmp_path: Path, env: dict, **kw) -> subprocess.CompletedProcess:
    script = tmp_path / "job.sbatch"
    script.write_text(render(_job(tmp_path, **kw)))
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)


def test_script_starts_the_head_then_the_workers_waits_for_all_then_runs_the_loop(tmp_path, stubs):
    env, log = stubs
    res = _run(tmp_path, env)
    assert res.returncode == 0, res.stderr
    lines = log.read_text().splitlines()
    assert lines.index(f"polar loop {job_config(tmp_path)} RAY_ADDRESS=10.1.2.3:6379") > max(
        lines.index(f"{h} joined") for h in ("n1", "n2", "n3"))  # the loop starts once every node is in
    lines = [line for line in lines if not line.endswith(" joined")]
    head = "n1 ray start --head --node-ip-address=10.1.2.3 --port=6379 --num-cpus=8 --num-gpus=0 --block"
    workers = {f"{h} ray start --address=10.1.2.3:6379 --num-cpus=8 --num-gpus=0 --block" for h in ("n2", "n3")}
    # the head first, a driver waits for it, then the workers, a driver waits for all three
    driver = "driver connects to 10.1.2.3:6379"
    assert lines[:2] == [head, driver] and lines.count(driver) == 2
    assert set(lines[2:5]) - {driver} == workers  # (the second driver may log before a worker's stub)
    assert lines[-1] == f"polar loop {job_config(tmp_path)} RAY_ADDRESS=10.1.2.3:6379"
    assert "polar: 1 Ray node(s) up" in res.stdout and "polar: 3 Ray node(s) up" in res.stdout
    # the Ray steps ended with the job (the trap killed them)
    pids = [int(p) for p in Path(f"{log}.pids").read_text().split()]
    assert len(pids) == 3 and not [p for p in pids if _alive(p)]
    env["STUB_RC"] = "3"  # the loop's exit status is the job's
    assert _run(tmp_path, env).returncode == 3


def test_script_refuses_an_allocation_of_another_size(tmp_path, stubs):
    env, log = stubs
    res = _run(tmp_path, env, nodes=2)
    assert res.returncode == 2 and "has 3 node(s), the script was rendered for 2" in res.stderr
    assert log.read_text() == ""  # nothing started


def test_cli_writes_the_script(tmp_path):
    job = _job(tmp_path)
    out = tmp_path / "job.sbatch"
    res = CliRunner().invoke(app, ["slurm", str(job.config), "--nodes", "2", "--cpus-per-node", "4", "--time", "30",
                                   "--log-dir", str(tmp_path),
                                   "-o", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "#SBATCH --nodes=2" in out.read_text() and os.access(out, os.X_OK)
    bad = tmp_path / "bad.tmpl"
    bad.write_text("{{nope}}")
    res = CliRunner().invoke(app, ["slurm", str(job.config), "--nodes", "2", "--cpus-per-node", "4",
                                   "--log-dir", str(tmp_path), "--template", str(bad)], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "nope" in res.output
