"""Synthetic captures that look like real ones, for tests, notebooks and benchmarks.

A ``SyntheticSession`` plays a harness against a simulated server: each call's prompt ids are
rendered with a real tokenizer and chat template (the way vLLM renders the normalized request),
and the sampled ids are the tokenization of the assistant turn as the model emits it (Hermes
``<tool_call>`` JSON for Qwen, reasoning inside ``<think>``, ``<|im_end|>`` at the end unless
the turn was cut by ``finish_reason=length``). The harness then echoes the answer back in the
next request the way real harnesses do (arguments re-serialized, reasoning dropped, ...), so every
token-fidelity trap can be reproduced with real ids.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

from polar_analysis.alignment import ChatTemplateRenderer
from polar_core.schema import SESSIONS_SUBDIR, CallRecord

_UNSET: Any = object()


def fake_logprobs(ids: list[int], salt: str) -> list[float]:
    """Deterministic negative logprobs (distinct per position, so misplacement is detectable)."""
    h = int(hashlib.sha1(salt.encode()).hexdigest()[:8], 16)
    return [-((h + 7919 * i + t) % 5000) / 1000.0 - 0.001 for i, t in enumerate(ids)]


class SyntheticSession:
    """One harness run. ``renderer`` renders prompts as the server would (the "truth")."""

    def __init__(
        self,
        renderer: ChatTemplateRenderer,
        session_id: str,
        *,
        system: str | list[dict[str, Any]] | None = "You are a coding agent. Use the tools.",
        tools: list[dict[str, Any]] | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        sample_index: int | None = None,
        harness: str = "pi",
        provider: str = "openai_chat",
        served_model: str = "tiny-qwen",
        chat_template_kwargs: dict[str, Any] | None = None,
        policy_version: int | None = 0,
        t0: float = 1_760_000_000.0,
    ):
        self.r = renderer
        self.tok = renderer.tokenizer
        self.session_id = session_id
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
        self.tools = tools
        self.task_id, self.group_id, self.sample_index = task_id, group_id, sample_index
        self.harness, self.provider, self.served_model = harness, provider, served_model
        self.chat_template_kwargs = chat_template_kwargs
        self.policy_version = policy_version
        self.records: list[CallRecord] = []
        self.t = t0
        self.eot = self.tok.convert_tokens_to_ids("<|im_end|>")

    # -- what the harness sends ----------------------------------------------------------------
    def user(self, content: Any) -> "SyntheticSession":
        self.messages.append({"role": "user", "content": content})
        return self

    def tool(self, content: Any, tool_call_id: str) -> "SyntheticSession":
        self.messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": content})
        return self

    def request(self, *, messages: list[dict[str, Any]] | None = None, tools: Any = _UNSET) -> dict[str, Any]:
        req: dict[str, Any] = {"model": self.served_model, "messages": json.loads(json.dumps(messages or self.messages))}
        tools = self.tools if tools is _UNSET else tools
        if tools:
            req["tools"] = tools
        if self.chat_template_kwargs:
            req["chat_template_kwargs"] = dict(self.chat_template_kwargs)
        req.update(logprobs=True, return_token_ids=True, stream=False)
        return req

    # -- what the model does -------------------------------------------------------------------
    @staticmethod
    def emitted_text(content: str, reasoning: str | None, tool_calls: list[tuple[str, str]]) -> str:
        """The assistant turn as a Qwen/Hermes model writes it (tool calls as raw JSON strings)."""
        text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning is not None else ""
        text += content
        for raw in tool_calls:
            text += ("\n" if text else "") + "<tool_call>\n" + raw + "\n</tool_call>"
        return text

    def generate(
        self,
        *,
        content: str = "",
        reasoning: str | None = None,
        tool_calls: list[tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], str]] | None = None,
        finish_reason: str | None = None,
        max_tokens: int | None = None,
        sampled_ids: list[int] | None = None,
        echo: bool | dict[str, Any] = True,
        echo_reasoning: bool = False,
        messages: list[dict[str, Any]] | None = None,
        tools: Any = _UNSET,
        status: str = "ok",
    ) -> CallRecord:
        """One model call on the current history; appends the echoed answer unless ``echo=False``.

        ``tool_calls``: (name, args) or (name, args, raw_json_as_emitted). ``max_tokens`` cuts the
        emission (``finish_reason=length``, no end-of-turn id). ``sampled_ids`` overrides the ids
        (e.g. ``[fish, ing]`` for a text the tokenizer would encode as ``[fishing]``).
        """
        req = self.request(messages=messages, tools=tools)
        prompt_ids = self.r.render(req)
        calls = []
        for i, tc in enumerate(tool_calls or []):
            name, args = tc[0], tc[1]
            raw = tc[2] if len(tc) > 2 else json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            calls.append({"id": f"call_{self.session_id}_{len(self.records)}_{i}", "name": name, "arguments": json.dumps(args, ensure_ascii=False), "raw": raw})
        text = self.emitted_text(content, reasoning, [c["raw"] for c in calls])
        if sampled_ids is None:
            sampled_ids = self.tok.encode(text, add_special_tokens=False)
            if max_tokens is not None and len(sampled_ids) > max_tokens:
                sampled_ids = sampled_ids[:max_tokens]
                finish_reason = finish_reason or "length"
            if finish_reason != "length":
                sampled_ids = sampled_ids + [self.eot]
        finish_reason = finish_reason or ("tool_calls" if calls else "stop")
        out_reasoning = reasoning or ""
        out_content = content
        if finish_reason == "length":  # what the server's parsers make of a cut emission
            cut = self.tok.decode(sampled_ids)
            if reasoning is not None and "</think>" not in cut:
                out_reasoning, out_content = cut.replace("<think>\n", "", 1), ""
            calls = []
        if status != "ok":
            sampled_ids = []
        self.t += 1.0
        call_id = uuid.uuid4().hex
        rec = CallRecord(
            call_id=call_id,
            session_id=self.session_id,
            session_source="header",
            task_id=self.task_id,
            group_id=self.group_id,
            sample_index=self.sample_index,
            call_index=len(self.records),
            provider=self.provider,
            harness=self.harness,
            requested_model="my-model",
            served_model=self.served_model,
            upstream="http://127.0.0.1:8000",
            policy_version=self.policy_version,
            status=status,
            http_status=200 if status == "ok" else 502,
            error_kind=None if status == "ok" else "upstream_5xx",
            finish_reason=finish_reason if status == "ok" else None,
            native_request={"model": "my-model", "messages": req["messages"]},
            native_path="/v1/chat/completions",
            normalized_request=req,
            prompt_token_ids=prompt_ids,
            sampled_token_ids=list(sampled_ids),
            sampled_logprobs=fake_logprobs(list(sampled_ids), call_id),
            output_text=out_content,
            output_reasoning=out_reasoning,
            output_tool_calls=[{k: c[k] for k in ("id", "name", "arguments")} for c in calls],
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(sampled_ids),
            t_request_in=self.t,
            t_upstream_sent=self.t + 0.001,
            t_upstream_first_byte=self.t + 0.05,
            t_upstream_end=self.t + 0.5,
            t_response_out=self.t + 0.501,
            proxy_id="synthetic",
        )
        self.records.append(rec)
        if echo and status == "ok":
            msg: dict[str, Any] = {"role": "assistant", "content": out_content}
            if calls:
                msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            if echo_reasoning and out_reasoning:
                msg["reasoning_content"] = out_reasoning
            if isinstance(echo, dict):
                msg.update(echo)
            self.messages.append(msg)
        return rec


def write_capture(capture_dir: str | Path, records: list[CallRecord], *, torn_tail: bool = False) -> Path:
    """Append records to ``<capture_dir>/sessions/<session>.jsonl`` as the proxy does."""
    by_session: dict[str, list[CallRecord]] = defaultdict(list)
    for r in records:
        by_session[r.session_id].append(r)
    d = Path(capture_dir) / SESSIONS_SUBDIR
    d.mkdir(parents=True, exist_ok=True)
    for sid, recs in by_session.items():
        with open(d / f"{sid}.jsonl", "ab") as fh:
            for r in recs:
                fh.write(orjson.dumps(r.to_dict()) + b"\n")
            if torn_tail:
                fh.write(orjson.dumps(recs[-1].to_dict())[:50])
    return Path(capture_dir)
