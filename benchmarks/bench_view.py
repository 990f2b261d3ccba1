"""``polar view`` on a big run: 1,000 samples and 20,000 calls; how long the report takes to write
and how soon the run page paints in headless Chromium (the issue's goal: first paint under 2 s).

    .venv/bin/python benchmarks/bench_view.py                 # writes benchmarks/results/view.json
    .venv/bin/python benchmarks/bench_view.py --samples 100   # a smaller try

The run is made by ``scripts/make_view_fixture.py`` (synthetic calls with tiny-qwen's real
tokenizer and template, the loop's trajectory builder; no flows file and no training step: neither
is read by the run page, and 20,000 flows of growing requests would be ~1 GB), cached under
``--work`` between runs. The page is opened ``--repeats`` times, each in a fresh browser context
(nothing cached), from ``file://``; measured in the page: ``first-contentful-paint`` (the
Performance API), and the moment every plot's canvas exists (``plots_drawn_ms``, from navigation
start). Then a step's table (500 samples) and one sample's page (its chunk loaded by a script tag).
The load average is recorded with the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def make(work: Path, samples: int, calls: int) -> tuple[Path, float]:
    """The run (reused when its parameters match); returns it and the seconds spent making it."""
    from make_view_fixture import make_run

    from polar_core.paths import model_dir_for

    run = work / f"run-{samples}x{calls}"
    made = work / f"run-{samples}x{calls}.made.json"  # how long making it took, kept with it
    if (run / "loop-state.json").is_file() and made.is_file():
        return run, json.loads(made.read_text())["made_s"]
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.perf_counter()
    make_run(run, model_dir_for("tiny-qwen"), samples=samples // 2, steps=2, calls=calls, train=False, flows=False)
    made.write_text(json.dumps({"made_s": time.perf_counter() - t0}))
    return run, time.perf_counter() - t0


def measure_page(index: Path, repeats: int) -> dict:
    from playwright.sync_api import sync_playwright

    loads = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        for _ in range(repeats):
            ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(index.as_uri())
            page.wait_for_selector("body[data-painted=run]")  # every plot drawn (wait_for_function would eval: CSP)
            drawn = page.evaluate("performance.now()")
            fcp = page.evaluate("(performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null")
            t = time.perf_counter()
            page.click("a.step-link")
            page.wait_for_selector("a.sample-link")
            step_ms = (time.perf_counter() - t) * 1000
            rows = page.locator("a.sample-link").count()
            t = time.perf_counter()
            page.locator("a.sample-link").nth(rows // 2).click()
            page.wait_for_selector("a.seq-link")
            sample_ms = (time.perf_counter() - t) * 1000
            loads.append({"first_contentful_paint_ms": fcp, "plots_drawn_ms": drawn, "step_table_ms": step_ms,
                          "step_rows": rows, "sample_page_ms": sample_ms, "errors": errors})
            ctx.close()
        browser.close()
    return {"repeats": loads,
            "median_first_contentful_paint_ms": statistics.median(r["first_contentful_paint_ms"] for r in loads),
            "max_first_contentful_paint_ms": max(r["first_contentful_paint_ms"] for r in loads),
            "median_plots_drawn_ms": statistics.median(r["plots_drawn_ms"] for r in loads),
            "max_plots_drawn_ms": max(r["plots_drawn_ms"] for r in loads),
            "median_step_table_ms": statistics.median(r["step_table_ms"] for r in loads),
            "median_sample_page_ms": statistics.median(r["sample_page_ms"] for r in loads)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=20, help="calls per sample")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/polar-bench-view"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "view.json")
    args = ap.parse_args()
    from polar_runtime.view.chunks import write_report
    from polar_runtime.view.model import RunView

    args.work.mkdir(parents=True, exist_ok=True)
    run, make_s = make(args.work, args.samples, args.calls)
    report = args.work / "report"
    shutil.rmtree(report, ignore_errors=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    view = RunView(run)
    view.refresh()
    summary_s = time.perf_counter() - t0
    write_report(view, report)
    build_s = time.perf_counter() - t0
    calls = sum(1 for n in (run / "captures" / "sessions").iterdir() for _ in n.open("rb"))
    page = measure_page(report / "index.html", args.repeats)
    chunk_sizes = sorted(p.stat().st_size for p in (report / "data" / "samples").iterdir())
    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "run": {"samples": len(view.sample_ids), "calls": calls, "steps": 2, "made_s": round(make_s, 1),
                "bytes": sum(p.stat().st_size for p in run.rglob("*") if p.is_file())},
        "report": {"refresh_s": round(summary_s, 2), "write_s": round(build_s, 2),
                   "run_js_bytes": (report / "data" / "run.js").stat().st_size,
                   "sample_chunk_bytes_median": chunk_sizes[len(chunk_sizes) // 2], "sample_chunk_bytes_max": chunk_sizes[-1]},
        "page": page,
        "goal_first_paint_ms": 2000,
        "meets_goal": page["max_first_contentful_paint_ms"] < 2000 and page["max_plots_drawn_ms"] < 2000,
        "command": "benchmarks/bench_view.py " + " ".join(sys.argv[1:]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("run", "report", "meets_goal")}, indent=1))
    print({k: v for k, v in page.items() if k != "repeats"})


if __name__ == "__main__":
    main()
