"""Sandbox start-up per sample: ``true`` run through each backend, against no sandbox (issue 23),
and, for a root caller, before and after the hardening (issue 34), plus the disk cap's overshoot.

Targets, interleaved round by round in a shuffled order (the machine is shared):

* ``none``: the ``host`` backend (a plain subprocess, what Polar did before the sandbox);
* ``bwrap``: bubblewrap, no limits, no proxy;
* ``bwrap+limits``: with pids/memory/CPU limits (a cgroup created and removed per run) and a
  disk cap (hardened: the loop-mounted disk image; before: tmpfs size, RLIMIT_FSIZE, the watchdog);
* ``bwrap+proxy``: with the model-proxy relay (host Unix socket + in-sandbox relay) started;
* each ``bwrap*`` also ``…/before``: POLAR_SANDBOX_UNHARDENED=1, the configuration before issue 34
  (a root caller's capabilities kept, no user namespace, no seccomp, the disk watchdog).

Overshoot: a phase writing 1 MiB files as fast as it can into its work dir and HOME against a
100 MiB cap; how far past the cap the two together got (before: the watchdog, HOME not counted).

    python benchmarks/bench_sandbox.py [--runs 20] [--fill-rounds 5]   # writes results/sandbox_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_trial.sandbox import SandboxSpec, get_sandbox  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sandbox_startup.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--fill-rounds", type=int, default=5)
    args = ap.parse_args()
    proxy = socket.create_server(("127.0.0.1", 0))  # a port for the relay to point at
    port = proxy.getsockname()[1]
    host, bwrap = get_sandbox("host"), get_sandbox("bubblewrap")
    base = tempfile.mkdtemp(prefix="polar-bench-sandbox-")
    env = {"PATH": "/usr/bin:/bin"}
    targets = {
        "none": (host, {}),
        "bwrap": (bwrap, {}),
        "bwrap+limits": (bwrap, dict(pids=256, memory_mb=2048, cpus=1.0, disk_mb=1024)),
        "bwrap+proxy": (bwrap, dict(proxy_port=port)),
    }
    if os.geteuid() == 0:
        for name in ("bwrap", "bwrap+limits", "bwrap+proxy"):
            targets[name + "/before"] = targets[name]
    times: dict[str, list[float]] = {k: [] for k in targets}
    notes: dict[str, list[str]] = {}
    for i in range(args.runs + 1):  # round 0 warms the page cache and is not counted
        order = list(targets)
        random.shuffle(order)
        for name in order:
            sb, kw = targets[name]
            spec = SandboxSpec(Path(base) / name.replace("/", "-") / str(i), home_host=Path(base) / "home",
                               env=env, **kw)
            unhardened(name.endswith("/before"))
            t0 = time.perf_counter()
            res = sb.run(spec, ["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            dt = time.perf_counter() - t0
            unhardened(False)
            assert res.returncode == 0, (name, res)
            if i:
                times[name].append(dt * 1000)
            notes[name] = res.notes
    proxy.close()
    none_med = statistics.median(times["none"])
    rows = {}
    print(f"{'target':14} {'median ms':>10} {'p90 ms':>8} {'+ms vs none':>12}")
    for name, ts in times.items():
        med = statistics.median(ts)
        p90 = sorted(ts)[int(0.9 * (len(ts) - 1))]
        rows[name] = {"median_ms": round(med, 2), "p90_ms": round(p90, 2),
                      "added_ms": round(med - none_med, 2), "runs": len(ts), "notes": notes[name]}
        print(f"{name:14} {med:10.1f} {p90:8.1f} {med - none_med:12.1f}")
    fill = overshoot(bwrap, base, args.fill_rounds) if os.geteuid() == 0 else {}
    out = {"machine": f"{platform.machine()} {platform.node()}", "bwrap": subprocess.run(
        ["bwrap", "--version"], capture_output=True, text=True).stdout.strip(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load": os.getloadavg()[0],
        "runs": args.runs, "targets": rows, "disk_overshoot": fill}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    subprocess.run(["rm", "-rf", base], check=False)


def unhardened(on: bool) -> None:
    if on:
        os.environ["POLAR_SANDBOX_UNHARDENED"] = "1"
    else:
        os.environ.pop("POLAR_SANDBOX_UNHARDENED", None)


FILL = """i=0; while [ $i -lt 300 ]; do head -c 1M /dev/zero > w$i 2>/dev/null || break
head -c 1M /dev/zero > "$HOME/h$i" 2>/dev/null || break; i=$((i+1)); done"""


def overshoot(bwrap, base: str, rounds: int, cap_mb: int = 100) -> dict:
    """MiB the work dir and HOME held together after a phase that fills both against ``cap_mb``."""
    def used(d: Path) -> float:
        return sum(p.lstat().st_blocks * 512 for p in d.rglob("*")) / 2**20

    out: dict[str, list[float]] = {"before": [], "hardened": []}
    for i in range(rounds):
        for kind in random.sample(list(out), 2):
            work, home = Path(base) / f"fill-{kind}-{i}" / "work", Path(base) / f"fill-{kind}-{i}" / "home"
            work.mkdir(parents=True)
            home.mkdir()
            unhardened(kind == "before")
            bwrap.run(SandboxSpec(work, home_host=home, env={"PATH": "/usr/bin:/bin", "HOME": str(home)},
                                  disk_mb=cap_mb, timeout_s=120), ["/bin/sh", "-c", FILL],
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            unhardened(False)
            out[kind].append(round(used(work) + used(home), 1))
    res = {k: {"used_mib": v, "max_over_cap_mib": round(max(v) - cap_mb, 1)} for k, v in out.items()}
    res["cap_mib"] = cap_mb
    for k, v in res.items():
        if k != "cap_mib":
            print(f"disk fill {k:9}: work dir + HOME reached {v['used_mib']} MiB against {cap_mb} "
                  f"(worst {v['max_over_cap_mib']:+.1f} MiB)")
    return res


if __name__ == "__main__":
    main()
