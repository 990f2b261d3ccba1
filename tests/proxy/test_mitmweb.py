"""The committed real flows file, browsed as a user would: a real ``mitmweb -nr FILE -s addon/polar.py``
process, read through mitmweb's own HTTP API (what its browser UI fetches).

For every model call: the response body is there (a streamed answer too) and the Polar view of the
request and of the response renders without ``content missing``; no control-API flow is in the
file; all of it with the capture directory gone (the flow file alone, elsewhere). Browsing starts no
proxy machinery (no capture directory, no upstream warning).

``POLAR_TEST_FLOWS_FILE=PATH`` runs the same checks on another flows file (e.g. one saved before
issue 17, which fails them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from polar_core.net import free_port
from polar_core.paths import REPO_ROOT

FIXTURE_FLOWS = REPO_ROOT / "tests" / "fixtures" / "demo-run" / "captures" / "flows.mitm"
FLOWS = Path(os.environ.get("POLAR_TEST_FLOWS_FILE") or FIXTURE_FLOWS)
MITMWEB = Path(sys.executable).with_name("mitmweb")
VIEW = urllib.parse.quote("Polar tokens")


class Mitmweb:
    """A real mitmweb process browsing one flows file (no proxy server)."""

    def __init__(self, flows: Path, tmp: Path):
        self.port = free_port()
        self.home = tmp / "polar-home"
        self.log = tmp / "mitmweb.log"
        env = {**os.environ, "POLAR_HOME": str(self.home)}
        for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [str(MITMWEB), "-nr", str(flows), "-s", str(REPO_ROOT / "addon" / "polar.py"),
             "--no-web-open-browser", "--web-host", "127.0.0.1", "--web-port", str(self.port),
             "--set", f"confdir={tmp / 'mitm'}"],
            stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as resp:
            return resp.read()

    def json(self, path: str) -> Any:
        return json.loads(self.get(path))

    def flows(self, expect: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The flow list, once mitmweb has read the whole file (``expect`` flows)."""
        deadline = time.monotonic() + timeout
        last: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                last = self.json("/flows")
                if len(last) >= expect:
                    time.sleep(0.3)
                    return self.json("/flows")
            except (urllib.error.URLError, ConnectionError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"mitmweb served {len(last)} of {expect} flows\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def mitmweb(tmp_path: Path) -> Iterator[Any]:
    started: list[Mitmweb] = []

    def start(flows: Path) -> Mitmweb:
        (tmp_path / f"web{len(started)}").mkdir()
        web = Mitmweb(flows, tmp_path / f"web{len(started)}")
        started.append(web)
        return web

    yield start
    for web in started:
        web.stop()


def _count_flows(path: Path) -> int:
    from mitmproxy import io

    with open(path, "rb") as fh:
        return sum(1 for _ in io.FlowReader(fh).stream())


def _text(view: dict[str, Any]) -> str:
    return "\n".join("".join(piece[1] for piece in line) for line in view["lines"])


def browse_problems(web: Mitmweb, n_flows: int, without_records: bool = False) -> tuple[list[str], int]:
    """What a user browsing the file would find wrong (empty: nothing), and the model calls seen;
    ``without_records``: no capture record may be found (the views must work from the flow alone)."""
    problems: list[str] = []
    calls = 0
    for f in web.flows(n_flows):
        fid, req = f["id"], f["request"]
        where = f"{req['method']} {req['path']}"
        if req["path"].startswith("/_polar/"):
            problems.append(f"control-API flow in the file: {where}")
            continue
        req_view = web.json(f"/flows/{fid}/request/content/{VIEW}.json")
        if not req_view["description"].startswith("Polar call"):
            continue  # not a model call (a side call, passthrough traffic)
        calls += 1
        text = _text(req_view)
        if "content missing" in text or "not in the flow" in text or "not found" in text:
            problems.append(f"{where}: request view without the call's tokens: {text[:300]!r}")
        if without_records and "capture record  not here" not in text:
            problems.append(f"{where}: a capture record was found; this checks the flow file alone")
        resp = f.get("response")
        if resp is None:
            problems.append(f"{where}: no response")
            continue
        if not resp.get("contentLength"):
            problems.append(f"{where}: response body missing (content length {resp.get('contentLength')})")
        elif not web.get(f"/flows/{fid}/response/content.data"):
            problems.append(f"{where}: response body empty")
        resp_view = web.json(f"/flows/{fid}/response/content/{VIEW}.json")
        text = _text(resp_view)
        if "content missing" in text:
            problems.append(f"{where}: response view says content missing")
        elif not resp_view["description"].startswith("Polar answer") or "--- sampled: " not in text:
            problems.append(f"{where}: response view without the sampled tokens: {resp_view['description']!r}")
        if not f.get("comment", "").startswith("polar "):
            problems.append(f"{where}: no Polar comment")
    return problems, calls


def test_browse_committed_flows_in_real_mitmweb(mitmweb, tmp_path: Path) -> None:
    """The flows file alone, copied away from its run (capture directory removed)."""
    lone = tmp_path / "copied-elsewhere" / "flows.mitm"
    lone.parent.mkdir()
    shutil.copy(FLOWS, lone)
    n = _count_flows(lone)
    web = mitmweb(lone)
    problems, calls = browse_problems(web, n, without_records=True)
    assert calls >= 3, "no model call found in the flows file"
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems in {n} flows)"
    assert "comment" in web.json("/options")["web_columns"]["value"]  # the list tells calls apart
    log = web.log.read_text()
    assert "polar_upstream" not in log and "relay=" not in log, log[-2000:]
    assert not web.home.exists() or not any(web.home.rglob("*")), "browsing created files under POLAR_HOME"


def test_browse_links_the_capture_record_when_it_is_there(mitmweb, tmp_path: Path) -> None:
    """Next to its capture directory (as the demo saves it), the request view names the record.
    (The fixture's ``flows-run/`` is the capture directory of the run its flows.mitm comes from.)"""
    if FLOWS != FIXTURE_FLOWS:
        pytest.skip("the fixture's capture directory goes with the fixture's flows file")
    run = tmp_path / "captures"  # the run's capture directory (its records), the flows saved into it
    shutil.copytree(FIXTURE_FLOWS.parent / "flows-run", run, ignore=shutil.ignore_patterns(".polar-cache"))
    shutil.copy(FIXTURE_FLOWS, run / "flows.mitm")
    web = mitmweb(run / "flows.mitm")
    flows = web.flows(_count_flows(run / "flows.mitm"))
    linked = 0
    for f in flows:
        view = web.json(f"/flows/{f['id']}/request/content/{VIEW}.json")
        if view["description"].startswith("Polar call"):
            linked += f"capture record  {run.resolve() / 'sessions'}" in _text(view)
    assert linked >= 3 and linked == sum(1 for f in flows if f.get("comment", "").startswith("polar "))
