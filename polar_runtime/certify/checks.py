"""The checks ``polar certify`` grades a run by, each read from what the run left on disk.

Each check returns a :class:`CheckResult`: its measured number, the count of cases it judged and
the minimum that count needs before a verdict means anything, and the named failures. A failure
FAILs the check whatever the count (a break must never hide behind a small run); without failures
a check PASSes only when it judged at least its minimum, else it is NOT EXERCISED.

Every property has one definition in the project, and the checks read them rather than restate
them: the drift report's causes (``polar_analysis.drift``: what a re-sent answer became), the
trainer's sampling rules (``polar_analysis.trajectories.common.trainer_sampling``: what the
trainer can reproduce), the template's reasoning causes (``TEMPLATE_RERENDERED``), the proxy's
flow metadata (``polar_core.flowmeta``: which flow is a model call, which an auxiliary one). What a
check adds is the cross-examination: the ids under the loss mask against the captured sampled ids,
the proxy's ``history`` claim against the ids, a sampled tool call against the harness's next
request. The checks that need the trainer or the server (logprob agreement, policy delivery) are
in ``delivery.py``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

PASS, FAIL, NOT_EXERCISED, MEASURED = "PASS", "FAIL", "NOT EXERCISED", "MEASURED"

#: Cases a check must judge before its verdict means anything (the issue's example: a merge rate over
#: fewer than 10 re-sent answers says little). Counted per check in the unit its number is in.
MINIMUM = {
    "capture": 5,  # model-API flows in the saved flows
    "exact history": 10,  # re-sent answers
    "mask": 100,  # sampled tokens under the loss mask
    "logprob agreement": 100,  # sampled tokens recomputed by the trainer
    "sampling": 5,  # calls
    "tool calls": 3,  # sampled tool calls that the harness's next request could carry back
    "reasoning": 3,  # calls whose answer holds reasoning
    "policy delivery": 1,  # calls served after the push
}
#: exact history: the share of re-sent answers that must be spliced exactly (the issue's 99%)
EXACT_RATE = 0.99
#: failures listed per check (the count is always complete)
MAX_DETAILS = 8


@dataclass
class CheckResult:
    name: str
    state: str  # PASS | FAIL | NOT EXERCISED | MEASURED (a number not graded yet: bf16 logprobs)
    measured: str  # the check's number, in words
    count: int  # cases judged
    minimum: int
    value: float | None = None  # the headline number (a rate, a KL, ...)
    failures: int = 0
    details: list[str] = field(default_factory=list)  # named failures (first MAX_DETAILS) and notes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def judge(name: str, count: int, failures: list[str], measured: str, value: float | None = None,
          notes: Iterable[str] = ()) -> CheckResult:
    """FAIL on any failure; else PASS when ``count`` reaches the check's minimum, else NOT EXERCISED."""
    minimum = MINIMUM[name]
    state = FAIL if failures else (PASS if count >= minimum else NOT_EXERCISED)
    details = failures[:MAX_DETAILS] + ([f"... {len(failures) - MAX_DETAILS} more"] if len(failures) > MAX_DETAILS else [])
    if state == NOT_EXERCISED:
        details.append(f"judged {count}, needs at least {minimum}")
    return CheckResult(name, state, measured, count, minimum, value, len(failures), details + list(notes))


# ---------------------------------------------------------------------------------------------
# what a run left: the evidence the checks read


@dataclass
class Evidence:
    """A run's captures (records by call id, the calls frame), its trajectories and saved flows."""

    captures: Path
    records: list[dict[str, Any]]  # capture records of the judged sessions, in file (call) order
    calls_lf: Any  # polars LazyFrame of the same calls (frames.calls)
    template: Any  # TemplateInfo of the served model's chat template (None: inferred from the calls)
    trajectories: Any = None  # polars DataFrame of training sequences (None: not built)
    flows: Path | None = None  # saved mitmproxy flows of the run (``save_stream_file``)
    tokenizer: Any = None  # the served model's tokenizer (None: delivered text not compared with the ids)
    _drift: Any = None
    _bodies: Any = None  # call id -> the body the harness received (_received_bodies)

    @classmethod
    def load(cls, captures: str | Path, model_dir: str | Path | None, *, sessions: Iterable[str] | None = None,
             trajectories: Any = None, flows: str | Path | None = None, cache_dir: str | Path | None = None) -> "Evidence":
        import polars as pl

        from polar_analysis import alignment, frames
        from polar_core.schema import read_capture_lines

        captures = Path(captures)
        wanted = set(sessions) if sessions is not None else None
        records = [r for f in frames.session_files(captures) for r in read_capture_lines(f)
                   if r.get("record_type", "call") == "call" and (wanted is None or r.get("session_id") in wanted)]
        lf = frames.calls(captures, rewards=None, cache_dir=cache_dir)
        if wanted is not None:
            lf = lf.filter(pl.col("session_id").is_in(sorted(wanted)))
        renderer = alignment.get_renderer(model_dir) if model_dir else None
        template = alignment.template_info_for(renderer, lf)
        if isinstance(trajectories, (str, Path)):
            trajectories = pl.read_parquet(trajectories)
        flows_path = Path(flows) if flows else captures / "flows.mitm"
        return cls(captures, records, lf, template, trajectories, flows_path if flows_path.is_file() else None,
                   getattr(renderer, "tokenizer", None))

    @property
    def by_id(self) -> dict[str, dict[str, Any]]:
        return {r["call_id"]: r for r in self.records}

    def drift(self) -> list[dict[str, Any]]:
        """The drift report's rows (one per usable call: its predecessor and the cause)."""
        if self._drift is None:
            from polar_analysis import drift

            self._drift = drift.drift_report(self.calls_lf, self.template).to_dicts()
        return self._drift

    def successors(self) -> dict[str, dict[str, Any]]:
        """call id -> the drift row of the later call that continued its conversation (the first one)."""
        out: dict[str, dict[str, Any]] = {}
        for row in self.drift():
            if row.get("prev_call_id") and row["prev_call_id"] not in out:
                out[row["prev_call_id"]] = row
        return out


def _messages(rec: dict[str, Any] | None) -> list[dict[str, Any]]:
    return list(((rec or {}).get("normalized_request") or {}).get("messages") or [])


def _usable(rec: dict[str, Any]) -> bool:
    ids, lps = rec.get("sampled_token_ids") or [], rec.get("sampled_logprobs") or []
    return rec.get("status") == "ok" and len(ids) > 0 and len(lps) == len(ids)


def _label(rec: dict[str, Any]) -> str:
    return f"{rec.get('session_id')}#{rec.get('call_index')}"


# ---------------------------------------------------------------------------------------------
# capture


def _flow_kinds(path: Path) -> list[tuple[str, dict[str, Any], Any]]:
    """(kind, polar metadata, flow) per HTTP flow: model | side | control | passthrough | unlabelled."""
    from mitmproxy import http, io

    from polar_core.flowmeta import META_KEY

    out = []
    with open(path, "rb") as fh:
        for flow in io.FlowReader(fh).stream():
            if not isinstance(flow, http.HTTPFlow):
                continue
            meta = (flow.metadata or {}).get(META_KEY)
            if not isinstance(meta, dict):
                out.append(("unlabelled", {}, flow))
            elif meta.get("control"):
                out.append(("control", meta, flow))
            elif meta.get("side_call") is not None:
                out.append(("side", meta, flow))
            elif meta.get("passthrough"):
                out.append(("passthrough", meta, flow))
            else:
                out.append(("model", meta, flow))
    return out


#: paths of the provider APIs a model call goes to (an unlabelled flow to one of them is a lost call)
_MODEL_PATHS = ("/chat/completions", "/messages", "/responses", ":generateContent", ":streamGenerateContent")


def check_capture(ev: Evidence) -> CheckResult:
    """Every model-API flow in the saved flows has a capture record with prompt ids, sampled ids and
    one logprob per sampled id; auxiliary calls (token counts, model lists: the proxy's side calls;
    the harnesses' known side requests) are labelled and never in a training sequence."""
    from polar_core.compaction import side_call_of

    if ev.flows is None:
        return judge("capture", 0, [], "no saved flows to compare the captures with")
    by_id = ev.by_id
    sessions = {r["session_id"] for r in ev.records}
    failures: list[str] = []
    model = side = bad = 0
    for kind, meta, flow in _flow_kinds(ev.flows):
        path = flow.request.path.split("?", 1)[0]
        if kind == "unlabelled" and any(path.endswith(p) or p in path for p in _MODEL_PATHS):
            failures.append(f"flow {flow.request.method} {path}: a model-API request the proxy did not label")
        if kind == "side":
            side += 1
        if kind != "model" or (meta.get("session") and meta.get("session") not in sessions):
            continue
        model += 1
        rec = by_id.get(str(meta.get("call_id") or ""))
        name = f"{meta.get('session')}#{meta.get('call_index')}"
        problem = None
        if rec is None:
            problem = f"flow {name} ({path}): no capture record (call_id {meta.get('call_id')})"
        elif rec.get("status") == "ok" and not rec.get("prompt_token_ids"):
            problem = f"{name}: record without prompt ids"
        elif rec.get("status") == "ok" and len(rec.get("sampled_logprobs") or []) != len(rec.get("sampled_token_ids") or []):
            problem = (f"{name}: {len(rec.get('sampled_token_ids') or [])} sampled ids but "
                       f"{len(rec.get('sampled_logprobs') or [])} logprobs")
        if problem:
            bad += 1
            failures.append(problem)
    aux = [r for r in ev.records if side_call_of(_messages(r))]
    trained = set()
    if ev.trajectories is not None and aux:
        trained = {c for ids in ev.trajectories["call_ids"].to_list() for c in ids}
    for r in aux:
        if r["call_id"] in trained:
            failures.append(f"{_label(r)}: auxiliary call ({side_call_of(_messages(r))}) is in a training sequence")
    ok = model - bad
    measured = f"{ok}/{model} model flows with a record (ids + logprobs); {side + len(aux)} auxiliary, labelled"
    return judge("capture", model, failures, measured, value=ok / model if model else None)


# ---------------------------------------------------------------------------------------------
# exact history


def check_exact_history(ev: Evidence) -> CheckResult:
    """Of the answers the harness re-sent as it received them, >= 99% spliced exactly: the next prompt
    is the previous prompt + the sampled ids (drift cause ``none``), or the proxy followed the
    template's own rule (it drops earlier reasoning: ``TEMPLATE_RERENDERED``). A call that continues
    a conversation whose history the harness itself edited (the drift report's ``harness`` origin:
    an answer dropped, a compaction, another system prompt; no engine can undo these, and the proxy
    splices up to them) is counted and named, not graded: Pi drops an answer cut by the length limit
    with no text (tiny-r1's reasoning runs to the cap), and the loop then trains each call in its
    own context. Every other non-exact one has a named cause (``other`` is no name), and a call the
    proxy recorded as ``history: exact`` must be exact in its ids (its claim is checked, not believed)."""
    from polar_analysis.drift import ORIGIN
    from polar_analysis.trajectories.common import TEMPLATE_RERENDERED

    by_id = ev.by_id
    resent = exact = template = 0
    causes: dict[str, int] = {}
    edited: dict[str, int] = {}
    failures: list[str] = []
    for row in ev.drift():
        cause = row["cause"]
        if cause == "new_conversation":
            continue
        rec = by_id.get(row["call_id"], {})
        where = f"{row['session_id']}#{row['call_index']}"
        # an answer the harness dropped was not re-sent: the record's claim covers nothing of it (Qwen
        # Code drops tiny-r1's reasoning-only answers and asks again; the proxy's ``exact`` is then
        # about the answers it did re-send)
        if (rec.get("history") == "exact" and cause != "none" and cause not in TEMPLATE_RERENDERED
                and cause != "answer_dropped"):
            failures.append(f"{where}: recorded as history=exact but its prompt is not the previous prompt + sampled ids "
                            f"(cause {cause}, prompt diverges at {row.get('prompt_divergence')}, answer at "
                            f"{row.get('answer_divergence')})")
        if ORIGIN.get(cause) == "harness":
            edited[cause] = edited.get(cause, 0) + 1
            continue
        resent += 1
        if cause == "none":
            exact += 1
            continue
        if cause in TEMPLATE_RERENDERED:
            template += 1
            continue
        causes[cause] = causes.get(cause, 0) + 1
        if cause == "other":
            failures.append(f"{where}: re-sent answer changed without a named cause ({row.get('detail') or 'no detail'})")
    rate = (exact + template) / resent if resent else None
    if rate is not None and rate < EXACT_RATE:
        failures.insert(0, f"{rate:.1%} of {resent} re-sent answers spliced exactly (< {EXACT_RATE:.0%}); "
                           f"causes of the others: {causes}")
    measured = (f"{exact + template}/{resent} re-sent answers spliced exactly"
                + (f" ({rate:.1%})" if rate is not None else "")
                + (f", {template} of them as the template drops reasoning" if template else "")
                + (f"; others: {', '.join(f'{k} {v}' for k, v in sorted(causes.items()))}" if causes else "")
                + (f"; not graded, the harness edited its history: {', '.join(f'{k} {v}' for k, v in sorted(edited.items()))}"
                   if edited else ""))
    return judge("exact history", resent, failures, measured, value=rate)


# ---------------------------------------------------------------------------------------------
# mask


def check_mask(ev: Evidence) -> CheckResult:
    """In every training sequence the ids under the loss mask are exactly the sampled ids of its
    calls, in call order (none dropped, none duplicated), with the captured logprobs; nothing else is
    under the mask; and every usable call of the run is trained in exactly one sequence (a harness's
    side call in none: the capture check fails one that is trained)."""
    import numpy as np

    if ev.trajectories is None:
        return judge("mask", 0, [], "no training sequences built")
    by_id = ev.by_id
    failures: list[str] = []
    tokens = 0
    seen: dict[str, int] = {}
    for row in ev.trajectories.iter_rows(named=True):
        tid = row["trajectory_id"]
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=np.int64)
        lps = np.asarray(row["logprobs"], dtype=np.float64)
        if mask.shape != ids.shape or lps.shape != ids.shape:
            failures.append(f"{tid}: {ids.size} ids, {mask.size} mask values, {lps.size} logprobs")
            continue
        if ((mask != 0) & (mask != 1)).any():
            failures.append(f"{tid}: loss mask holds values other than 0 and 1")
            continue
        want_ids, want_lps = [], []
        for cid in row["call_ids"]:
            seen[cid] = seen.get(cid, 0) + 1
            rec = by_id.get(cid)
            if rec is None:
                failures.append(f"{tid}: call {cid} is not in the captures")
                continue
            want_ids += list(rec.get("sampled_token_ids") or [])
            want_lps += list(rec.get("sampled_logprobs") or [])
        got = ids[mask == 1]
        want = np.asarray(want_ids, dtype=np.int64)
        tokens += int(got.size)
        if got.size != want.size or not np.array_equal(got, want):
            n = min(got.size, want.size)
            at = next((i for i in range(n) if got[i] != want[i]), n)
            pos = np.flatnonzero(mask == 1)
            failures.append(f"{tid}: {got.size} ids under the mask, {want.size} sampled by its calls; first "
                            f"difference at masked token {at} (sequence position {int(pos[at]) if at < pos.size else '-'})")
            continue
        if not np.allclose(lps[mask == 1], np.asarray(want_lps, dtype=np.float64), rtol=0, atol=1e-9):
            failures.append(f"{tid}: behaviour logprobs under the mask are not the captured ones")
    from polar_core.compaction import side_call_of

    for r in ev.records:  # a harness's side call is kept out by the builder (the capture check's rule)
        if _usable(r) and seen.get(r["call_id"], 0) != 1 and not (seen.get(r["call_id"], 0) == 0
                                                                 and side_call_of(_messages(r))):
            failures.append(f"{_label(r)}: trained in {seen.get(r['call_id'], 0)} sequences (exactly one expected)")
    measured = f"{tokens} sampled tokens in {ev.trajectories.height} sequences, {len(failures)} misplaced"
    return judge("mask", tokens, failures, measured, value=float(len(failures)))


# ---------------------------------------------------------------------------------------------
# sampling


def check_sampling(ev: Evidence, temperature: float) -> CheckResult:
    """Every call's effective sampling (the record's ``sampling``: what the engine applied) is the
    run's (plain sampling at ``temperature``), the trainer can reproduce it (a call it would refuse
    is named), and every training sequence is trained at its calls' temperature/top-k/top-p."""
    from polar_analysis.trajectories.common import trainer_sampling

    failures: list[str] = []
    want = (float(temperature), 0, 1.0)
    effective: dict[str, tuple[float | None, int, float]] = {}
    n = 0
    for r in ev.records:
        if r.get("status") != "ok":
            continue
        n += 1
        t, k, p, issue = trainer_sampling(r.get("sampling"), f"call {_label(r)}")
        effective[r["call_id"]] = (t, k, p)
        if issue:
            failures.append(f"the trainer would refuse {issue}")
        elif (t, k, p) != want:
            failures.append(f"call {_label(r)} sampled at temperature={t:g}, top_k={k}, top_p={p:g}; the run's is "
                            f"temperature={want[0]:g}, top_k=0, top_p=1")
    if ev.trajectories is not None and "temperature" in ev.trajectories.columns:
        for row in ev.trajectories.iter_rows(named=True):
            got = (row["temperature"], max(int(row["top_k"] or 0), 0), row["top_p"])
            for cid in row["call_ids"]:
                eff = effective.get(cid)
                if eff is None or eff[0] is None or row["sampling_issue"]:
                    continue
                if got[0] is None or abs(got[0] - eff[0]) > 1e-9 or got[1] != eff[1] or abs((got[2] or 0) - eff[2]) > 1e-9:
                    failures.append(f"{row['trajectory_id']} is trained at temperature={got[0]}, top_k={got[1]}, "
                                    f"top_p={got[2]}; its call {cid} sampled at temperature={eff[0]:g}, top_k={eff[1]}, "
                                    f"top_p={eff[2]:g}")
                    break
    temps = sorted({e[0] for e in effective.values() if e[0] is not None})
    measured = (f"{n - len(failures)}/{n} calls at the run's sampling (temperature {temperature:g}); "
                f"temperatures seen: {', '.join(f'{t:g}' for t in temps) or '-'}")
    return judge("sampling", n, failures, measured, value=(n - len(failures)) / n if n else None)


# ---------------------------------------------------------------------------------------------
# tool calls


def _canonical_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return args.strip()
    return json.dumps(args, sort_keys=True, separators=(",", ":"))


def _parsed(args: str) -> Any:
    try:
        return json.loads(args)
    except ValueError:
        return args


def _request_tool_calls(rec: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(id, name, canonical arguments) of every assistant tool call in a normalized request."""
    out = []
    for m in _messages(rec):
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or {}
            out.append((str(tc.get("id") or ""), str(fn.get("name") or ""), _canonical_args(fn.get("arguments"))))
    return out


def _received_bodies(ev: Evidence) -> dict[str, str]:
    """call id -> the whole response body the harness received (UTF-8), read once per run from the
    saved flows; a body cut at ``polar_flow_body_limit`` is left out (it cannot say what is missing)."""
    if getattr(ev, "flows", None) is None:
        return {}
    cached = getattr(ev, "_bodies", None)
    if cached is not None:
        return cached
    out = {}
    for kind, meta, flow in _flow_kinds(ev.flows):
        kept = meta.get("response_body") or {}
        if kind == "model" and meta.get("call_id") and flow.response is not None and kept.get("kept") == kept.get("sent"):
            out[str(meta["call_id"])] = (flow.response.content or b"").decode("utf-8", "replace")
    ev._bodies = out
    return out


def check_tool_calls(ev: Evidence) -> CheckResult:
    """Every tool call the model sampled reached the harness in its own wire format (its name and id
    in the answer the harness received, when the flows were saved) and came back in the harness's
    next request of that conversation: the same name and arguments (as JSON, key order aside), under
    the same id in the harness's own request body."""
    by_id = ev.by_id
    nxt = ev.successors()
    from polar_analysis.drift import added_arguments

    responses = _received_bodies(ev)
    failures: list[str] = []
    sampled = returned = ended = 0
    added: dict[str, int] = {}
    for rec in ev.records:
        calls = rec.get("output_tool_calls") or []
        if rec.get("status") != "ok" or not calls:
            continue
        body = responses.get(rec["call_id"])
        for tc in calls:
            sampled += 1
            name, tid = str(tc.get("name") or ""), str(tc.get("id") or "")
            if body is not None and (name not in body or (tid and tid not in body)):
                failures.append(f"{_label(rec)}: tool call {name} ({tid}) is not in the answer the harness received")
        row = nxt.get(rec["call_id"])
        if row is None:
            ended += len(calls)  # the session ended (or timed out) on this answer: nothing to come back in
            continue
        if row["cause"] == "compacted":
            continue  # the harness replaced its history by a summary: named by the drift report
        later = by_id.get(row["call_id"], {})
        carried = _request_tool_calls(later)
        native = json.dumps(later.get("native_request") or {})
        # Google's wire format may leave a call's id out (the proxy then pairs calls and results by
        # name): there the name and arguments must come back, elsewhere the id too
        ids_required = rec.get("provider") != "google"
        for tc in calls:
            returned += 1
            name, tid, args = str(tc.get("name") or ""), str(tc.get("id") or ""), _canonical_args(tc.get("arguments"))
            match = [c for c in carried if c[1] == name and c[2] == args]
            if not match:  # the harness may fill in arguments the model left out: named, every sampled one kept
                for c in carried:
                    keys = added_arguments([tc], [(c[1], _parsed(c[2]), c[2])]) if c[1] == name else None
                    if keys:
                        match = [c]
                        for key in keys:
                            added[key] = added.get(key, 0) + 1
                        break
            if not match:
                failures.append(f"{_label(rec)}: tool call {name}({args[:60]}) did not come back in the next request "
                                f"{row['session_id']}#{row['call_index']} (drift cause {row['cause']})")
            elif ids_required and tid and (tid not in native or not any(c[0] == tid for c in match)):
                failures.append(f"{_label(rec)}: tool call {name} came back without its id {tid} in the harness's "
                                "own next request")
    measured = (f"{returned - len(failures)}/{returned} sampled tool calls came back in the next request"
                + (f" ({sampled} sampled, {ended} ended their session)" if sampled else "")
                + (f"; arguments the harness added: {', '.join(f'{k} {v}' for k, v in sorted(added.items()))}"
                   if added else ""))
    return judge("tool calls", returned, failures, measured, value=(returned - len(failures)) / returned if returned else None)


# ---------------------------------------------------------------------------------------------
# reasoning

_THINK_MARKS = ("<think>", "</think>")


def _squeezed(text: str, drop: Iterable[str] = ()) -> str:
    for token in drop:
        text = text.replace(token, "")
    return "".join(text.split())


def _special_tokens(tokenizer: Any) -> list[str]:
    return [t.content for t in tokenizer.added_tokens_decoder.values() if t.special] if tokenizer is not None else []


def _not_received(rec: dict[str, Any], body: str | None, special: list[str]) -> str | None:
    """Why the harness did not get the call's reasoning as reasoning, or None when it did (or the
    flow is not there to say): the reasoning must be in the provider's reasoning field, whole."""
    from .received import reasoning_and_text

    got = reasoning_and_text(str(rec.get("provider") or ""), body) if body is not None else None
    if got is None:
        return None
    want = _squeezed(rec.get("output_reasoning") or "", special)
    reasoning, text = (_squeezed(x, special) for x in got)
    if want in reasoning:
        return None
    if want in text:
        return f"reasoning delivered as answer text ({len(want)} characters in the answer field, {len(reasoning)} as reasoning)"
    return (f"reasoning not delivered whole: {len(reasoning)} characters in the harness's reasoning field "
            f"for {len(want)} sampled (whitespace and special tokens aside)")


def _not_sampled(rec: dict[str, Any], tokenizer: Any) -> str | None:
    """Why the delivered reasoning is not text of the call's sampled ids, or None when it is.

    Compared without whitespace and special tokens: the engine's streamed text leaves special tokens
    out and the derendered answer keeps them (tiny-r1 sampled ``<|video_pad|>`` mid-reasoning), and
    parsers differ on whitespace at the edges. What this catches is text the model did not sample
    in that place: the same reasoning delivered twice (8,016 characters for 4,015), another call's."""
    ids = rec.get("sampled_token_ids") or []
    if tokenizer is None or not ids:
        return None
    special = _special_tokens(tokenizer)
    delivered = _squeezed(rec.get("output_reasoning") or "", special)
    sampled = _squeezed(tokenizer.decode(ids, skip_special_tokens=True), special)
    if delivered in sampled:
        return None
    return (f"delivered reasoning is not the sampled text: {len(delivered)} characters delivered, "
            f"the {len(ids)} sampled ids decode to {len(sampled)} (whitespace and special tokens aside)")


def check_reasoning(ev: Evidence) -> CheckResult:
    """Reasoning was delivered as reasoning (no think markup in the answer text; the delivered
    reasoning is text of the sampled ids, once; the saved flow shows the harness got it whole in its
    provider's reasoning field, not as answer text: ``received.py``) and the history kept or dropped it as the template
    does: kept (the next prompt holds the sampled ids: drift ``none``) or dropped by the template's
    own rule (``template_dropped_reasoning``), never removed or changed by the history. A stream the
    derendered answer parted from (a special token the engine's text leaves out) is counted: the
    harness holds the engine's text, and exact history names the cause."""
    nxt = ev.successors()
    bodies = _received_bodies(ev)
    special = _special_tokens(getattr(ev, "tokenizer", None))
    failures: list[str] = []
    n = kept = dropped = parted = 0
    for rec in ev.records:
        if rec.get("status") != "ok" or not (rec.get("output_reasoning") or "").strip():
            continue
        n += 1
        text = rec.get("output_text") or ""
        if any(m in text for m in _THINK_MARKS):
            failures.append(f"{_label(rec)}: reasoning markup in the answer text")
        wrong = _not_sampled(rec, getattr(ev, "tokenizer", None)) or _not_received(rec, bodies.get(rec["call_id"]), special)
        if wrong:
            failures.append(f"{_label(rec)}: {wrong}")
        parted += any("differs from the derendered" in note for note in rec.get("translation_notes") or [])
        row = nxt.get(rec["call_id"])
        if row is None:
            continue
        if row["cause"] == "none":
            kept += 1
        elif row["cause"] == "template_dropped_reasoning":
            dropped += 1
        elif row["cause"] in ("reasoning_removed", "reasoning_changed"):
            failures.append(f"{_label(rec)}: the next prompt {row['cause'].replace('_', ' ')} its reasoning, which the "
                            "template keeps")
    # judged: answers whose next prompt shows what the history did with their reasoning (an answer the
    # harness dropped whole, or the last of a session, shows nothing: delivered, but the history not seen)
    judged = kept + dropped + sum(1 for f in failures if "which the template keeps" in f)
    measured = (f"{n} answers with reasoning, delivered as reasoning; in the next prompt {kept} kept, "
                f"{dropped} dropped by the template"
                + (f"; {parted} streamed apart from the derendered answer (the engine's text delivered)" if parted else ""))
    return judge("reasoning", judged, failures, measured, value=float(judged))
