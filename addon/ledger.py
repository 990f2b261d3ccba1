"""The exact-history token ledger: per session, what vLLM saw and sampled for each answered call.

For every answered call the ledger keeps (bounded: an LRU over sessions, a cap per session)

* the render context (a digest of what besides the messages changes the rendered prompt: tools,
  chat template and its kwargs, documents) and a digest of the normalized messages it was prompted with;
* the prompt ids vLLM was given (as their difference from an earlier entry: memory linear in the
  session), the length and digest of what its own template rendered for the same messages, the
  sampled ids and whether they end with the end-of-turn id (not when cut or stopped on a stop string);
* the answer the harness got, normalized (text, reasoning, tool calls as name + parsed arguments).

``find`` answers: which earlier call's history is a prefix of a new call's messages *and* had its
answer re-sent unchanged (the longest wins, which also separates interleaved sub-agents); and if
none, why not (the cause recorded with the call). ``splice`` turns the match into prompt ids.

The ledger is rebuilt from the session's capture file when the proxy meets a session it does not
hold (a restart, a kill -9, an LRU eviction), in a thread (``ExactHistory.ensure_session``): every
record carries what is needed (``normalized_request``, the ids, ``rendered_prompt_diff``,
``stop_reason``, the answer).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import orjson

from polar_core.schema import read_capture_lines

#: Request fields that change how the template renders the messages (besides the messages).
CONTEXT_KEYS = ("tools", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort",
                "add_special_tokens")

# causes recorded with ``history`` (the record's ``history_cause``)
NO_EARLIER_CALL = "no_earlier_call"  # assistant turns, but no answer of this session is known
HISTORY_EDITED = "history_edited"  # no earlier call's messages are a prefix (compaction, new system prompt)
ANSWER_CHANGED = "answer_changed"  # an earlier answer came back with other text or tool calls
ANSWER_DROPPED = "answer_dropped"  # the harness left an earlier answer out
CONTEXT_CHANGED = "context_changed"  # tools / template kwargs changed
TEMPLATE_NOT_PREFIX = "template_not_prefix"  # the template renders the old history differently now
NO_END_OF_TURN = "no_end_of_turn"  # a truncated turn, and the end-of-turn id is unknown
UNSPLICEABLE = "unspliceable"  # the matched call cannot be continued (stop string, no ids)


def canonical(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def digest(obj: Any) -> bytes:
    return hashlib.blake2b(canonical(obj), digest_size=16).digest()


def context_digest(chat: dict[str, Any]) -> bytes:
    return digest({k: chat.get(k) for k in CONTEXT_KEYS if chat.get(k) not in (None, [], {})})


def _same_number(obj: Any) -> Any:
    """JSON has one number type: ``3.0`` and ``3`` are the same value, and a JavaScript harness
    re-sends the model's ``3.0`` as ``3`` (seen live: Pi, 1 call of 528 fell back to the rendered
    history). Integral floats become ints; booleans stay booleans."""
    if isinstance(obj, float) and obj.is_integer() and abs(obj) < 2**53:
        return int(obj)
    if isinstance(obj, dict):
        return {k: _same_number(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_same_number(v) for v in obj]
    return obj


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return _same_number(orjson.loads(value))
        except orjson.JSONDecodeError:
            return value
    return _same_number(value)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return str(content)


@dataclass(frozen=True)
class Answer:
    """An assistant answer, normalized for comparison (tool-call ids ignored)."""

    text: str
    reasoning: str
    tool_calls: tuple[tuple[str, bytes], ...]  # (name, canonical JSON of the parsed arguments)

    @classmethod
    def from_output(cls, text: str | None, reasoning: str | None, tool_calls: Iterable[dict[str, Any]]) -> "Answer":
        calls = tuple((tc.get("name") or "", canonical(_args(tc.get("arguments") or ""))) for tc in tool_calls or ())
        return cls((text or "").strip(), (reasoning or "").strip(), calls)

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> "Answer":
        calls = []
        for tc in msg.get("tool_calls") or ():
            fn = tc.get("function") or {}
            calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
        reasoning = msg.get("reasoning") or msg.get("reasoning_content")
        return cls.from_output(_text(msg.get("content")), _text(reasoning), calls)

    def resent_as(self, other: "Answer") -> str | None:
        """None when ``other`` (what the harness sent back) is this answer; else what differs.
        A harness may drop the reasoning (it cannot always carry it): that is not an edit."""
        if self.text != other.text:
            return "text"
        if [n for n, _ in self.tool_calls] != [n for n, _ in other.tool_calls]:
            return "tool_names"
        if self.tool_calls != other.tool_calls:
            return "tool_arguments"
        if other.reasoning and other.reasoning != self.reasoning:
            return "reasoning"
        return None


def _ids_key(ids: Any) -> bytes:
    """A digest of an id sequence (what a later call's rendering must start with)."""
    return hashlib.blake2b(ids.tobytes() if isinstance(ids, array) else array("i", ids).tobytes(),
                           digest_size=16).digest()


def prefix_keys(digests: Sequence[bytes]) -> list[bytes]:
    """``keys[k]`` stands for the first ``k`` messages (a hash chain over their digests): an entry
    keeps one key instead of a digest per message, so its size does not grow with the session."""
    keys = [b""]
    for d in digests:
        keys.append(hashlib.blake2b(keys[-1] + d, digest_size=16).digest())
    return keys


@dataclass(eq=False)
class Entry:
    """One answered call. Its prompt ids are stored as a difference from an earlier entry of the
    session (``base``): the first ``keep`` ids of the base's prompt + sampled ids, then ``tail``. A
    spliced call shares everything up to the new messages with the call it continued, so a session
    holds each id about once: memory linear in the session (a 100-call session of 5k-25k-id
    prompts: 12.1 MB -> see benchmarks/history/exact-history.md, the ledger). The template's rendering of its messages
    is kept as its length and digest, all that the prefix check of a later call needs."""

    call_index: int
    context: bytes
    n_messages: int  # it was prompted with the first n_messages messages
    messages_key: bytes  # prefix_keys(...)[n_messages]
    base: "Entry | None"
    keep: int
    tail: array
    sampled_ids: array
    rendered_len: int
    rendered_key: bytes
    finish_reason: str
    ends_with_eot: bool
    answer: Answer
    exact: bool  # its own prompt held every earlier answer as sampled
    model: str = ""
    learn_eot: bool = False  # its last id is known to be a stop token (not a stop string's text)

    @property
    def prompt_len(self) -> int:
        return self.keep + len(self.tail)

    @property
    def prompt_ids(self) -> array:
        return self.ids(self.prompt_len)

    def ids(self, upto: int | None = None) -> array:
        """The first ``upto`` ids of prompt + sampled ids (all of them by default), walking the bases."""
        if upto is None:
            upto = self.prompt_len + len(self.sampled_ids)
        parts: list[array] = []
        e: Entry | None = self
        while e is not None and upto > 0:
            if upto > e.keep:
                n = upto - e.keep
                t = len(e.tail)
                if n <= t:
                    parts.append(e.tail[:n])
                else:
                    parts.append(e.sampled_ids[: n - t])
                    parts.append(e.tail)
                upto = e.keep
            e = e.base
        out = array("i")
        for p in reversed(parts):
            out.extend(p)
        return out

    def rebase(self, candidates: Iterable["Entry"]) -> None:
        """Store the prompt as a difference from the candidate sharing the longest prefix with it."""
        if self.base is not None:
            return
        prompt = self.tail
        best, best_n = None, 0
        for c in candidates:
            if c is self:
                continue
            n = common_prefix(c.ids(min(len(prompt), c.prompt_len + len(c.sampled_ids))), prompt)
            if n > best_n:
                best, best_n = c, n
        if best is not None:
            self.base, self.keep, self.tail = best, best_n, prompt[best_n:]


def new_entry(call_index: int, context: bytes, digests: Sequence[bytes], prompt: Sequence[int],
              rendered: Sequence[int], sampled: Sequence[int], finish: str, answer: Answer, *, exact: bool,
              stop_reason: Any = None, model: str = "", learn_eot: bool = True) -> Entry:
    """An entry holding its whole prompt (``Ledger.add`` stores it as a difference)."""
    ends = finish != "length" and not isinstance(stop_reason, str)  # a stop string: text, not an end of turn
    return Entry(call_index=call_index, context=context, n_messages=len(digests),
                 messages_key=prefix_keys(digests)[-1], base=None, keep=0, tail=array("i", prompt),
                 sampled_ids=array("i", sampled), rendered_len=len(rendered), rendered_key=_ids_key(rendered),
                 finish_reason=finish, ends_with_eot=ends, answer=answer, exact=exact, model=model,
                 learn_eot=learn_eot and ends and bool(sampled))


@dataclass
class Match:
    entry: Entry | None
    cause: str | None = None
    detail: str | None = None


@dataclass
class SessionLedger:
    entries: list[Entry] = field(default_factory=list)


def message_digests(messages: list[dict[str, Any]]) -> list[bytes]:
    return [digest(m) for m in messages]


#: how many of a session's latest entries a new one is compared with to find its base
REBASE_CANDIDATES = 4


class Ledger:
    """Per-session entries, LRU over sessions; ``loader(session_id)`` yields the session's capture
    records (dicts) when a session is not in memory (rebuild after a restart). ``load`` builds a
    session without touching the ledger (the proxy runs it in a thread: a 100-call session's
    capture takes about 0.4 s to parse), ``install`` puts it in on the event loop."""

    def __init__(self, max_sessions: int = 512, max_entries: int = 1024, loader: Any = None):
        self.max_sessions = max_sessions
        self.max_entries = max_entries
        self.loader = loader
        self.sessions: OrderedDict[str, SessionLedger] = OrderedDict()
        #: per model: end-of-turn ids learnt from answers that ended on one (closes a truncated
        #: turn). Only from answers whose stop reason is known to be a token (never a stop string).
        self.eot_ids: dict[str, dict[int, int]] = {}
        self.rebuilt = 0

    # -- sessions --------------------------------------------------------------------------------
    def session(self, sid: str) -> SessionLedger:
        """The session's ledger, rebuilt in this thread when it is not held (see ``load``)."""
        s = self.sessions.get(sid)
        if s is None:
            return self.install(sid, self.load(sid))
        self.sessions.move_to_end(sid)
        return s

    def load(self, sid: str) -> SessionLedger:
        """The session rebuilt from its capture records (no shared state touched: thread-safe)."""
        s = SessionLedger()
        if self.loader is not None:
            for data in self.loader(sid) or ():
                entry = entry_from_record(data)
                if entry is not None:
                    at = _matched_call(data)  # the call it was spliced after: the base (one candidate)
                    matched = next((e for e in reversed(s.entries) if e.call_index == at), None) if at is not None else None
                    cands = [matched] if matched is not None else s.entries[-REBASE_CANDIDATES:]
                    entry.rebase(cands)
                    s.entries.append(entry)
                    if len(s.entries) > self.max_entries:
                        del s.entries[: len(s.entries) - self.max_entries]
        return s

    def install(self, sid: str, s: SessionLedger) -> SessionLedger:
        """Hold a session built by ``load`` (on the event loop), unless one is held already."""
        held = self.sessions.get(sid)
        if held is not None:
            self.sessions.move_to_end(sid)
            return held
        self.sessions[sid] = s
        if s.entries:
            self.rebuilt += 1
            for e in s.entries:
                self._learn(e)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return s

    def forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)

    def eot(self, model: str = "") -> int | None:
        """The id answers of this model ended their turn with most often (None: none seen)."""
        seen = self.eot_ids.get(model or "")
        return max(seen, key=seen.__getitem__) if seen else None

    # -- adding ----------------------------------------------------------------------------------
    def add(self, sid: str, entry: Entry, matched: Entry | None = None) -> None:
        """Keep an answered call. A session not held is not read back for it: its capture record
        (written right after) brings it in with the next rebuild."""
        s = self.sessions.get(sid)
        if s is None:
            if self.loader is not None:
                return
            s = self.session(sid)
        entry.rebase(([matched] if matched is not None else []) + s.entries[-REBASE_CANDIDATES:])
        self._learn(entry)
        s.entries.append(entry)
        if len(s.entries) > self.max_entries:
            del s.entries[: len(s.entries) - self.max_entries]

    def _learn(self, entry: Entry) -> None:
        if entry.learn_eot and entry.sampled_ids:
            seen = self.eot_ids.setdefault(entry.model or "", {})
            last = entry.sampled_ids[-1]
            seen[last] = seen.get(last, 0) + 1

    # -- finding -----------------------------------------------------------------------------------
    def find(self, sid: str, context: bytes, messages: list[dict[str, Any]], digests: list[bytes]) -> Match:
        """The longest earlier call whose messages are a prefix of ``messages`` and whose answer
        comes next, re-sent unchanged. Otherwise the reason none does."""
        s = self.session(sid)
        has_assistant = any(m.get("role") == "assistant" for m in messages)
        if not s.entries:
            return Match(None, NO_EARLIER_CALL if has_assistant else None)
        n = len(messages)
        keys = prefix_keys(digests)
        best_fail: Match | None = None
        best_fail_len = -1
        # longest first, newest first among equals
        for entry in sorted(s.entries, key=lambda e: (e.n_messages, e.call_index), reverse=True):
            k = entry.n_messages
            if k >= n or entry.messages_key != keys[k]:
                continue
            nxt = messages[k]
            fail: Match | None = None
            if entry.context != context:
                fail = Match(None, CONTEXT_CHANGED)
            elif nxt.get("role") != "assistant":
                fail = Match(None, ANSWER_DROPPED)
            else:
                diff = entry.answer.resent_as(Answer.from_message(nxt))
                if diff is not None:
                    fail = Match(None, ANSWER_CHANGED, diff)
            if fail is None:
                if best_fail is not None:  # a longer history matched but its answer did not
                    return Match(entry, best_fail.cause, best_fail.detail)
                return Match(entry)
            if k > best_fail_len:
                best_fail, best_fail_len = fail, k
        if not has_assistant:  # nothing to splice; unless an earlier answer was left out, the prompt is exact
            return best_fail if best_fail is not None and best_fail.cause == ANSWER_DROPPED else Match(None)
        return best_fail or Match(None, HISTORY_EDITED)


def _matched_call(data: dict[str, Any]) -> int | None:
    for note in data.get("translation_notes") or ():
        if isinstance(note, str) and note.startswith("exact history: spliced after call "):
            try:
                return int(note.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


def entry_from_record(data: dict[str, Any]) -> Entry | None:
    """A ledger entry from a capture record (a dict as written, delta records expanded), or None
    if it cannot serve.

    * A record captured with exact history off (``history`` null) is never ``exact``: its prompt
      was the template's rendering.
    * Its answer ended its turn unless it was cut (``length``) or stopped on a stop string
      (``stop_reason`` a string; ``history_stop_string`` in records before it was recorded).
    * Its last id teaches the end-of-turn id only when the stop reason is known to be a token:
      records written in exact mode with a ``stop_reason`` field (the normal path does not record
      it, and a stop string's last id is text)."""
    if data.get("record_type", "call") != "call" or data.get("status") != "ok":
        return None
    chat = data.get("normalized_request")
    sampled = data.get("sampled_token_ids") or []
    prompt = data.get("prompt_token_ids") or []
    if not isinstance(chat, dict) or not sampled or not prompt:
        return None
    if any(isinstance(n, str) and n.endswith("not spliced later") for n in data.get("translation_notes") or ()):
        return None  # the harness was sent other text than these ids (exact_history.py, stream)
    rendered = rendered_from_diff(prompt, data.get("rendered_prompt_diff"))
    finish = data.get("finish_reason") or ""
    history = data.get("history")
    stop_reason = data.get("stop_reason")
    if stop_reason is None and data.get("history_stop_string"):
        stop_reason = "?"  # a stop string (which one was not kept)
    return new_entry(
        int(data.get("call_index") or 0), context_digest(chat), message_digests(chat.get("messages") or []),
        prompt, rendered, sampled, finish,
        Answer.from_output(data.get("output_text"), data.get("output_reasoning"), data.get("output_tool_calls") or []),
        exact=history == "exact", stop_reason=stop_reason, model=str(chat.get("model") or ""),
        learn_eot=history is not None and "stop_reason" in data)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, by bisection on slice comparisons (C loops): 0.21 ms for two
    20k-id prompts differing at 19k, where a Python loop over the ids took 0.8 ms, on every call of
    a long session."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # a[:lo] == b[:lo]; the first difference is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def rendered_diff(prompt: list[int], rendered: list[int]) -> dict[str, Any] | None:
    """The template-rendered ids as a compact diff against the ids vLLM was given (None if equal)."""
    if len(prompt) == len(rendered) and prompt == rendered:
        return None
    n = common_prefix(prompt, rendered)
    return {"common_prefix": n, "rendered_tail": list(rendered[n:]), "rendered_len": len(rendered)}


def rendered_from_diff(prompt: list[int], diff: dict[str, Any] | None) -> list[int]:
    if not diff:
        return list(prompt)
    return list(prompt[: diff["common_prefix"]]) + list(diff["rendered_tail"])


def read_session_records(path: Path) -> Iterable[dict[str, Any]]:
    """The records of one session's capture file (``polar_core.schema.read_capture_lines``: a torn
    last line is skipped, records stored as a delta against an earlier one are expanded). A generator:
    a rebuild frees each record once it is read (freeing 100 parsed 15k-id records at once held the
    interpreter for 135 ms on a loaded 2-core machine, stalling the event loop)."""
    try:
        yield from read_capture_lines(path)
    except OSError:
        return


@dataclass
class Splice:
    """The prompt ids of a new call and how they were made."""

    ids: list[int]
    history: str  # exact | spliced_at=k | rendered
    cause: str | None = None
    detail: str | None = None
    matched_call: int | None = None


def _index(ids: list[int], x: int, start: int) -> int | None:
    try:
        return ids.index(x, start)
    except ValueError:
        return None


def splice(match: Match, messages: list[dict[str, Any]], rendered: list[int], eot: int | None) -> Splice:
    """Prompt ids for a new call from its match and vLLM's rendering of its whole conversation.

    ids = the matched call's prompt ids + its sampled ids (+ the end-of-turn id closing a truncated
    turn) + what the template renders after that answer (tool results, new turns, generation
    prompt). The rendered tail starts after the first end-of-turn id at or after the point where
    the matched call's own rendered prompt ends (the start of the re-rendered answer), and the
    matched call's rendered prompt must be a prefix of the new rendering (else the template now
    renders the old history differently and nothing is spliced)."""
    has_assistant = any(m.get("role") == "assistant" for m in messages)
    entry = match.entry
    if entry is None:
        if not has_assistant and match.cause is None:
            return Splice(list(rendered), "exact")
        return Splice(list(rendered), "rendered", match.cause, match.detail)
    k = entry.n_messages  # messages[k] is the re-sent answer
    r_len = entry.rendered_len
    if len(rendered) <= r_len or _ids_key(rendered[:r_len]) != entry.rendered_key:
        return Splice(list(rendered), "rendered", TEMPLATE_NOT_PREFIX, f"call {entry.call_index}")
    sampled = list(entry.sampled_ids)
    close = eot if not entry.ends_with_eot else None
    if not entry.ends_with_eot:
        if eot is None:
            return Splice(list(rendered), "rendered", NO_END_OF_TURN, f"call {entry.call_index}")
        end_id = eot
    else:
        end_id = sampled[-1]
    # The answer may have stopped on another stop id than the one the template closes turns with
    # (Qwen2.5 sometimes ends on <|endoftext|>, which vLLM stops on too; the template re-renders
    # the answer closed by <|im_end|>: 2 of 208 calls of a 0.5B Pi run). The rendered answer then
    # ends at the template's end of turn: the first of either after the matched prompt.
    found = [i for i in (_index(rendered, x, r_len) for x in {end_id, eot} if x is not None) if i is not None]
    if not found:
        return Splice(list(rendered), "rendered", TEMPLATE_NOT_PREFIX, f"no end of turn after call {entry.call_index}")
    e = min(found)
    ids = list(entry.prompt_ids) + sampled + ([close] if close is not None else []) + rendered[e + 1:]
    rest_has_assistant = any(m.get("role") == "assistant" for m in messages[k + 1:])
    if entry.exact and not rest_has_assistant:
        return Splice(ids, "exact", matched_call=entry.call_index)
    cause = match.cause or (ANSWER_CHANGED if rest_has_assistant else "earlier_history_rendered")
    return Splice(ids, f"spliced_at={k + 1}", cause, match.detail, matched_call=entry.call_index)
