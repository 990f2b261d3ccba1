"""A mitmproxy content view of a captured model call: its tokens, as the engine returned them.

In mitmweb, the mitmproxy console or ``mitmdump --flow-detail 3+``, every model call the proxy
annotated (``flow.metadata["polar"]``) gets the view ``Polar tokens``:

* on the **request** (its default view there): the call's identity, then its tokens: the prompt
  ids (loss mask 0, style ``offset``: blue), a marked boundary, the sampled ids (loss mask 1, style
  ``text``), each token delimited, and a table of the sampled ids with their behaviour logprobs;
* on the **response** (whose default view stays mitmproxy's own: the body is the answer as the
  harness received it, SSE events when it streamed): status, finish reason, the answer text,
  reasoning and tool calls as parsed, and the sampled tokens, each with its logprob; a token
  sampled with probability below ``LOW_P`` is red (``LOW_STYLE``) and marked ``!``.

The token ids and logprobs come from the flow itself (``polar_core.flowmeta``: the proxy keeps
them in the metadata), so a flow file is enough, on any machine. The capture record with the same
call id is linked when it is found, in (first hit wins) ``polar_capture_dir``, the directory of the
flow file being read (``-r``) and its parent (the demo saves ``<capture>/flows.mitm``), the
directory the proxy wrote it to, then ``$POLAR_HOME/captures``; flows saved before the metadata
held token ids are rendered from that record. Tokens are decoded with the served model's
tokenizer when it is built locally (ids otherwise).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mitmproxy import contentviews, ctx
from mitmproxy.contentviews.base import TViewLine

from polar_core.flowmeta import META_KEY, TOKEN_FIELDS, unpack_tokens
from polar_core.paths import model_dir_for, polar_home
from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines, valid_session_id

VIEW_NAME = "Polar tokens"
PROMPT_STYLE = "offset"  # loss mask 0
SAMPLED_STYLE = "text"  # loss mask 1
LOW_STYLE = "Token_Literal_String"  # red in mitmweb and the console
LOW_MARK = "!"
#: Sampled tokens with a probability below this are marked.
LOW_P = 0.1
SEP = "\u2502"  # token boundary
NEWLINE = "\u21b5"
WIDTH = 100


# ---- finding the record and the tokenizer -------------------------------------------------------
def capture_dirs(meta: dict[str, Any] | None = None) -> list[Path]:
    """Where to look for ``sessions/<session>.jsonl``, most specific first (``meta``: the flow's
    Polar metadata, which names the directory the proxy wrote the record to)."""
    dirs: list[Path] = []
    opts = getattr(ctx, "options", None)
    for name in ("polar_capture_dir", "rfile"):
        value = getattr(opts, name, None) if opts is not None else None
        if not value:
            continue
        p = Path(value).expanduser()
        dirs += [p] if name == "polar_capture_dir" else [p.parent, p.parent.parent]
    if meta and isinstance(meta.get("capture_dir"), str) and meta["capture_dir"]:
        dirs.append(Path(meta["capture_dir"]))
    dirs.append(polar_home() / "captures")
    return list(dict.fromkeys(d.resolve() for d in dirs))


_records: dict[Path, tuple[tuple[int, int], dict[str, dict[str, Any]]]] = {}


def _session_records(path: Path) -> dict[str, dict[str, Any]]:
    """call_id -> record of one session file (re-read when it grew); torn lines are skipped."""
    st = path.stat()
    key = (st.st_size, st.st_mtime_ns)
    hit = _records.get(path)
    if hit and hit[0] == key:
        return hit[1]
    out = {rec["call_id"]: rec for rec in read_capture_lines(path) if rec.get("call_id")}
    _records[path] = (key, out)
    return out


def find_record(session_id: str, call_id: str, dirs: list[Path] | None = None) -> tuple[dict[str, Any] | None, Path | None]:
    if not valid_session_id(session_id):
        return None, None
    for d in dirs if dirs is not None else capture_dirs():
        path = d / SESSIONS_SUBDIR / f"{session_id}.jsonl"
        if path.is_file():
            rec = _session_records(path).get(call_id)
            if rec is not None:
                return rec, path
    return None, None


_tokenizers: dict[str, Any] = {}


def tokenizer_for(model: str | None) -> Any | None:
    """A ``tokenizers.Tokenizer`` for a served model name or directory, if built locally."""
    if not model:
        return None
    if model not in _tokenizers:
        tok = None
        try:
            d = model_dir_for(model)
            if d is not None and (d / "tokenizer.json").is_file():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception:  # a broken tokenizer only costs the text column
            tok = None
        _tokenizers[model] = tok
    return _tokenizers[model]


# ---- rendering ----------------------------------------------------------------------------------
def token_texts(ids: list[int], tok: Any | None) -> list[str]:
    if tok is None:
        return [f"<{i}>" for i in ids]
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def _wrapped(pieces: list[tuple[str, str]], width: int = WIDTH) -> Iterator[TViewLine]:
    """Lay tokens out as lines: a token ending in a newline ends the line, long lines wrap."""
    line: TViewLine = []
    used = 0
    for style, text in pieces:
        breaks = text.endswith("\n")
        shown = text.replace("\r", "\\r").replace("\t", "\\t").replace("\n", NEWLINE)
        if used and used + len(shown) + 1 > width:
            yield line
            line, used = [], 0
        line += [(style, shown), ("", SEP)]
        used += len(shown) + 1
        if breaks:
            yield line
            line, used = [], 0
    if line:
        yield line


def _kv(key: str, value: Any) -> TViewLine:
    return [("header", f"{key:<16}"), ("", str(value))]


def call_tokens(meta: dict[str, Any], rec: dict[str, Any] | None) -> dict[str, list[Any]] | None:
    """Prompt ids, sampled ids and logprobs: the flow's own (``flowmeta``), else the record's."""
    tokens = unpack_tokens(meta)
    if tokens is None and rec is not None:
        tokens = {k: list(rec.get(k) or []) for k in TOKEN_FIELDS}
    return tokens


def _field(meta: dict[str, Any], rec: dict[str, Any] | None, key: str, default: Any = None) -> Any:
    value = meta.get(key)
    if value is None and rec is not None:
        value = rec.get(key)
    return default if value is None else value


def _identity(meta: dict[str, Any], rec: dict[str, Any] | None, source: Path | None) -> Iterator[TViewLine]:
    yield _kv("session", f"{meta.get('session')} #{meta.get('call_index')}")
    yield _kv("provider", f"{meta.get('provider')}  harness={_field(meta, rec, 'harness') or '?'}")
    task = _field(meta, rec, "task_id")
    if task is not None:
        yield _kv("task", f"{task}  group={_field(meta, rec, 'group_id')}  sample={_field(meta, rec, 'sample_index')}")
    yield _kv("status", f"{meta.get('status')}  finish_reason={_field(meta, rec, 'finish_reason')}"
                        + (f"  error={meta.get('error_kind')}" if meta.get("error_kind") else ""))
    yield _kv("policy version", meta.get("policy_version"))
    yield _kv("served model", _field(meta, rec, "served_model") or "?")
    yield _kv("call id", meta.get("call_id"))
    if source is not None:
        yield _kv("capture record", source)
    else:
        yield _kv("capture record", f"not here (looked for {meta.get('capture_file') or 'sessions/' + str(meta.get('session')) + '.jsonl'} "
                                    "in " + ", ".join(str(d) for d in capture_dirs(meta)) + ")")


def _token_source(meta: dict[str, Any], source: Path | None, tok: Any | None) -> TViewLine:
    where = "the flow (metadata)" if unpack_tokens(meta) is not None else f"{source}"
    return _kv("tokens from", where + ("" if tok is not None else "  (no tokenizer built: ids shown)"))


def _mean(values: list[float | None]) -> float:
    known = [v for v in values if v is not None]  # an engine may leave a token's logprob out
    return sum(known) / len(known) if known else float("nan")


def render_call(meta: dict[str, Any], rec: dict[str, Any] | None, source: Path | None, tok: Any | None) -> Iterator[TViewLine]:
    """The request's lines for one call (``meta`` = flow.metadata["polar"]): identity, prompt and
    sampled tokens with their loss masks, the sampled ids' logprobs."""
    yield from _identity(meta, rec, source)
    tokens = call_tokens(meta, rec)
    if tokens is None:
        yield _kv("token ids", "not in the flow and no capture record found (set polar_capture_dir)")
        yield _kv("prompt ids", meta.get("prompt_tokens"))
        yield _kv("sampled ids", meta.get("sampled_tokens"))
        return
    prompt, sampled, logprobs = tokens["prompt_token_ids"], tokens["sampled_token_ids"], tokens["sampled_logprobs"]
    yield _token_source(meta, source, tok)
    yield _kv("prompt ids", f"{len(prompt)}  (loss_mask 0, {PROMPT_STYLE} style)")
    yield _kv("sampled ids", f"{len(sampled)}  (loss_mask 1, {SAMPLED_STYLE} style)  mean logprob {_mean(logprobs):.3f}")
    yield _kv("answer", f'the Response tab, view "{VIEW_NAME}": text, tool calls, every sampled token\'s probability')
    yield []
    yield [("header", f"--- prompt: {len(prompt)} ids, loss_mask 0 ---")]
    yield from _wrapped([(PROMPT_STYLE, t) for t in token_texts(prompt, tok)])
    yield [("header", f"--- sampled: {len(sampled)} ids, loss_mask 1 (prompt/sampled boundary at {len(prompt)}) ---")]
    yield from _wrapped([(SAMPLED_STYLE, t) for t in token_texts(sampled, tok)])
    yield []
    yield from _logprob_table(sampled, logprobs, token_texts(sampled, tok), len(prompt), low=False)


def _logprob_table(sampled: list[int], logprobs: list[float], texts: list[str], offset: int, low: bool) -> Iterator[TViewLine]:
    yield [("header", f"{'pos':>6} {'id':>7} {'logprob':>9} {'p':>6}  token")]
    for k, (tid, text) in enumerate(zip(sampled, texts)):
        lp = logprobs[k] if k < len(logprobs) else None
        lp_s = f"{lp:9.4f}" if lp is not None else f"{'-':>9}"
        p = math.exp(lp) if lp is not None else None
        p_s = f"{p:6.3f}" if p is not None else f"{'-':>6}"
        is_low = low and p is not None and p < LOW_P
        mark = LOW_MARK if is_low else " "
        yield [("", f"{offset + k:>6} {tid:>7} {lp_s} {p_s}{mark} "), (LOW_STYLE if is_low else SAMPLED_STYLE, repr(text))]
    if len(logprobs) != len(sampled):
        yield [("error", f"logprobs/ids length mismatch: {len(logprobs)} vs {len(sampled)}")]


def _text_block(title: str, text: str) -> Iterator[TViewLine]:
    yield [("header", f"--- {title} ---")]
    for line in text.splitlines() or [""]:
        yield [("", line)]


def render_answer(meta: dict[str, Any], rec: dict[str, Any] | None, source: Path | None, tok: Any | None,
                  body: bytes | None = None) -> Iterator[TViewLine]:
    """The response's lines for one call: outcome, the answer as parsed (reasoning, text, tool
    calls), then every sampled token with its probability (low ones red and marked)."""
    tokens = call_tokens(meta, rec)
    sampled = tokens["sampled_token_ids"] if tokens else []
    logprobs = tokens["sampled_logprobs"] if tokens else []
    probs = [math.exp(lp) if lp is not None else None for lp in logprobs]
    n_low = sum(1 for p in probs if p is not None and p < LOW_P)
    yield _kv("session", f"{meta.get('session')} #{meta.get('call_index')}  ({meta.get('provider')}, "
                         f"harness={_field(meta, rec, 'harness') or '?'})")
    yield _kv("status", f"{meta.get('status')}  http={_field(meta, rec, 'http_status')}  "
                        f"finish_reason={_field(meta, rec, 'finish_reason')}"
                        + (f"  error={meta.get('error_kind')}: {_field(meta, rec, 'error')}" if meta.get("error_kind") else ""))
    if tokens is None:
        yield _kv("sampled ids", f"{meta.get('sampled_tokens')} (ids not in the flow and no capture record found)")
    else:
        yield _kv("sampled ids", f"{len(sampled)}  mean logprob {_mean(logprobs):.3f}  "
                                 f"{n_low} with p < {LOW_P:g} (red, marked {LOW_MARK})")
    kept = meta.get("response_body")
    if isinstance(kept, dict):
        cut = kept.get("kept", 0) < kept.get("sent", 0)
        yield _kv("body", f"{kept.get('kept')} of {kept.get('sent')} bytes the harness received (streamed)"
                          + ("  CUT at polar_flow_body_limit" if cut else ""))
    elif body is not None:
        yield _kv("body", f"{len(body)} bytes as the harness received them")
    if tokens is not None:
        yield _token_source(meta, source, tok)
    yield _kv("capture record", source if source is not None else "not here (the flow holds the call)")
    reasoning = _field(meta, rec, "output_reasoning", "")
    if reasoning:
        yield from _text_block("reasoning", reasoning)
    text = _field(meta, rec, "output_text", "")
    if text:
        yield from _text_block("text", text)
    else:
        yield [("header", "--- text: (none) ---")]
    calls = _field(meta, rec, "output_tool_calls", []) or []
    yield [("header", f"--- tool calls: {len(calls)} ---")]
    for i, tc in enumerate(calls):
        tc = tc if isinstance(tc, dict) else {}
        yield [("", f"[{i}] "), ("highlight", str(tc.get("name"))), ("", f"  id={tc.get('id')}")]
        args = tc.get("arguments")
        try:
            pretty = json.dumps(json.loads(args), indent=2, ensure_ascii=False) if isinstance(args, str) else json.dumps(args, indent=2)
        except ValueError:
            pretty = f"{args}  (not valid JSON)"
        for line in pretty.splitlines():
            yield [("", "    "), ("Token_Literal_String" if "not valid JSON" in pretty else "", line)]
    if tokens is None:
        return
    texts = token_texts(sampled, tok)
    yield [("header", f"--- sampled: {len(sampled)} ids, each with its probability "
                      f"({LOW_MARK} and red: p < {LOW_P:g}) ---")]
    pieces: list[tuple[str, str]] = []
    for k, t in enumerate(texts):
        p = probs[k] if k < len(probs) else None
        low = p is not None and p < LOW_P
        pieces.append((LOW_STYLE, t + LOW_MARK) if low else (SAMPLED_STYLE, t))
    yield from _wrapped(pieces)
    yield []
    prompt_len = len(tokens["prompt_token_ids"])
    yield from _logprob_table(sampled, logprobs, texts, prompt_len, low=True)


def polar_meta(flow: Any) -> dict[str, Any] | None:
    meta = (getattr(flow, "metadata", None) or {}).get(META_KEY)
    if isinstance(meta, dict) and meta.get("call_id") and meta.get("session"):
        return meta
    return None


class PolarTokensView(contentviews.View):
    """Content view of an annotated model call (see the module docstring)."""

    name = VIEW_NAME

    def __call__(self, data: bytes, *, flow: Any = None, http_message: Any = None, **_: Any):
        meta = polar_meta(flow)
        if meta is None:
            return "Polar: not a captured model call", iter([[("", "(no Polar annotation on this flow)")]])
        rec, source = find_record(str(meta["session"]), str(meta["call_id"]), capture_dirs(meta))
        tokens = call_tokens(meta, rec)
        tok = tokenizer_for(_field(meta, rec, "served_model") or _field(meta, rec, "requested_model"))
        n_p = len(tokens["prompt_token_ids"]) if tokens else meta.get("prompt_tokens")
        n_s = len(tokens["sampled_token_ids"]) if tokens else meta.get("sampled_tokens")
        if http_message is not None and http_message is getattr(flow, "response", None):
            n_calls = len(_field(meta, rec, "output_tool_calls", []) or [])
            return (f"Polar answer: {n_s} sampled ids, finish_reason={_field(meta, rec, 'finish_reason')}, "
                    f"{n_calls} tool call(s)", render_answer(meta, rec, source, tok, data))
        return f"Polar call: {n_p} prompt + {n_s} sampled ids", render_call(meta, rec, source, tok)

    def render_priority(self, data: bytes, *, flow: Any = None, http_message: Any = None, **_: Any) -> float:
        if polar_meta(flow) is not None and http_message is not None and http_message is getattr(flow, "request", None):
            return 3.0  # above JSON (1): the native request stays one click away
        return 0.0  # the response: mitmproxy's own view of the body by default, this one on demand


class PolarContentView:
    """Addon that registers the view while mitmproxy runs (``addons = [Polar(), PolarContentView()]``)."""

    def __init__(self) -> None:
        self.view = PolarTokensView()

    def load(self, loader: Any) -> None:
        if contentviews.get(VIEW_NAME) is None:
            contentviews.add(self.view)

    def done(self) -> None:
        if self.view in contentviews.views:
            contentviews.remove(self.view)
