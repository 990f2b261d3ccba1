"""``polar view`` in a real browser: Debian's Chromium driven by playwright (PyPI), never a
downloaded one (`playwright install` fetches from a CDN). On tests/fixtures/view-run: the page
opens from file:// under its CSP with no console error, the plots render, a click on the reward
plot opens a step, a sample opens with its conversation (hostile HTML shown as text, run never),
its split sequence with the cause, tokens with mask, both logprobs on hover; the served page
follows a run that grows. Screenshots go to the test's tmp directory.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from polar_runtime.view.chunks import write_report
from polar_runtime.view.model import RunView
from polar_runtime.view.server import make_server

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "view-run"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (pyproject dev extras) is not installed")
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it as root)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("view-browser") / "report"
    write_report(RunView(FIXTURE), out)
    return out


class Page:
    """A page that records every console message and uncaught error."""

    def __init__(self, browser, shots: Path) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.shots = shots

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=True)


@pytest.fixture
def page(browser, tmp_path):
    p = Page(browser, tmp_path)
    yield p
    p.page.close()


def test_the_run_page_loads_with_no_console_error_and_its_plots_render(page, report):
    pg = page.page
    pg.goto(report.joinpath("index.html").as_uri())
    pg.locator(".plot canvas").nth(6).wait_for()  # (wait_for_function evaluates a string: the CSP refuses it)
    page.shot("run")
    assert pg.locator(".plot canvas").count() >= 7
    # a drawn plot is not blank: its canvas has coloured pixels
    drawn = pg.evaluate("""() => { const c = document.querySelector('.plot canvas'); const d = c.getContext('2d')
        .getImageData(0, 0, c.width, c.height).data; let n = 0; for (let i = 0; i < d.length; i += 4)
        if (d[i + 3] && (d[i] !== d[i + 1] || d[i + 1] !== d[i + 2])) n++; return n; }""")
    assert drawn > 50
    assert pg.locator("meta[http-equiv='Content-Security-Policy']").get_attribute("content").startswith("default-src 'none'; script-src 'self'")
    assert page.errors == []


def test_from_the_reward_plot_to_a_split_sequence_with_tokens_mask_and_both_logprobs(page, report):
    pg = page.page
    pg.goto(report.joinpath("index.html").as_uri())
    pg.wait_for_selector(".plot canvas")
    over = pg.locator(".plot .u-over").first  # the reward plot: step 0 at its left edge
    box = over.bounding_box()
    pg.mouse.move(box["x"] + 3, box["y"] + box["height"] / 2)
    pg.mouse.click(box["x"] + 3, box["y"] + box["height"] / 2)
    pg.wait_for_selector("a.sample-link")
    assert pg.evaluate("location.hash") == "#/step/0"
    pg.locator("a.sample-link", has_text="make-note.st0.s0").click()
    pg.wait_for_selector("a.seq-link")
    pg.locator("a.seq-link", has_text="make-note.st0.s0/0.1").click()
    pg.wait_for_selector(".seqview .tok")
    assert pg.text_content(".seqview .split-cause") == "system_changed"
    assert "split: segment 1 of chain 0" in pg.text_content(".seqview .split")
    sampled = pg.locator(".seqview .span-sampled .tok.m1")
    assert sampled.count() == 5 and pg.locator(".seqview .tok.m0").count() > 100
    colour = sampled.first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour.startswith("rgb") and colour != "rgba(0, 0, 0, 0)"  # coloured by its probability
    sampled.first.hover()
    tip = pg.text_content("#tip")
    assert "vLLM logprob -" in tip and "trainer logprob -" in tip and "advantage 0.7071" in tip and "mask 1" in tip
    pg.locator(".seqview .span .tok.m0").first.hover()
    assert "mask 0 (not trained)" in pg.text_content("#tip") and "call 2 · prompt" in pg.text_content("#tip")
    page.shot("sequence")
    pg.locator("a.call-link").first.click()
    pg.wait_for_selector(".callview details.raw")
    raw = pg.text_content(".callview")
    assert "POST http://127.0.0.1:8080/v1/chat/completions" in raw and "authorization: [redacted]" in raw
    assert pg.locator(".callview .answer pre").count() == 1 and "write" in pg.text_content(".callview .toolcall")
    assert pg.locator(".callview .tok.m1").count() > 5  # its sampled tokens, coloured
    page.shot("call")
    assert page.errors == []


def test_hostile_answer_tool_output_and_log_are_shown_as_text_and_never_run(page, report):
    pg = page.page
    pg.goto(report.joinpath("index.html").as_uri() + "#/sample/0")
    pg.wait_for_selector(".msg")
    pg.wait_for_timeout(300)
    assert pg.evaluate("window.__pwned") is None  # no script of the data ran (nor an onerror handler)
    text = pg.text_content("main")
    assert '</script><script>window.__pwned = "answer"</script> <b>bold?</b>' in text
    assert '<script>window.__pwned = "tool"</script><img src=x onerror=' in text
    pg.locator("details summary", has_text="pi-chat.stderr").click()
    assert "<script>window.__pwned='log'</script>" in pg.text_content("main")
    pg.wait_for_timeout(300)
    assert pg.evaluate("window.__pwned") is None
    assert pg.locator("main img, main script").count() == 0  # no element came from the data
    assert pg.locator("main b", has_text="bold?").count() == 0
    page.shot("hostile")
    assert page.errors == []


def test_the_served_page_follows_a_growing_run(page, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    server = make_server(RunView(run))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pg = page.page
        pg.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        pg.wait_for_selector("a.step-link")
        assert pg.locator("a.step-link").count() == 2
        rows = pl.read_parquet(run / "captures" / "rollouts.parquet")
        more = rows.filter(pl.col("step") == 1).with_columns(step=pl.lit(2, pl.Int64), session_id=pl.lit("make-note.st2.s0"))
        time.sleep(0.05)
        pl.concat([rows, more.head(1)]).write_parquet(run / "captures" / "rollouts.parquet")
        pg.wait_for_selector("a.step-link >> text=step 2", timeout=15000)
        assert "live, updated" in pg.text_content("#live")
        page.shot("served")
        assert page.errors == []
    finally:
        server.shutdown()
        server.server_close()
