"""One sample's page data (``data/samples/<i>.js``): the conversation as the harness saw it, the
verdict, the sandbox's notes, the timings, every call (its tokens, its raw request and response)
and every training sequence made of it (tokens, mask, provenance, why it was split, what the
trainer recorded).

Where each answer comes from:

* the conversation and the calls: the session's capture records (``captures/sessions/<id>.jsonl``);
  the harness's view is the last call's request (``native_request``: its own wire format, shown
  after the normalized messages) plus the last answer;
* verdict, verifier output, sandbox notes, timings: the sample's row of ``captures/rollouts.parquet``
  and the end of its harness logs (``captures/work/<id>/logs/``: written by the sample, so read
  through the safe reader and capped);
* why a sequence was split: the drift report of its first call
  (:func:`polar_analysis.drift.drift_report`, the classifier the prefix merge uses for breaks);
* per token: the trajectory's ids, loss mask and behaviour logprobs, each span's call and kind
  (a ``prompt`` span after the first one is what the harness or the template put between two
  calls: tool results, template glue; mask 0, never trained), and the trainer's record
  (``train/tokens/``: its own logprob, the advantage; ``training/token_record.py``).
"""

from __future__ import annotations

from typing import Any

from .runfiles import RunFiles

#: why a sequence of a trained step has no token in the trainer's record (token_record.py's names)
LEFT_OUT = {
    "zero_variance": "its group's rewards were all equal (zero advantage): left out of the step",
    "stale": "sampled by weights older than max_staleness: left out of the step",
    "not_recorded": "trained, but over the record's bound of sequences per step (not recorded)",
}


def calls_frame(records: list[dict[str, Any]]) -> Any:
    """The analysis' calls frame of one session's records (in memory: no cache written into the run)."""
    from polar_analysis.frames import InvalidRecord, _with_derived, normalize_record, rows_to_frame

    rows = []
    for rec in records:
        try:
            rows.append(normalize_record(rec))
        except InvalidRecord:
            continue
    for r in rows:
        r["source_file"], r["source_line"] = "", 0
    return _with_derived(rows_to_frame(rows).lazy())


def session_drift(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The drift report's rows of one session (cause and detail per call)."""
    from polar_analysis.drift import drift_report

    if not records:
        return []
    rep = drift_report(calls_frame(records))
    keep = ("session_id", "call_id", "call_index", "prev_call_index", "cause", "origin", "exact", "detail",
            "prompt_divergence", "prev_text", "next_text")
    return [{k: r.get(k) for k in keep} for r in rep.to_dicts()]


def _skip_reason(rec: dict[str, Any]) -> str | None:
    """Why a call has no token in any sequence (the builders' ``count_skipped``), or None."""
    ids, lps = rec.get("sampled_token_ids") or [], rec.get("sampled_logprobs") or []
    if rec.get("status", "ok") != "ok":
        return f"the call failed ({rec.get('error_kind') or rec.get('status')}): its tokens are not trained"
    if not ids:
        return "no sampled token"
    if len(lps) != len(ids) or any(v is None for v in lps):
        return "no logprob for every sampled token: left out of training (skipped_no_logprobs)"
    return None


def _messages(rec: dict[str, Any] | None) -> list[dict[str, Any]]:
    req = (rec or {}).get("normalized_request") or {}
    msgs = req.get("messages") if isinstance(req, dict) else None
    return msgs if isinstance(msgs, list) else []


def _call(rec: dict[str, Any], flow: dict[str, Any] | None) -> dict[str, Any]:
    t0 = rec.get("t_request_in")
    timings = {k: (rec.get(k) - t0 if isinstance(rec.get(k), (int, float)) and t0 else None)
               for k in ("t_upstream_sent", "t_upstream_first_byte", "t_upstream_end", "t_response_out")}
    return {
        "call_index": rec.get("call_index"), "call_id": rec.get("call_id"), "status": rec.get("status"),
        "http_status": rec.get("http_status"), "error": rec.get("error"), "finish_reason": rec.get("finish_reason"),
        "policy_version": rec.get("policy_version"), "provider": rec.get("provider"), "harness": rec.get("harness"),
        "history": rec.get("history"), "history_cause": rec.get("history_cause"),
        "translation_notes": rec.get("translation_notes") or [], "sampling": rec.get("sampling"),
        "t_request_in": t0, "timings": timings, "n_prompt": len(rec.get("prompt_token_ids") or []),
        "sampled": rec.get("sampled_token_ids") or [], "logprobs": rec.get("sampled_logprobs") or [],
        "output_text": rec.get("output_text") or "", "output_reasoning": rec.get("output_reasoning") or "",
        "output_tool_calls": rec.get("output_tool_calls") or [], "skip": _skip_reason(rec),
        "raw": flow,
    }


def _split_cause(row: dict[str, Any], drift_by_call: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Why this sequence is not the continuation of an earlier one (None for a sample's first)."""
    if not row.get("segment_index") and not row.get("chain_index"):
        return None
    first = (row.get("call_ids") or [None])[0]
    d = drift_by_call.get(first) or {}
    cause = d.get("cause") or "unknown"
    if row.get("segment_index"):
        what = f"split: segment {row['segment_index']} of chain {row['chain_index']}"
    else:
        what = f"a chain of its own (chain {row['chain_index']})"
    return {"label": what, "cause": cause, "origin": d.get("origin"), "detail": d.get("detail"),
            "prev_call_index": d.get("prev_call_index"), "prev_text": d.get("prev_text"), "next_text": d.get("next_text")}


def _sequence(row: dict[str, Any], drift_by_call: dict[str, dict[str, Any]], record: Any,
              left_out: dict[str, str], trained_step: bool) -> dict[str, Any]:
    tid = row["trajectory_id"]
    ids = list(row.get("input_ids") or [])
    n = len(ids)
    trainer = [None] * n
    advantage = None
    steps: set[int] = set()
    if record is not None:
        for pos, lp, adv, step in zip(record["position"], record["trainer_logprob"], record["advantage"], record["step"]):
            if 0 <= pos < n:
                trainer[pos] = lp
            advantage, _ = adv, steps.add(step)
    if advantage is not None:
        why = None
    elif tid in left_out:
        why = LEFT_OUT.get(left_out[tid], left_out[tid])
    elif trained_step:
        why = "no token of it in the trainer's record (its step's record was pruned, or written before records existed)"
    else:
        why = "its step trained nothing (the final rollout, or a step whose groups all scored alike)"
    spans = [{"call_index": c, "start": s, "end": e, "kind": k, "injected": k == "prompt" and j > 0}
             for j, (c, s, e, k) in enumerate(zip(row.get("span_call_index") or [], row.get("span_start") or [],
                                                   row.get("span_end") or [], row.get("span_kind") or []))]
    return {
        "trajectory_id": tid, "chain_index": row.get("chain_index"), "segment_index": row.get("segment_index"),
        "n_calls": row.get("n_calls"), "call_ids": row.get("call_ids") or [], "policy_version": row.get("policy_version"),
        "reward": row.get("reward"), "status": row.get("status"), "ids": ids, "mask": list(row.get("loss_mask") or []),
        "behaviour": [lp if m else None for lp, m in zip(row.get("logprobs") or [], row.get("loss_mask") or [])],
        "trainer": trainer, "advantage": advantage, "trained_steps": sorted(steps), "not_trained": why,
        "spans": spans, "merge_kinds": row.get("merge_kind") or [], "split": _split_cause(row, drift_by_call),
        "temperature": row.get("temperature"), "sampling_issue": row.get("sampling_issue"),
    }


def _logs(files: RunFiles, sid: str) -> list[dict[str, Any]]:
    out = []
    rel = f"captures/work/{sid}/logs"
    for name in files.listdir(rel):
        try:
            data, size = files.read_tail(f"{rel}/{name}")
        except OSError as exc:  # a link or a FIFO the sample planted: named, not followed
            out.append({"name": name, "error": str(exc)})
            continue
        out.append({"name": name, "size": size, "text": data.decode("utf-8", "replace"), "cut": size > len(data)})
    return out


def build_sample(files: RunFiles, sid: str, rollout: dict[str, Any] | None, records: list[dict[str, Any]],
                 trajectories: list[dict[str, Any]], tokens: dict[str, Any], left_out: dict[str, str],
                 trained_steps: set[int], flows: Any, decode: Any, drift: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The sample page's data. ``tokens``: trajectory id -> that sequence's rows of the trainer's
    record (a dict of lists); ``trained_steps``: rollout steps the loop trained on; ``decode``:
    ids -> {id: text} (None: show ids); ``drift``: the session's drift rows when already known."""
    drift = session_drift(records) if drift is None else drift
    drift_by_call = {d["call_id"]: d for d in drift}
    step = (rollout or {}).get("step")
    calls = [_call(rec, flows.raw(rec.get("call_id") or "") if flows is not None else None) for rec in records]
    seqs = [_sequence(r, drift_by_call, tokens.get(r["trajectory_id"]), left_out, step in trained_steps)
            for r in sorted(trajectories, key=lambda r: (r.get("chain_index") or 0, r.get("segment_index") or 0))]
    last = records[-1] if records else None
    conversation = list(_messages(last))
    if last is not None and (last.get("output_text") or last.get("output_tool_calls") or last.get("output_reasoning")):
        conversation.append({"role": "assistant", "content": last.get("output_text") or "",
                             "reasoning": last.get("output_reasoning") or "",
                             "tool_calls": last.get("output_tool_calls") or [], "final": True})
    vocab: dict[str, str] = {}
    if decode is not None:
        used = {i for s in seqs for i in s["ids"]} | {i for c in calls for i in c["sampled"]}
        vocab = decode(sorted(used))
    return {
        "session_id": sid, "rollout": rollout or {}, "conversation": conversation,
        "native_request": (last or {}).get("native_request"), "calls": calls, "sequences": seqs,
        "drift": drift, "logs": _logs(files, sid), "vocab": vocab,
    }
