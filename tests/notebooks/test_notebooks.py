"""The three notebooks execute headless on the committed real capture, their plots render, and what
they print and tabulate is what the capture holds (calls, tokens, policy versions, solved counts,
the trainer's metrics), counted here straight from the committed files.

The capture (tests/fixtures/demo-run, see its README) was recorded once by ``polar demo`` through the
real proxy, a real vLLM and the real Pi harness, with a real ``polar train`` metrics file. The
notebooks run on a copy, so the frames' Parquet cache never lands in the checkout. Jupyter's config,
data and runtime dirs are temporary (tests/conftest.py).
"""

from __future__ import annotations

import base64
import html as html_lib
import io
import json
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from polar_core.paths import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "demo-run"
#: For development: run the notebooks on another run directory instead of the fixture.
RUN_OVERRIDE = os.environ.get("POLAR_TEST_NOTEBOOK_RUN")
#: Plots each notebook draws (every one must come out as a non-empty PNG).
PLOTS = {"01_captures_overview": 5, "02_trajectory_debugger": 1, "03_training": 3}


def test_three_notebooks_are_committed_without_outputs() -> None:
    names = [p.name for p in NOTEBOOKS]
    assert names == ["01_captures_overview.ipynb", "02_trajectory_debugger.ipynb", "03_training.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [], f"{path.name}: committed with outputs (clear them)"
                assert cell.execution_count is None, f"{path.name}: committed with execution counts"
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: needs exactly one cell tagged 'parameters'"
        assert "POLAR_RUN_DIR" in tagged[0].source and nb.cells.index(tagged[0]) <= 1


def test_fixture_is_small_and_real() -> None:
    size = sum(p.stat().st_size for p in FIXTURE.rglob("*") if p.is_file())
    assert size < 2 * 2**20, f"fixture is {size / 2**20:.2f} MiB"
    sessions = list((FIXTURE / "captures" / "sessions").glob("*.jsonl"))
    assert len(sessions) >= 3
    records = [json.loads(line) for p in sessions for line in p.read_text().splitlines()]
    import polars as pl

    rollouts = pl.read_parquet(FIXTURE / "captures" / "rollouts.parquet")
    assert set(rollouts["harness"]) == {"pi-chat"}  # Pi, through the OpenAI SDK (its user agent)
    assert {r["session_id"] for r in records} == set(rollouts["session_id"])
    assert max(sum(1 for r in records if r["session_id"] == s) for s in rollouts["session_id"]) > 2  # multi-turn
    assert {r["policy_version"] for r in records} == {0, 1}  # before and after the weight push
    assert all(r["served_model"] == "qwen2.5-coder-0.5b-instruct" for r in records)
    assert any(len(r["prompt_token_ids"]) > 1000 and r["sampled_token_ids"] for r in records)
    assert (FIXTURE / "train" / "metrics.jsonl").read_text().strip()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if RUN_OVERRIDE:
        return Path(RUN_OVERRIDE).resolve()
    target = tmp_path_factory.mktemp("notebook-run") / "demo-run"
    shutil.copytree(FIXTURE, target, ignore=shutil.ignore_patterns(".polar-cache"))
    return target


@pytest.fixture(scope="module")
def executed(run_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Each notebook executed once on the run (lazily), shared by the tests below."""
    cache: dict[str, nbformat.NotebookNode] = {}

    def get(path: Path) -> nbformat.NotebookNode:
        if path.stem not in cache:
            cache[path.stem] = _execute(path, run_dir, tmp_path_factory.mktemp(path.stem))
        return cache[path.stem]

    return get


def _execute(path: Path, run: Path, cwd: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    os.environ["POLAR_RUN_DIR"] = str(run)
    try:
        # a cell's limit is a hang guard, not a speed claim: the debugger's trajectory cell takes
        # ~5 s on a quiet machine and passed 120 s at load 15 (two test suites beside it)
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        os.environ.pop("POLAR_RUN_DIR", None)
    return nb


def _pngs(nb: nbformat.NotebookNode) -> list[bytes]:
    return [base64.b64decode(out["data"]["image/png"]) for cell in nb.cells if cell.cell_type == "code"
            for out in cell.outputs if "image/png" in out.get("data", {})]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_and_plots_render(path: Path, executed, tmp_path: Path) -> None:
    import matplotlib.image as mpimg
    import numpy as np

    nb = executed(path)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    pngs = _pngs(nb)
    assert len(pngs) == PLOTS[path.stem], f"{path.name}: expected {PLOTS[path.stem]} plots, got {len(pngs)}"
    for i, data in enumerate(pngs):
        out = tmp_path / f"{path.stem}-{i}.png"
        out.write_bytes(data)
        img = mpimg.imread(io.BytesIO(data), format="png")
        assert img.shape[0] > 100 and img.shape[1] > 200, f"{out}: {img.shape}"
        rgb = np.asarray(img)[..., :3]
        assert float(rgb.std()) > 0.01, f"{out}: a blank image"
        assert (rgb.reshape(-1, 3) < 0.9).any(axis=1).mean() > 0.002, f"{out}: almost nothing drawn"


# ---------------------------------------------------------------------------------------------
# What the notebooks show, against what the committed files hold
# ---------------------------------------------------------------------------------------------

class _Tables(HTMLParser):
    """The tables of a notebook's HTML outputs (polars' ``_repr_html_``): header row, dtype row, rows."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self.tables:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _value(text: str, dtype: str):
    if text == "null":
        return None
    if dtype == "str":
        return html_lib.unescape(text).strip('"')
    if dtype[:1] in "iu":
        return int(text)
    if dtype[:1] == "f":
        return float(text)
    if dtype == "bool":
        return text == "true"
    return text


def _tables(nb: nbformat.NotebookNode) -> list[list[dict]]:
    """Every DataFrame the notebook displayed, as rows of {column: value}."""
    parser = _Tables()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parser.feed(out.get("data", {}).get("text/html", ""))
    return [[dict(zip(t[0], (_value(v, d) for v, d in zip(row, t[1])))) for row in t[2:]] for t in parser.tables
            if len(t) >= 2]


def _table_with(nb: nbformat.NotebookNode, *columns: str) -> list[dict]:
    found = [t for t in _tables(nb) if t and set(columns) <= set(t[0])]
    assert len(found) == 1, f"expected one table with columns {columns}, found {len(found)}"
    return found[0]


def _stdout(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and o.get("name") == "stdout")


@pytest.fixture(scope="module")
def committed(run_dir: Path):
    """The run's facts, read straight from its files (not through polar_analysis)."""
    import polars as pl

    from polar_core.schema import read_capture_lines

    records = [rec for p in sorted((run_dir / "captures" / "sessions").glob("*.jsonl"))
               for rec in read_capture_lines(p)]  # delta records (schema 3) expanded
    rollouts = pl.read_parquet(run_dir / "captures" / "rollouts.parquet")
    metrics = [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines() if line]
    trajectories = sum(pl.read_parquet(p).height for p in (run_dir / "trajectories").glob("*.parquet"))
    return records, rollouts, metrics, trajectories


def _by_session(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["session_id"], []).append(r)
    return out


@pytest.mark.skipif(bool(RUN_OVERRIDE), reason="checks the committed run")
def test_overview_shows_the_captures_calls_tokens_and_policy_versions(executed, committed) -> None:
    records, rollouts, _, _ = committed
    nb = executed(REPO_ROOT / "notebooks" / "01_captures_overview.ipynb")
    sessions = _by_session(records)
    n_prompt = sum(len(r["prompt_token_ids"]) for r in records)
    n_sampled = sum(len(r["sampled_token_ids"]) for r in records)
    errors = sum(r["status"] != "ok" for r in records)
    out = _stdout(nb)
    assert f"{len(records)} calls in {len(sessions)} sessions; {n_prompt} prompt ids, {n_sampled} sampled ids" in out
    reached = sum(r["t_upstream_sent"] is not None and r["t_response_out"] is not None for r in records)
    assert f"{reached} of {len(records)} calls reached the upstream" in out
    assert f"{errors} calls with errors" in out

    outcome = {r["session_id"]: (r["reward"], r["status"]) for r in rollouts.iter_rows(named=True)}
    shown = {row["session_id"]: row for row in _table_with(nb, "session_id", "n_calls", "min_policy_version")}
    assert set(shown) == set(sessions)
    for sid, calls in sessions.items():
        row, versions = shown[sid], [c["policy_version"] for c in calls]
        assert (row["n_calls"], row["prompt_ids"], row["sampled_ids"]) == (
            len(calls), sum(len(c["prompt_token_ids"]) for c in calls), sum(len(c["sampled_token_ids"]) for c in calls))
        assert (row["min_policy_version"], row["max_policy_version"]) == (min(versions), max(versions)), sid
        assert (row["reward"], row["rollout_status"]) == outcome[sid], sid
    assert {v for row in shown.values() for v in (row["min_policy_version"], row["max_policy_version"])} == {0, 1}

    [per_provider] = _table_with(nb, "harness", "provider", "calls", "sessions")
    assert (per_provider["provider"], per_provider["calls"], per_provider["sessions"], per_provider["errors"],
            per_provider["prompt_ids"], per_provider["sampled_ids"]) == (
        records[0]["provider"], len(records), len(sessions), errors, n_prompt, n_sampled)


@pytest.mark.skipif(bool(RUN_OVERRIDE), reason="checks the committed run")
def test_debugger_shows_the_captures_sequences_and_drift(executed, committed) -> None:
    records, _, _, _ = committed
    nb = executed(REPO_ROOT / "notebooks" / "02_trajectory_debugger.ipynb")
    sessions = _by_session(records)
    out = _stdout(nb)
    # Pi never rewrites its history: each session is one sequence, every sampled id covered, no break.
    assert f"{len(sessions)} sequences from {len(records)} calls; coverage 100.00%" in out
    assert f"merges {len(records) - len(sessions)} " in out and "breaks 0 " in out
    chosen = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("session:"))
    calls = sessions[chosen]
    assert len(calls) == max(len(c) for c in sessions.values())  # the most calls (all merges non-exact)
    assert f"1 sequence(s): {chosen}/0.0 ({len(calls)} calls, " in out
    assert f" tokens, {sum(len(c['sampled_token_ids']) for c in calls)} sampled)" in out
    drift = _table_with(nb, "call_index", "prev_call_index", "cause", "exact")
    assert [row["call_index"] for row in drift] == sorted(c["call_index"] for c in calls)
    assert drift[0]["cause"] == "new_conversation" and not any(row["exact"] for row in drift)


@pytest.mark.skipif(bool(RUN_OVERRIDE), reason="checks the committed run")
def test_training_notebook_shows_the_runs_rewards_and_metrics(executed, committed) -> None:
    records, rollouts, metrics, n_sequences = committed
    nb = executed(REPO_ROOT / "notebooks" / "03_training.ipynb")
    assert (f"{n_sequences} sequences, {rollouts.height} samples in {rollouts['group_id'].n_unique()} groups; "
            f"{len(metrics)} optimizer steps logged") in _stdout(nb)
    steps = {row["step"]: row for row in _table_with(nb, "step", "mean_reward", "solved", "samples")}
    for step, part in rollouts.group_by("step"):
        row = steps.pop(step[0])
        assert (row["samples"], row["solved"]) == (part.height, int((part["reward"] > 0).sum()))
        assert row["mean_reward"] == pytest.approx(part["reward"].mean())
    assert not steps
    assert {r["policy_version"] for r in records if r["session_id"].split(".")[1] == "st1"} == {1}  # after the push
    groups = {row["group_id"]: row for row in _table_with(nb, "group_id", "samples", "mean_reward", "zero_variance")}
    for gid, part in rollouts.group_by("group_id"):
        row = groups.pop(gid[0])
        assert row["samples"] == part.height and row["mean_reward"] == pytest.approx(part["reward"].mean())
        assert row["zero_variance"] == (part["reward"].n_unique() == 1)
    assert not groups
    shown = _table_with(nb, "step", "loss", "n_sampled_tokens")
    assert [(r["step"], r["n_sampled_tokens"]) for r in shown] == [(m["step"], m["n_sampled_tokens"]) for m in metrics]
    assert [r["loss"] for r in shown] == pytest.approx([m["loss"] for m in metrics], rel=1e-3)  # as displayed


def test_debugger_marks_calls_masks_and_drift(run_dir: Path, executed) -> None:
    """The token-by-token HTML carries every token of the chosen session with its loss mask."""
    import polars as pl

    nb = executed(REPO_ROOT / "notebooks" / "02_trajectory_debugger.ipynb")
    html = "".join(o["data"].get("text/html", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.outputs if "data" in o)
    session = next(line.split(":", 1)[1].strip() for c in nb.cells if c.cell_type == "code" for o in c.outputs
                   if o.get("name") == "stdout" for line in o["text"].splitlines() if line.startswith("session:"))
    from polar_analysis import frames
    from polar_analysis.trajectories import prefix_merge

    traj, _ = prefix_merge.build(frames.calls(run_dir / "captures").filter(pl.col("session_id") == session))
    n_tokens = int(traj["input_ids"].list.len().sum())
    n_sampled = int(traj["loss_mask"].list.sum().sum())
    assert html.count('class="tok"') == n_tokens
    assert html.count("font-weight:bold;color:#000") == n_sampled
    assert "merge into call" in html
    if traj["n_calls"].max() > 1:
        assert "drift cause" in html or "merge into call 1: exact" in html


def test_debugger_marks_prefix_breaks_with_both_sides(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    """Pi does not rewrite its history, so the real capture has no prefix break. This capture does:
    real Qwen2.5 ids (polar_analysis.synthetic) of a Claude-Code-like session whose system prompt
    starts with a per-request billing header that the engine kept. Every break must be marked with
    its drift cause and the text on both sides."""
    import html as html_lib

    from polar_analysis.alignment import ChatTemplateRenderer
    from polar_analysis.synthetic import SyntheticSession, write_capture

    def system(i: int) -> str:
        return f"x-anthropic-billing-header: cc_version=2.1.332; cch={1000 + 7 * i:05x};\nYou are a coding agent."

    keeps = ChatTemplateRenderer(tiny_qwen_dir, strip_billing_header=False)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
    s = SyntheticSession(keeps, "cc-breaks", system=system(0), tools=tools, harness="claude-code", provider="anthropic")
    s.user("Run echo hi")
    for i in range(3):
        s.messages[0]["content"] = system(i)
        if i < 2:
            s.generate(tool_calls=[("bash", {"command": f"echo {i}"})])
            s.tool(f"{i}", s.messages[-1]["tool_calls"][0]["id"])
        else:
            s.generate(content="Done.")
    write_capture(tmp_path / "capture", s.records)

    nb = _execute(REPO_ROOT / "notebooks" / "02_trajectory_debugger.ipynb", tmp_path / "capture", tmp_path)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    html = html_lib.unescape("".join(o["data"].get("text/html", "") for c in nb.cells if c.cell_type == "code"
                                     for o in c.outputs if "data" in o))
    assert html.count("prefix break</b> before call") == 2
    assert html.count("cause <b>system_changed</b>") == 2
    assert "cch=003ef" in html and "cch=003f6" in html  # the header on both sides of the second break
    assert html.count('class="tok"') == sum(len(r.prompt_token_ids) + len(r.sampled_token_ids) for r in s.records)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_notebook_on_a_run_without_calls_says_so_instead_of_raising(path: Path, kind: str, tmp_path: Path) -> None:
    """A run whose harness never reached the proxy (what `polar demo` had when Pi could not start):
    one plain line, no traceback, nothing drawn."""
    run = tmp_path / "run"
    if kind == "empty":
        (run / "captures" / "sessions").mkdir(parents=True)
        (run / "logs").mkdir()
    nb = _execute(path, run, tmp_path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert f"no calls captured in {run}" in text
    assert not _pngs(nb)
