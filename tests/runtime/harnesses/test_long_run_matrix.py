"""Long-run acceptance (issue 16): a real harness CLI through the real proxy against the scripted
vLLM-format upstream, in one session that hits the output budget in the middle of a tool call, reads
an image file, and compacts its history. The run completes, every upstream answer is captured, and
the drift report names each compaction.

Done for Codex so far (its own, local compaction: Codex compacts through ``/v1/responses`` with its
CONTEXT CHECKPOINT COMPACTION prompt when the provider is not OpenAI's; ``/v1/responses/compact`` is
covered by tests/proxy/test_long_runs.py). What each harness's compaction request looks like is
in docs/long-runs.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from polar_analysis import drift, frames
from polar_core.compaction import compaction_of
from polar_core.schema import read_capture_lines
from polar_proxy.process import ProxyProcess
from polar_runtime import harnesses as h
from polar_testing.scripted_upstream import Script, ServerThread

from .conftest import require_installed

pytestmark = [pytest.mark.harness, pytest.mark.slow]


@pytest.fixture(params=[False, True], ids=["plain", "exact"])
def exact(request) -> bool:
    """Each long run twice: as plain ``mitmdump -s addon/polar.py`` runs it, and with
    ``polar_exact_history`` on, as ``polar rollout`` and ``polar demo`` run it."""
    return request.param

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
CAP = 20  # polar_max_tokens_cap: the first call (a 40-word command) is cut mid-call
COMPACT_AT = 4000  # Codex's model_auto_compact_token_limit, in the scripted upstream's (cheap) tokens


def _exec(cmd: str) -> dict:
    return {"tool_calls": [{"name": "exec_command", "arguments": {"cmd": cmd}}]}


def test_codex_long_session(tmp_path, exact):
    preset = h.get_preset("codex")
    require_installed(preset)
    script = Script({"*": [
        _exec("echo " + " ".join(f"w{i}" for i in range(40))),  # cut by the budget
        _exec(f"echo {PNG} | base64 -d > img.png"),
        {"tool_calls": [{"name": "view_image", "arguments": {"path": "img.png"}}]},
        *[_exec(f"echo step{i} > s{i}.txt; seq -s ' ' 1 300") for i in range(6)],
        *[{"text": "All steps done."}] * 4,
    ]})
    # The summary carries a directive so that the scripted model finishes once the history
    # restarts from it (a real model would go on from the summary).
    summary = {"text": "Summary: the steps ran and wrote their files; left: the report. #scenario:text"}
    with ServerThread(max_model_len=131072, script=script, summary=summary, log_size=256) as up:
        options = {"polar_exact_history": True} if exact else {"polar_max_tokens_cap": CAP}  # see _long_run
        proxy = ProxyProcess(up.url, tmp_path / "captures", confdir=tmp_path / "mitm", options=options).start()
        try:
            home, work = tmp_path / "home", tmp_path / "work"
            codex_home = home / ".codex"
            codex_home.mkdir(parents=True)
            work.mkdir()
            (codex_home / "config.toml").write_text(
                'model = "gpt-5-codex"\nmodel_provider = "polar"\napproval_policy = "never"\n'
                'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n'
                f"model_auto_compact_token_limit = {COMPACT_AT}\n"
                '[analytics]\nenabled = false\n[feedback]\nenabled = false\n[otel]\nexporter = "none"\n'
                '[model_providers.polar]\nname = "polar"\n'
                f'base_url = "{proxy.url}/v1"\nenv_key = "POLAR_API_KEY"\nwire_api = "responses"\n'
                "request_max_retries = 1\nstream_max_retries = 1\n")
            env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex_home),
                   "POLAR_API_KEY": "codex-long-run", "NO_COLOR": "1"}
            argv = [str(preset.binary()), "exec", "--skip-git-repo-check", "--json",
                    "--dangerously-bypass-approvals-and-sandbox", "--cd", str(work), "--model", "gpt-5-codex",
                    "--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"',
                    "Run the steps."]
            run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
            answered = up.upstream.count
        finally:
            proxy.stop()
    assert run.returncode == 0, run.stderr[-2000:]
    sessions = list((tmp_path / "captures" / "sessions").glob("*.jsonl"))
    assert len(sessions) == 1
    recs = list(read_capture_lines(sessions[0]))
    assert len(recs) == answered and all(r["status"] == "ok" for r in recs)  # every call captured
    if exact:
        assert any("image replaced by a text placeholder" in n for r in recs for n in r["translation_notes"])
        _check_exact({"captures": tmp_path / "captures", "recs": recs, "name": "codex", "run": run,
                      "tail": run.stderr[-2000:]})
        return
    cut = recs[0]
    assert cut["finish_reason"] == "length" and len(cut["sampled_token_ids"]) == CAP
    assert any("image replaced by a text placeholder" in n for r in recs for n in r["translation_notes"])
    assert (work / "img.png").exists()
    report = drift.drift_report(frames.calls(tmp_path / "captures", rewards=None))
    details = [d for c, d in zip(report["cause"], report["detail"]) if c == "compacted"]
    assert any(d.startswith("summary call (codex)") for d in details), details
    assert any(d.startswith("resumed from a summary (codex)") for d in details), details
    summary_call = next(r for r in recs if "CONTEXT CHECKPOINT COMPACTION" in json.dumps(r["native_request"]["input"][-1]))
    assert summary_call["native_path"] == "/v1/responses" and summary_call["native_request"]["tools"] == []
    assert summary_call["output_text"].startswith("Summary:")
    assert "compaction: codex summary call (request_kind compaction)" in summary_call["translation_notes"]


# ---------------------------------------------------------------------------------------------
# The other harnesses: one helper runs a preset's real CLI through the proxy against the scripted
# upstream and checks what every long run must show; each test adds what its harness's compaction
# looks like.

PLACEHOLDER = "[image: image/"  # Qwen Code sends the PNG as a JPEG


def _messages_text(body: dict) -> str:
    return json.dumps(body.get("messages") or [])


def _long_run(tmp_path: Path, name: str, turns: list, *, max_model_len: int, configure=None, trim: bool = True,
              summary: object = None, task: str = "Run the steps.", timeout: float = 300.0,
              patch_turns: bool = False, resumed: object = None, exact: bool = False) -> dict:
    """Run preset ``name`` once; ``configure(session, invocation)`` adds the harness's own
    compaction settings. Returns the run's facts (rc, records, upstream log, drift details)."""
    import time

    preset = h.get_preset(name)
    require_installed(preset)
    if patch_turns:  # "IMG" in a turn: the image's absolute path (tools that want one)
        img = str((tmp_path / "work" / "img.png").absolute())
        turns = [json.loads(json.dumps(t).replace('"IMG"', json.dumps(img))) for t in turns]
    kwargs = {"summary": summary} if summary is not None else {}
    if resumed is not None:  # the answer once the history restarts from the summary
        kwargs["resumed"] = resumed
    with ServerThread(max_model_len=max_model_len, script=Script({"*": turns}), log_size=512, **kwargs) as up:
        # Exact mode runs without the budget cut: a streamed answer cut inside a tool call reaches
        # the harness as its raw text there (the whole-answer derender), which ends some harnesses'
        # sessions; cut turns in exact mode are covered by tests/proxy/test_exact_history.py.
        options = {"polar_exact_history": True} if exact else {"polar_max_tokens_cap": CAP}
        proxy = ProxyProcess(up.url, tmp_path / "captures", confdir=tmp_path / "mitm", options=options).start()
        try:
            session = h.Session(session_id=f"long-{name}", task=task, workdir=tmp_path / "work",
                                home=tmp_path / "home", model="scripted-model",
                                endpoint=h.Endpoint("base_url", base_url=proxy.url), trim=trim)
            inv = preset.prepare(session)
            if configure is not None:
                configure(session, inv)
            t0 = time.monotonic()
            run = h.run_invocation(inv, timeout=timeout, log_dir=tmp_path / "logs", name=name)
            wall = time.monotonic() - t0
            time.sleep(0.5)  # the last record is written after the answer's last byte
            answered, requests = up.upstream.count, list(up.upstream.requests)
            if exact:  # the chat requests reached the engine through render (and a probe of its own)
                probe = [{"role": "user", "content": "hi"}]  # exact_history._probe_eot's renders
                requests = [{"messages": r["messages"]} for r in up.upstream.rendered.values()
                            if r["messages"][:1] != probe]
        finally:
            proxy.stop()
    recs = []
    for p in sorted((tmp_path / "captures" / "sessions").glob("*.jsonl")):
        recs += list(read_capture_lines(p))
    recs.sort(key=lambda r: r["t_request_in"] or 0)
    report = drift.drift_report(frames.calls(tmp_path / "captures", rewards=None))
    details = [d for c, d in zip(report["cause"], report["detail"]) if c == "compacted"]
    print(f"{name}: rc={run.returncode} wall={wall:.1f}s calls={len(recs)} compacted={details}")
    for r in recs:  # one line per call, for the -s log of a failing run
        msgs = _normalized(r)["messages"] if r.get("normalized_request") else []
        print(f"  #{r['call_index']} {r['native_path']} {r['status']} {r['http_status']} {r['finish_reason']} "
              f"prompt={len(r['prompt_token_ids'])} msgs={len(msgs)} tools={len(_normalized(r).get('tools') or []) if msgs else '-'} "
              f"last={json.dumps(msgs[-1])[:150] if msgs else r.get('error')!r} notes={r['translation_notes']}")
    return {"run": run, "wall": wall, "recs": recs, "answered": answered, "requests": requests, "name": name,
            "details": details, "work": session.workdir, "home": session.home, "tail": run.tail(4000),
            "exact": exact, "captures": tmp_path / "captures"}


def _summary_calls(recs: list[dict]) -> list[dict]:
    return [r for r in recs if (compaction_of(_normalized(r)["messages"]) or "").startswith("summary call")]


def _normalized(rec: dict) -> dict:
    req = rec["normalized_request"]
    return json.loads(req) if isinstance(req, str) else req


def _check_common(res: dict) -> None:
    """Every upstream answer captured (same requests, same order), the image a placeholder, the
    budget-cut call a length stop."""
    recs, requests = res["recs"], res["requests"]
    assert not res["run"].timed_out, res["tail"]
    # exact mode: the proxy itself refuses a prompt past the context (vLLM's 400) before generate
    answered = [r for r in recs if r["status"] == "ok"] if res["exact"] else recs
    assert len(answered) == res["answered"] and len(recs) == len(requests), (len(recs), res["answered"], res["tail"])
    assert [_normalized(r)["messages"] for r in recs] == [b["messages"] for b in requests]
    assert any("image replaced by a text placeholder" in n for r in recs for n in r["translation_notes"])
    assert any(PLACEHOLDER in _messages_text(b) for b in requests)  # what the text-only model read
    if res["exact"]:
        _check_exact(res)
        return
    cut = [r for r in recs if r["finish_reason"] == "length"]  # the chat finish the proxy reported
    assert cut and all(len(r["sampled_token_ids"]) == CAP for r in cut)


def _check_exact(res: dict) -> None:
    """Exact mode on a long run: wherever the harness re-sent its history, the next call's prompt
    continues the ids the model was given and sampled (an ``exact`` merge); every call that could
    not continue is labelled with why (the history the harness edited: its compaction)."""
    from polar_analysis.trajectories import prefix_merge

    assert res["run"].returncode == 0, res["tail"]
    _, st = prefix_merge.build(frames.calls(res["captures"], rewards=None))
    labels = [(r.get("history"), r.get("history_cause")) for r in res["recs"]]
    print(f"{res['name']} exact mode: merges {dict(st.merge_kinds)} breaks {dict(st.break_reasons)} history {labels}")
    assert st.merges > 0 and st.merge_kinds == {"exact": st.merges}, (dict(st.merge_kinds), labels)
    assert all(h in ("exact", "rendered") or (h or "").startswith("spliced_at=") for h, _ in labels), labels
    assert all(cause for h, cause in labels if h != "exact"), labels  # every fallback says why


def _bash(cmd: str, tool: str = "bash", key: str = "command") -> dict:
    return {"tool_calls": [{"name": tool, "arguments": {key: cmd}}]}


LONG_CMD = "echo " + " ".join(f"w{i}" for i in range(40))  # a call longer than CAP tokens: cut
PNG_CMD = f"echo {PNG} | base64 -d > img.png"


def _big(i: int, n: int = 300) -> str:
    return f"echo step{i} > s{i}.txt; seq -s ' ' 1 {n}"


def test_pi_long_session(tmp_path, exact):
    """Pi compacts when its provider answers a context overflow (it compacts, then retries), with
    its own summary call: no tools, its own system prompt, one user message holding the serialized
    conversation and "The messages above are a conversation to summarize. Create a structured context
    checkpoint summary ..."; the retry restarts from a user message "The conversation history before
    this point was compacted into the following summary: <summary>..."."""

    def configure(s: h.Session, inv: h.Invocation) -> None:
        agent = s.home / ".pi" / "agent"
        models = json.loads((agent / "models.json").read_text())
        model = models["providers"]["polar"]["models"][0]
        model["contextWindow"] = 200000  # its threshold never fires: the provider's overflow does
        model["input"] = ["text", "image"]  # else Pi leaves the image out itself
        (agent / "models.json").write_text(json.dumps(models))
        settings = json.loads((agent / "settings.json").read_text())
        settings["compaction"] = {"enabled": True, "reserveTokens": 16384, "keepRecentTokens": 300}
        (agent / "settings.json").write_text(json.dumps(settings))

    turns = [
        _bash(LONG_CMD),
        _bash(PNG_CMD),
        {"tool_calls": [{"name": "read", "arguments": {"path": "img.png"}}]},
        *[_bash(_big(i)) for i in range(12)],
    ]
    summary = {"text": "Summary: the steps ran. #scenario:text"}
    res = _long_run(tmp_path, "pi-chat", turns, exact=exact, max_model_len=3000, configure=configure, summary=summary)
    _check_common(res)
    if exact:  # the rest follows the plain run's flow, which the budget cut shapes
        return
    assert res["run"].returncode == 0, res["tail"]
    recs = res["recs"]
    # Pi streams the cut call's arguments as far as they were written and runs what it got (as with
    # any provider); its own session log says the turn stopped for length
    pi_log = "".join(p.read_text() for p in (res["home"] / ".pi" / "agent" / "sessions").rglob("*.jsonl"))
    assert '"stopReason":"length"' in pi_log
    overflow = [r for r in recs if r["status"] == "error"]
    assert overflow and "maximum context length" in overflow[0]["error"] and overflow[0]["http_status"] == 400
    assert "summary call (pi)" in res["details"] and "resumed from a summary (pi)" in res["details"]
    # one prompt, one turn: Pi keeps the turn's recent part and summarizes its prefix
    summary_call = next(r for r in recs if "This is the PREFIX of a turn that was too large to keep"
                        in json.dumps(r["native_request"]))
    assert not summary_call["native_request"].get("tools") and summary_call["output_text"].startswith("Summary:")
    assert recs[-1]["finish_reason"] == "stop" and recs[-1]["call_index"] > summary_call["call_index"]


def test_qwen_code_long_session(tmp_path, exact):
    """Qwen Code compacts by its own threshold (``context.autoCompactThreshold`` of
    ``model.generationConfig.contextWindowSize``): a chat call of the history, tools left out, ending
    in the user message "First, reason in your <analysis> block. Then, produce the <state_snapshot>
    XML."; the next call restarts from a user message holding the summary and the model's "Got it.
    Thanks for the additional context!"."""

    def configure(s: h.Session, inv: h.Invocation) -> None:
        path = s.home / ".qwen" / "settings.json"
        settings = json.loads(path.read_text())
        # "modalities": a model that reads images (else Qwen Code refuses the image itself)
        settings["model"] = {"generationConfig": {"contextWindowSize": QWEN_WINDOW, "modalities": {"image": True}}}
        settings["context"] = {"autoCompactThreshold": QWEN_PCT}
        path.write_text(json.dumps(settings))

    turns = [
        _bash(LONG_CMD, "run_shell_command"),
        _bash(PNG_CMD, "run_shell_command"),
        {"tool_calls": [{"name": "read_file", "arguments": {"file_path": "IMG"}}]},
        *[_bash(_big(i), "run_shell_command") for i in range(12)],
    ]
    summary = {"text": "<state_snapshot>Summary: the steps ran.</state_snapshot>"}
    res = _long_run(tmp_path, "qwen-code", turns, exact=exact, max_model_len=200000, configure=configure, summary=summary,
                    patch_turns=True, resumed={"text": "All steps done."})
    _check_common(res)
    if exact:  # the rest follows the plain run's flow, which the budget cut shapes
        return
    assert res["run"].returncode == 0, res["tail"]
    recs = res["recs"]
    assert any(d.startswith("summary call (qwen-code)") for d in res["details"]), res["details"]
    assert "resumed from a summary (gemini-cli/qwen-code)" in res["details"]
    (summary_call,) = _summary_calls(recs)
    # Qwen Code 0.24 with a provider that caches prefixes: the history, its tools kept, then one user
    # message (its compression prompt + "Do not call tools; ..." + the directive)
    msgs = _normalized(summary_call)["messages"]
    assert msgs[-1]["content"].endswith("Then, produce the <state_snapshot> XML.") and summary_call["native_request"]["tools"]
    after = recs[recs.index(summary_call) + 1]
    assert any(m.get("content") == "Got it. Thanks for the additional context!" for m in _normalized(after)["messages"])
    assert recs[-1]["output_text"] == "All steps done."


QWEN_WINDOW, QWEN_PCT = 30000, 0.3  # compacts at 9000 (cheap) tokens; the first prompt has ~6600


def test_gemini_cli_long_session(tmp_path, exact):
    """Gemini CLI compacts (ChatCompressionService.compress, bundle chunk-JDPZ4CE3.js of 0.61.0)
    before a turn whose chat reported at least ``model.compressionThreshold`` x tokenLimit prompt
    tokens (1 048 576 for a model it does not know), but only at a split point: a user message that
    is not a functionResponse (findCompressSplitPoint), or the whole history when it ends in a model
    answer without a functionCall. A ``-p`` run has one user message, its prompt, then only
    functionCall/functionResponse pairs: the split point is 0, nothing to compress, NOOP at every
    turn. Its next-speaker check (``model.skipNextSpeakerCheck: false``; the default skips it) gives
    it a later user message: after a text answer a generateJson call asks who speaks next, and on
    "model" the client sends "Please continue.", whose turn compresses the whole history first.

    The compaction: two generateContent calls with its compression system prompt and the history,
    no tools: the summary call ends in "... First, reason in your scratchpad. Then, generate the
    updated <state_snapshot>.", the verification call in "Critically evaluate the <state_snapshot>
    you just generated. ..."; the next call restarts from a user message holding the summary and the
    model's "Got it. Thanks for the additional context!", then "Please continue.". That call is
    answered with a command cut by the output budget (a MAX_TOKENS answer without a functionCall is
    retried a few times, then the run ends)."""

    def configure(s: h.Session, inv: h.Invocation) -> None:
        path = s.home / ".gemini" / "settings.json"
        settings = json.loads(path.read_text())
        settings["model"] = {"compressionThreshold": GEMINI_COMPACT_AT / 1048576, "disableLoopDetection": True,
                             "skipNextSpeakerCheck": False}
        path.write_text(json.dumps(settings))

    turns = [
        _bash(PNG_CMD, "run_shell_command"),
        {"tool_calls": [{"name": "read_file", "arguments": {"file_path": "img.png"}}]},
        *[_bash(_big(i), "run_shell_command") for i in range(8)],
        {"text": "Steps 0 to 7 ran. Next, I will write the report."},  # no functionCall: a turn ends
        {"text": json.dumps({"reasoning": "The model said what it does next.", "next_speaker": "model"})},
    ]
    summary = {"text": "<state_snapshot>Summary: the steps ran.</state_snapshot>"}
    res = _long_run(tmp_path, "gemini", turns, exact=exact, max_model_len=200000, configure=configure, summary=summary,
                    # plain: a command cut by the budget, the last turn; exact (no budget cut): the end
                    # exact: after the resumed turn's text answer comes another next-speaker check,
                    # answered from the same (resumed) history: it must parse as its JSON and say
                    # "user", or Gemini CLI retries it with backoff (10 checks, 260 s of a 270 s test)
                    resumed={"text": json.dumps({"reasoning": "All steps done.", "next_speaker": "user"})}
                    if exact else _bash(LONG_CMD, "run_shell_command"))
    _check_common(res)
    if exact:  # the rest follows the plain run's flow, which the budget cut shapes
        return
    assert res["run"].returncode == 0, res["tail"]
    recs = res["recs"]
    print("gemini-cli compactions:", res["details"])
    assert any(d.startswith("summary call (gemini-cli)") for d in res["details"]), res["details"]
    assert "resumed from a summary (gemini-cli/qwen-code)" in res["details"]
    # the next-speaker check re-sends the history without tools: a side call, not a compaction
    assert all(d.startswith(("summary call", "resumed from a summary")) for d in res["details"]), res["details"]
    check = recs[len(turns) - 1]  # the next-speaker check: the history, then its question; JSON asked
    assert _normalized(check)["messages"][-1]["content"].startswith("Analyze *only* the content and structure")
    assert check["native_request"]["generationConfig"]["responseMimeType"] == "application/json"
    # the summary call, then the verification call: the history (it had passed the threshold), no tools
    summary_call, verify_call = _summary_calls(recs)
    assert recs.index(summary_call) == len(turns) and recs.index(verify_call) == len(turns) + 1
    assert recs[len(turns) - 2]["prompt_tokens"] >= GEMINI_COMPACT_AT  # what the text answer reported
    for r in (summary_call, verify_call):
        assert not r["native_request"].get("tools") and not _normalized(r).get("tools")
        assert "state_snapshot" in json.dumps(r["native_request"]["systemInstruction"])
    assert _normalized(summary_call)["messages"][-1]["content"].endswith(
        "First, reason in your scratchpad. Then, generate the updated <state_snapshot>.")
    assert _normalized(verify_call)["messages"][-1]["content"].startswith(
        "Critically evaluate the <state_snapshot> you just generated.")
    after = recs[len(turns) + 2]
    msgs = _normalized(after)["messages"]
    assert compaction_of(msgs) == "resumed from a summary (gemini-cli/qwen-code)"
    assert [m["role"] for m in msgs if m["role"] != "system"] == ["user", "assistant", "user"]
    assert msgs[-1]["content"] == "Please continue."
    assert len(msgs) < len(_normalized(check)["messages"])  # shorter than the history it replaced
    cut = [r for r in recs if r["finish_reason"] == "length"]
    # the proxy's answer: finishReason MAX_TOKENS, no half functionCall; Gemini CLI retries the same request
    assert cut[0] is after and len({json.dumps(_normalized(r)["messages"]) for r in cut}) == 1
    assert recs[-1] in cut and len(recs) == len(turns) + 2 + len(cut)


GEMINI_COMPACT_AT = 1000  # Gemini CLI's model.compressionThreshold x 1 048 576, in the upstream's (cheap) tokens


def test_claude_code_long_session(tmp_path, exact):
    """Claude Code, untrimmed (its normal system prompt and tools, no --bare), compacts by its own
    window (``CLAUDE_CODE_AUTO_COMPACT_WINDOW``, ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE``): a streamed
    /v1/messages call with its tools, the history and a last user message "CRITICAL: Respond with TEXT
    ONLY. Do NOT call any tools. ... Your task is to create a detailed summary of the conversation so
    far ..."; the next call starts from a user message "This session is being continued from a
    previous conversation that ran out of context. ..." and keeps the most recent tool results."""

    def configure(s: h.Session, inv: h.Invocation) -> None:
        inv.env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(CLAUDE_WINDOW)
        inv.env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] = str(CLAUDE_PCT)

    turns = [
        _bash(LONG_CMD, "Bash"),
        _bash(PNG_CMD, "Bash"),
        {"tool_calls": [{"name": "Read", "arguments": {"file_path": "IMG"}}]},
        *[_bash(_big(i, 4000), "Bash") for i in range(12)],
        *[{"text": "All steps done."}] * 12,
    ]
    summary = {"text": "<summary>Summary: the steps ran.</summary>"}
    res = _long_run(tmp_path, "claude-code", turns, exact=exact, max_model_len=400000, configure=configure, summary=summary,
                    trim=False, patch_turns=True, resumed={"text": "All steps done."})
    _check_common(res)
    if exact:  # the rest follows the plain run's flow, which the budget cut shapes
        return
    assert res["run"].returncode == 0, res["tail"]
    recs = res["recs"]
    # the cut call: stop_reason max_tokens after a tool_use streamed as far as it was written; Claude
    # Code's own input validation refuses it and tells the model, and the run goes on
    first_result = _normalized(recs[1])["messages"][-1]
    assert recs[0]["finish_reason"] == "length" and "InputValidationError" in first_result["content"]
    assert any(d.startswith("summary call (claude-code)") for d in res["details"]), res["details"]
    assert "resumed from a summary (claude-code)" in res["details"]
    (summary_call,) = _summary_calls(recs)
    # a streamed /v1/messages call, its tools kept, the history, then a user message "CRITICAL:
    # Respond with TEXT ONLY. ..." holding "Your task is to create a detailed summary ..."
    last = _normalized(summary_call)["messages"][-1]["content"]
    assert summary_call["native_path"].startswith("/v1/messages") and summary_call["native_request"]["tools"]
    assert last.startswith("CRITICAL: Respond with TEXT ONLY.") and summary_call["output_text"].startswith("<summary>")
    after = recs[recs.index(summary_call) + 1]
    assert len(after["prompt_token_ids"]) < len(summary_call["prompt_token_ids"])
    assert recs[-1]["output_text"] == "All steps done."


CLAUDE_WINDOW, CLAUDE_PCT = 60000, 50  # compacts at ~30k (cheap) tokens: the first prompt has ~6.5k


def test_opencode_long_session(tmp_path, exact):
    """OpenCode compacts by its model's ``limit.context`` (opencode.json): a streamed chat call, no
    tools, one user message "Here is the conversation so far: <conversation>...</conversation> Create a
    new anchored summary ..."; the next call: user "What did we do so far?", the summary as the
    assistant's answer, the most recent messages, then user "Continue if you have next steps, ..."."""

    def configure(s: h.Session, inv: h.Invocation) -> None:
        path = Path(inv.env["OPENCODE_CONFIG"])
        cfg = json.loads(path.read_text())
        cfg["provider"]["polar"]["models"]["scripted-model"].update(
            {"limit": {"context": OPENCODE_CONTEXT, "output": 4096}, "attachment": True,
             "modalities": {"input": ["text", "image"], "output": ["text"]}})
        path.write_text(json.dumps(cfg))

    def bash(cmd: str) -> dict:
        return {"tool_calls": [{"name": "bash", "arguments": {"command": cmd, "description": "a step"}}]}

    turns = [
        bash(LONG_CMD),
        bash(PNG_CMD),
        {"tool_calls": [{"name": "read", "arguments": {"filePath": "IMG"}}]},
        *[bash(_big(i, 4000)) for i in range(12)],
        *[{"text": "All steps done."}] * 12,
    ]
    summary = {"text": "Summary: the steps ran."}
    res = _long_run(tmp_path, "opencode", turns, exact=exact, max_model_len=400000, configure=configure, summary=summary,
                    patch_turns=True, resumed={"text": "All steps done."})
    _check_common(res)
    if exact:  # the rest follows the plain run's flow, which the budget cut shapes
        return
    assert res["run"].returncode == 0, res["tail"]
    recs = res["recs"]
    assert any(d.startswith("summary call (opencode)") for d in res["details"]), res["details"]
    assert any(d.startswith("resumed from a summary (opencode)") for d in res["details"]), res["details"]
    (summary_call,) = _summary_calls(recs)
    assert not summary_call["native_request"].get("tools")
    assert recs[-1]["output_text"] == "All steps done."


OPENCODE_CONTEXT = 40000
