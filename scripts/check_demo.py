"""Check what the README's first command produced: ``polar demo``'s report and captures.

CI runs ``.venv/bin/polar demo`` literally (no arguments, from the repository root) and then this
script on ``runs/demo``; a demo that exits 0 but learned nothing must still fail CI. Checked:

* every rollout step captured model calls;
* at least one GRPO step trained on a group with reward variance, and its weights were pushed;
* the calls of the step after each push carry the pushed policy version (read from the captures,
  not from the report);
* the notebooks were executed without an error output.

Prints the demo's phase times. Exit 0 when every check passes, 1 otherwise (each failure named).

    .venv/bin/python scripts/check_demo.py [RUN_DIR]      # default runs/demo
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def check(run: Path) -> list[str]:
    import nbformat

    from polar_analysis import frames
    from polar_analysis.steps import calls_per_step, versions_of_step

    problems: list[str] = []
    report_path = run / "report.json"
    if not report_path.is_file():
        return [f"no report at {report_path}: the demo did not finish"]
    report = json.loads(report_path.read_text())

    print(f"{'phase':<18}{'seconds':>9}  detail")
    for ph in report["phases"]:
        print(f"{ph['name']:<18}{ph['seconds']:>9.1f}  {ph['detail']}")
    print(f"{'total':<18}{report['total_s']:>9.1f}")

    calls = frames.calls(run / "captures", rewards=None).collect()
    per_step = calls_per_step(calls)
    for s in report["steps"]:
        n = per_step.get(s["step"], 0)
        print(f"step {s['step']}: policy v{s['policy_version']}, {n} calls, reward {s['rewards']['mean_reward']}, "
              f"solved {s['rewards']['solved']}/{s['rewards']['samples']}, merges {s['trajectories'].get('merge_kinds')}")
        if n == 0 or not s["rewards"]["calls"]:
            problems.append(f"rollout step {s['step']} captured no calls")

    trained = [t for t in report["training"] if t.get("push") and t.get("groups_with_variance")]
    if not trained:
        problems.append("no GRPO step trained on a group with reward variance and pushed its weights "
                        f"(training: {[t.get('note') for t in report['training']]})")
    for t in trained:
        version, nxt = t["push"]["policy_version"], t["iteration"] + 1
        print(f"train iteration {t['iteration']}: groups with variance {t['groups_with_variance']}, "
              f"pushed as v{version} via {t['push']['method']}")
        if version < 1:
            problems.append(f"iteration {t['iteration']}: pushed policy version {version}")
        seen = set(versions_of_step(calls, nxt))
        if seen != {version}:
            problems.append(f"calls of step {nxt} carry policy versions {sorted(seen, key=str)}, not the pushed v{version}")

    nb_dir = Path(report["paths"].get("notebooks") or run / "notebooks")
    executed = sorted(nb_dir.glob("*.ipynb")) if nb_dir.is_dir() else []
    if len(executed) < 3:
        problems.append(f"notebooks not executed (found {len(executed)} in {nb_dir})")
    for p in executed:
        nb = nbformat.read(p, as_version=4)
        if any(o.output_type == "error" for c in nb.cells if c.cell_type == "code" for o in c.outputs):
            problems.append(f"{p.name} has an error output")
    return problems


def main() -> int:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo").resolve()
    problems = check(run)
    for p in problems:
        print(f"FAIL: {p}")
    print("demo check: " + ("passed" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
