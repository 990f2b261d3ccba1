"""``polar view`` without a browser: the data it writes (tests/fixtures/view-run), the script-safe
JSON of its chunks, the no-follow reader, and ``--serve`` (tests/runtime/test_view_browser.py
drives the page in Chromium)."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from polar_runtime.view.chunks import chunk, js_literal, write_report
from polar_runtime.view.model import RunView
from polar_runtime.view.server import make_server

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "view-run"
HOSTILE = ['</script><script>window.__pwned = "answer"</script>', '<script>window.__pwned = "tool"</script>',
           '<img src=x onerror="window.__pwned=\'img\'">']


def read_chunk(path: Path) -> tuple[str, object]:
    text = path.read_text()
    assert text.startswith("polarData(") and text.endswith(");\n")
    name, _, rest = text[len("polarData("):-3].partition(",")
    return json.loads(name), json.loads(rest)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("view") / "report"
    write_report(RunView(FIXTURE), out)
    return out


def test_chunk_json_cannot_end_a_script_and_reads_back_the_same():
    value = {"answer": "</script><script>alert(1)</script><!-- & \u2028\u2029 >", "n": float("nan")}
    text = js_literal({"answer": value["answer"]})
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in text
    assert json.loads(text) == {"answer": value["answer"]}
    assert json.loads(js_literal(value))["n"] is None  # NaN is written as null, never as a bare NaN (not JSON)
    big = {"seed": 2**70, "x": float("inf"), "s": "</script>"}  # beyond orjson: the slow path, as safe
    assert json.loads(js_literal(big)) == {"seed": 2**70, "x": None, "s": "</script>"} and "<" not in js_literal(big)


def test_the_run_page_data_of_the_fixture(report):
    name, run = read_chunk(report / "data" / "run.js")
    assert name == "run"
    assert [r["step"] for r in run["rewards"]] == [0, 1] and run["rewards"][0]["mean"] == 0.5
    assert [s["age"] for s in run["staleness"]] == [0] and run["staleness"][0]["tokens"] > 0
    assert run["drift"]["causes"] == ["system_changed"] and run["drift"]["steps"][0]["counts"] == {"system_changed": 1}
    assert run["merges"][0]["breaks"] == 1 and run["merges"][0]["merges"] >= 2
    assert [r["trainer"] for r in run["idle"]] == [pytest.approx(2 / 3, abs=1e-3), pytest.approx(0.6694, abs=1e-3)]
    assert [p["train_s"] for p in run["phases"]["per_step"]] == [20.0, 0.0]
    assert run["train"][0]["step"] == 1 and run["train"][0]["mismatch_kl"] is not None
    assert [s["session_id"] for s in run["samples"]][:2] == ["make-note.st0.s0", "make-note.st0.s1"]
    assert [s["trained"] for s in run["samples"]] == [True, True, False, False]


def test_a_sample_its_split_its_trainer_record_and_its_raw_flows(report):
    raw = (report / "data" / "samples" / "0.js").read_bytes()
    for bad in (b"<", b">", b"sk-polar-session-secret"):
        assert bad not in raw  # markup only as \u003c escapes; the session key redacted
    _, s = read_chunk(report / "data" / "samples" / "0.js")
    first, split = s["sequences"]
    assert first["split"] is None and split["split"]["cause"] == "system_changed"
    assert split["split"]["label"].startswith("split: segment 1")
    tokens = pl.read_parquet(FIXTURE / "train" / "tokens" / "step-000001.parquet").filter(
        pl.col("trajectory_id") == split["trajectory_id"])
    # every masked position has the trainer's logprob, and only those
    assert [i for i, v in enumerate(split["trainer"]) if v is not None] == tokens["position"].to_list()
    assert [i for i, m in enumerate(split["mask"]) if m] == tokens["position"].to_list()
    assert split["advantage"] == pytest.approx(float(tokens["advantage"][0]))
    assert [sp["kind"] for sp in first["spans"]] == ["prompt", "sampled", "prompt", "sampled"]
    assert [sp["injected"] for sp in first["spans"]] == [False, False, True, False]  # the tool result, between calls
    call = s["calls"][0]
    assert call["raw"]["request"]["method"] == "POST"
    assert ["authorization", "[redacted]"] in call["raw"]["request"]["headers"]
    assert '"notes.md"' in call["raw"]["response"]["body"]["text"] or "notes.md" in call["raw"]["request"]["body"]["text"]
    texts = json.dumps(s["conversation"])
    assert all(json.dumps(h)[1:-1] in texts for h in HOSTILE[1:])  # kept as text, shown as text
    _, s1 = read_chunk(report / "data" / "samples" / "1.js")
    assert [c["skip"] for c in s1["calls"]].count(None) == 2 and "failed" in next(c["skip"] for c in s1["calls"] if c["skip"])
    _, s2 = read_chunk(report / "data" / "samples" / "2.js")  # the final rollout: not trained, and why
    assert all("trained nothing" in q["not_trained"] for q in s2["sequences"])


def test_a_link_planted_in_a_samples_directory_is_not_followed(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-KEY")
    log = run / "captures" / "work" / "make-note.st0.s0" / "logs" / "pi-chat.stderr"
    log.unlink()
    log.symlink_to(secret)
    (run / "captures" / "work" / "make-note.st0.s0" / "logs" / "fifo").symlink_to("/dev/zero")
    s = RunView(run).sample(0)
    assert "TOP-SECRET-KEY" not in json.dumps(s)
    assert s["logs"] == []  # links are not even listed


def _get(url: str, host: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_serve_answers_its_own_files_only_and_follows_the_run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    (tmp_path / "outside.txt").write_text("outside")
    server = make_server(RunView(run))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert server.server_address[0] == "127.0.0.1"
        status, body = _get(base + "/data/run.js")
        assert status == 200 and body.startswith(b'polarData("run",')
        assert _get(base + "/data/samples/0.js")[0] == 200
        assert _get(base + "/data/run.js", host=f"evil.example:{server.server_address[1]}")[0] == 403  # DNS rebinding
        assert _get(base + "/vendor/uplot-1.6.32/uPlot.iife.min.js")[0] == 200
        for bad in ("/../outside.txt", "/data/../loop-state.json", "/loop-state.json", "/data/samples/99.js",
                    "/captures/sessions/make-note.st0.s0.jsonl", "/%2e%2e/outside.txt"):
            assert _get(base + bad)[0] == 404, bad
        # a loop writes a new step: the next run.js has it
        rows = pl.read_parquet(run / "captures" / "rollouts.parquet")
        more = rows.filter(pl.col("step") == 1).with_columns(step=pl.lit(2, pl.Int64), session_id=pl.lit("make-note.st2.s0"))
        pl.concat([rows, more.head(1)]).write_parquet(run / "captures" / "rollouts.parquet")
        _, body = _get(base + "/data/run.js")
        run_data = json.loads(body.decode()[len('polarData("run",'):-3])
        assert [r["step"] for r in run_data["rewards"]] == [0, 1, 2]
    finally:
        server.shutdown()
        server.server_close()


def test_the_command_writes_the_report_and_names_it(tmp_path):
    from typer.testing import CliRunner

    from polar_runtime.cli import app

    res = CliRunner().invoke(app, ["view", str(FIXTURE), "--out", str(tmp_path / "v")])
    assert res.exit_code == 0, res.output
    assert f"file://{tmp_path / 'v' / 'index.html'}" in res.output.replace("\n", "")
    assert sorted(p.name for p in (tmp_path / "v" / "data" / "samples").iterdir()) == ["0.js", "1.js", "2.js", "3.js"]
    assert (tmp_path / "v" / "vendor" / "uplot-1.6.32" / "LICENSE").is_file()
    assert not (FIXTURE / "view").exists()  # nothing written into the run


def test_raw_calls_from_a_real_runs_flow_file():
    """tests/fixtures/demo-run's flows.mitm: 9 real streamed calls (Pi through the proxy)."""
    from polar_runtime.view.flows import FlowIndex
    from polar_runtime.view.runfiles import RunFiles

    index = FlowIndex(RunFiles(FIXTURE.parent / "demo-run"))
    index.refresh()
    assert len(index.offsets) == 9
    raw = [index.raw(c) for c in index.offsets]
    assert all(r["request"]["method"] == "POST" and r["request"]["url"].endswith("/v1/chat/completions") for r in raw)
    assert all(r["response"]["body"]["text"].startswith("data: {") for r in raw if r["response"])  # the SSE the harness got
    assert all(json.loads(r["request"]["body"]["text"])["messages"] for r in raw)
