"""A mitmproxy content view of a captured model call: its token ids, as the engine returned them.

In mitmweb, the mitmproxy console or ``mitmdump --flow-detail 3+``, the request of every model call
the proxy annotated (``flow.metadata["polar"]``) is shown as the call's tokens: the prompt ids
(loss mask 0, style ``offset``: blue), a marked boundary, then the sampled ids (loss mask 1, style
``text``: green in the terminal), each token delimited, followed by a table of the sampled ids with
their behaviour logprobs. The request is the message that always has a body: a streamed answer is
not kept in the flow.

Token ids are not stored in flows; they are read from the capture record with the same call id,
found in (first hit wins) ``polar_capture_dir``, the directory of the flow file being read
(``-r``) and its parent (the demo saves ``<capture>/flows.mitm``), then ``$POLAR_HOME/captures``.
Tokens are decoded with the served model's tokenizer when it is built locally (ids otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mitmproxy import contentviews, ctx
from mitmproxy.contentviews.base import TViewLine

from polar_core.paths import model_dir_for, polar_home
from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines, valid_session_id

VIEW_NAME = "Polar tokens"
PROMPT_STYLE = "offset"  # loss mask 0
SAMPLED_STYLE = "text"  # loss mask 1
SEP = "\u2502"  # token boundary
NEWLINE = "\u21b5"
WIDTH = 100


# ---- finding the record and the tokenizer -------------------------------------------------------
def capture_dirs() -> list[Path]:
    """Where to look for ``sessions/<session>.jsonl``, most specific first."""
    dirs: list[Path] = []
    opts = getattr(ctx, "options", None)
    for name in ("polar_capture_dir", "rfile"):
        value = getattr(opts, name, None) if opts is not None else None
        if not value:
            continue
        p = Path(value).expanduser()
        dirs += [p] if name == "polar_capture_dir" else [p.parent, p.parent.parent]
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


def render_call(meta: dict[str, Any], rec: dict[str, Any] | None, source: Path | None, tok: Any | None) -> Iterator[TViewLine]:
    """The lines of the view for one call (``meta`` = flow.metadata["polar"])."""
    def kv(key: str, value: Any) -> TViewLine:
        return [("header", f"{key:<16}"), ("", str(value))]

    yield kv("session", f"{meta.get('session')} #{meta.get('call_index')}")
    yield kv("provider", meta.get("provider"))
    yield kv("status", f"{meta.get('status')}  finish_reason={meta.get('finish_reason')}"
                       + (f"  error={meta.get('error_kind')}" if meta.get("error_kind") else ""))
    yield kv("policy version", meta.get("policy_version"))
    yield kv("call id", meta.get("call_id"))
    if rec is None:
        yield kv("token ids", f"not found (looked for sessions/{meta.get('session')}.jsonl in "
                              + ", ".join(str(d) for d in capture_dirs()) + "; set polar_capture_dir)")
        yield kv("prompt ids", meta.get("prompt_tokens"))
        yield kv("sampled ids", meta.get("sampled_tokens"))
        return
    prompt = list(rec.get("prompt_token_ids") or [])
    sampled = list(rec.get("sampled_token_ids") or [])
    logprobs = list(rec.get("sampled_logprobs") or [])
    yield kv("served model", rec.get("served_model") or "?")
    yield kv("tokens from", f"{source}" + ("" if tok is not None else "  (no tokenizer built: ids shown)"))
    mean = sum(logprobs) / len(logprobs) if logprobs else float("nan")
    yield kv("prompt ids", f"{len(prompt)}  (loss_mask 0, {PROMPT_STYLE} style)")
    yield kv("sampled ids", f"{len(sampled)}  (loss_mask 1, {SAMPLED_STYLE} style)  mean logprob {mean:.3f}")
    yield []
    yield [("header", f"--- prompt: {len(prompt)} ids, loss_mask 0 ---")]
    yield from _wrapped([(PROMPT_STYLE, t) for t in token_texts(prompt, tok)])
    yield [("header", f"--- sampled: {len(sampled)} ids, loss_mask 1 (prompt/sampled boundary at {len(prompt)}) ---")]
    yield from _wrapped([(SAMPLED_STYLE, t) for t in token_texts(sampled, tok)])
    yield []
    yield [("header", f"{'pos':>6} {'id':>7} {'logprob':>9} {'p':>6}  token")]
    texts = token_texts(sampled, tok)
    for k, (tid, text) in enumerate(zip(sampled, texts)):
        lp = logprobs[k] if k < len(logprobs) else None
        lp_s = f"{lp:9.4f}" if lp is not None else f"{'-':>9}"
        p_s = f"{math.exp(lp):6.3f}" if lp is not None else f"{'-':>6}"
        yield [("", f"{len(prompt) + k:>6} {tid:>7} {lp_s} {p_s}  "), (SAMPLED_STYLE, repr(text))]
    if len(logprobs) != len(sampled):
        yield [("error", f"logprobs/ids length mismatch: {len(logprobs)} vs {len(sampled)}")]


def polar_meta(flow: Any) -> dict[str, Any] | None:
    meta = (getattr(flow, "metadata", None) or {}).get("polar")
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
        rec, source = find_record(str(meta["session"]), str(meta["call_id"]))
        tok = tokenizer_for((rec or {}).get("served_model") or (rec or {}).get("requested_model"))
        n_p = len((rec or {}).get("prompt_token_ids") or []) if rec else meta.get("prompt_tokens")
        n_s = len((rec or {}).get("sampled_token_ids") or []) if rec else meta.get("sampled_tokens")
        return f"Polar call: {n_p} prompt + {n_s} sampled ids", render_call(meta, rec, source, tok)

    def render_priority(self, data: bytes, *, flow: Any = None, http_message: Any = None, **_: Any) -> float:
        if polar_meta(flow) is not None and http_message is not None and http_message is getattr(flow, "request", None):
            return 3.0  # above JSON (1): the native request stays one click away
        return 0.0


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
