"""Sandbox start-up per sample: ``true`` run through each backend, against no sandbox (issue 23).

Targets, interleaved round by round in a shuffled order (the machine is shared):

* ``none``: the ``host`` backend (a plain subprocess, what Polar did before the sandbox);
* ``bwrap``: bubblewrap, no limits, no proxy;
* ``bwrap+limits``: with pids/memory/CPU limits (a cgroup created and removed per run) and a
  disk cap (tmpfs size, RLIMIT_FSIZE, the work-dir watchdog);
* ``bwrap+proxy``: with the model-proxy relay (host Unix socket + in-sandbox relay) started.

    python benchmarks/bench_sandbox.py [--runs 20]   # prints the table, writes results/sandbox_startup.json
"""

from __future__ import annotations

import argparse
import json
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

from polar_runtime.sandbox import SandboxSpec, get_sandbox  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "sandbox_startup.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
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
    times: dict[str, list[float]] = {k: [] for k in targets}
    notes: dict[str, list[str]] = {}
    for i in range(args.runs + 1):  # round 0 warms the page cache and is not counted
        order = list(targets)
        random.shuffle(order)
        for name in order:
            sb, kw = targets[name]
            spec = SandboxSpec(Path(base) / name / str(i), home_host=Path(base) / "home", env=env, **kw)
            t0 = time.perf_counter()
            res = sb.run(spec, ["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            dt = time.perf_counter() - t0
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
    out = {"machine": f"{platform.machine()} {platform.node()}", "bwrap": subprocess.run(
        ["bwrap", "--version"], capture_output=True, text=True).stdout.strip(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "runs": args.runs, "targets": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    subprocess.run(["rm", "-rf", base], check=False)


if __name__ == "__main__":
    main()
