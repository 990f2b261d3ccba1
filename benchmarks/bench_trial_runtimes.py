"""A live trial on docker and on podman, side by side: the environment's start and one phase's exec,
written as JSON to benchmarks/results/trial_runtimes.json (issue #51's podman figures).

    .venv/bin/python benchmarks/bench_trial_runtimes.py [--rounds 5]

Each runtime as Polar runs it, as root: a private dockerd (``--userns-remap``, btrfs data root,
no log) and a podman store of Polar's own (``podmanroot.py``: btrfs, runc, ``--userns=auto``),
both started in temporary dirs and stopped at the end. The image is the debian:bookworm stand-in
on both. Per round and runtime (the order shuffled each round): a trial started (``disk_mb`` 256:
the work dir's disk image and the storage cap, as a rollout's), then ``phases`` agent phases
running ``true`` and as many verifier phases, then the trial stopped. The first podman trial in a
store is reported apart: ``--userns=auto`` makes each new id range its own chowned copy of the
image (kept for the next container that gets the same range), and a second trial at once gets a
second range, which is timed too (``podman.concurrent_start_s``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

IMAGE = "debian:bookworm"


def _trial_round(backend, work: Path, phases: int) -> dict:
    from polar_trial.sandbox import SandboxSpec
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig

    spec = SandboxSpec(workdir_host=work, env={"PATH": "/usr/bin:/bin"}, timeout_s=60)
    trial = LiveTrial(backend, TrialConfig(image=IMAGE, workdir_host=work, disk_mb=256))
    t0 = time.monotonic()
    try:
        trial.start(spec)
        start = time.monotonic() - t0
        walls: dict[str, list[float]] = {"agent": [], "verifier": []}
        for _ in range(phases):
            for phase in ("agent", "verifier"):
                t = time.monotonic()
                res = trial.view(phase).run(spec, ["true"])
                assert res.returncode == 0, res
                walls[phase].append(time.monotonic() - t)
    finally:
        t = time.monotonic()
        trial.stop()
        stop = time.monotonic() - t
    return {"start_s": start, "stop_s": stop, **{f"{p}_exec_s": w for p, w in walls.items()}}


def _concurrent_podman(backend, tmp: Path) -> float:
    """A second trial started while one runs: it gets the next id range (a fresh copy of the image)."""
    from polar_trial.sandbox.trial import LiveTrial, TrialConfig

    with LiveTrial(backend, TrialConfig(image=IMAGE, workdir_host=tmp / "c0")) as first:
        first.start()
        second = LiveTrial(backend, TrialConfig(image=IMAGE, workdir_host=tmp / "c1"))
        t0 = time.monotonic()
        try:
            second.start()
            return time.monotonic() - t0
        finally:
            second.stop()


def main() -> None:
    from polar_trial.sandbox import standin
    from polar_trial.sandbox.docker import DockerSandbox
    from polar_trial.sandbox.dockerd import PrivateDockerd
    from polar_trial.sandbox.podman import PodmanSandbox
    from polar_trial.sandbox.podmanroot import PodmanRoot

    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    phases = 5
    tmp = Path(tempfile.mkdtemp(prefix="pbt-", dir="/tmp"))
    dockerd, store = PrivateDockerd(tmp / "d"), PodmanRoot(tmp / "p", data_quota_gb=8)
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} cores",
                 "load_avg": round(os.getloadavg()[0], 1), "rounds": rounds, "phases_per_round": phases, "image": IMAGE}
    try:
        t = time.monotonic()
        dockerd.start()
        out["dockerd_start_s"] = round(time.monotonic() - t, 2)
        os.environ["DOCKER_HOST"] = dockerd.host
        t = time.monotonic()
        store.start(install=False)
        store.use()
        out["podman_store_start_s"] = round(time.monotonic() - t, 2)
        backends = {"docker": DockerSandbox(), "podman": PodmanSandbox()}
        for name in backends:
            out[name] = {"import_s": standin.ensure_image(IMAGE, runtime=name)["import_s"]}
        runs: dict[str, list[dict]] = {n: [] for n in backends}
        for r in range(rounds + 1):  # round 0: each runtime's first trial (podman: a new id range)
            order = list(backends)
            random.shuffle(order)
            for name in order:
                runs[name].append(_trial_round(backends[name], tmp / f"w-{name}-{r}", phases))
        for name, rows in runs.items():
            warm = rows[1:]
            out[name].update({
                "first_start_s": round(rows[0]["start_s"], 2),
                "start_s_median": round(statistics.median(x["start_s"] for x in warm), 2),
                "stop_s_median": round(statistics.median(x["stop_s"] for x in warm), 2),
                "agent_exec_ms_median": round(1000 * statistics.median(v for x in warm for v in x["agent_exec_s"])),
                "verifier_exec_ms_median": round(1000 * statistics.median(v for x in warm for v in x["verifier_exec_s"])),
            })
        out["podman"]["concurrent_start_s"] = round(_concurrent_podman(backends["podman"], tmp), 2)
    finally:
        os.environ.pop("DOCKER_HOST", None)
        dockerd.stop()
        store.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    out["load_avg_end"] = round(os.getloadavg()[0], 1)
    dest = REPO / "benchmarks" / "results" / "trial_runtimes.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
