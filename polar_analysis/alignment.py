"""Re-tokenization: render each normalized request again and compare with the server's prompt ids.

The server's ``prompt_token_ids`` are the truth the trainer uses; re-rendering tells whether the
analysis side understands how they came about (same chat template, same preprocessing), and where
it does not, shows the first divergence with the decoded text on both sides.

The renderer mirrors what vLLM's chat endpoint does before ``apply_chat_template``: text parts
of a message joined with ``"\\n"`` (for templates that take string content), a Claude Code
``x-anthropic-billing-header`` line dropped from system text, ``developer`` turned into
``system`` when the template has no developer role, tool-call ``arguments`` JSON strings parsed
into dicts, ``reasoning`` passed as ``reasoning`` and ``reasoning_content``, tools dumped the way
vLLM's request model does; then ``apply_chat_template(messages, tools=...,
add_generation_prompt=True, **chat_template_kwargs)`` and ``encode(add_special_tokens=False)``.

For OpenAI-hosted model names (gpt-*, o1/o3/o4, ...) there is no chat template to run: the
tiktoken encoding counts the prompt (OpenAI's per-message accounting) against the reported
``prompt_tokens``, and decodes ids where they exist.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import orjson
import polars as pl

from polar_analysis.trajectories.common import TemplateInfo
from polar_core import paths
from polar_core.paths import model_dir_for  # noqa: F401 - also this module's API

BILLING_HEADER = "x-anthropic-billing-header"
_OPENAI_HOSTED = re.compile(r"^(gpt-|chatgpt-|o[1-9](-|$)|codex-|text-embedding-|davinci|babbage)", re.I)
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(\.content|\[['\"]content['\"]\])")

ALIGN_SCHEMA = {
    "call_id": pl.String,
    "session_id": pl.String,
    "call_index": pl.Int32,
    "renderer": pl.String,
    "status": pl.String,  # exact | diverged | count_match | count_mismatch | no_prompt_ids | no_request | render_error
    "n_server": pl.Int64,
    "n_rendered": pl.Int64,
    "first_divergence": pl.Int64,  # index of the first differing id (null when exact)
    "server_text": pl.String,  # decoded ids around the divergence, server side
    "rendered_text": pl.String,  # the same window, re-rendered side
    "detail": pl.String,
    "render_ms": pl.Float64,
}


def is_openai_hosted(model: str | None) -> bool:
    return bool(model) and _OPENAI_HOSTED.match(model.rsplit("/", 1)[-1]) is not None


def _text_of(content: Any) -> str | None:
    """A message's content as vLLM gives it to a string-content template (None: keep as is)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, (dict, str)) for p in content):
        texts = []
        for p in content:
            if isinstance(p, str):
                texts.append(p)
            elif p.get("type", "text") == "text":
                texts.append(p.get("text", ""))
            else:
                return None  # images etc.: not representable as a string
        return "\n".join(texts)
    return None


def _strip_billing_header(content: Any) -> Any:
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(parts, list):
        return content
    out = []
    for p in parts:
        text = p if isinstance(p, str) else p.get("text") if isinstance(p, dict) and p.get("type", "text") == "text" else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(p)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append({"type": "text", "text": rest})
    return out


def _tool_dict(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as vLLM's ChatCompletionToolsParam.model_dump() gives it to the template."""
    fn = tool.get("function") or {}
    f: dict[str, Any] = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters")}
    defer = tool.get("defer_loading")
    if fn.get("strict") is not None:
        f["strict"] = fn["strict"]
    if fn.get("defer_loading") is not None or defer is not None:
        f["defer_loading"] = fn.get("defer_loading") if fn.get("defer_loading") is not None else defer
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": f}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def vllm_conversation(
    request: dict[str, Any],
    *,
    string_content: bool = True,
    developer_role: bool = False,
    strip_billing_header: bool = True,
) -> list[dict[str, Any]]:
    """The messages as vLLM passes them to the chat template (see the module docstring).

    ``strip_billing_header=False`` renders like engines that keep Claude Code's header (SGLang,
    older vLLM, gateways), whose prompts then change from the first system line on every call.
    """
    conv: list[dict[str, Any]] = []
    for msg in request.get("messages") or []:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        content = msg.get("content")
        if role == "system" and strip_billing_header:
            content = _strip_billing_header(content if content is not None else "")
        out: dict[str, Any] = {"role": role}
        if string_content:
            text = _text_of(content)
            out["content"] = text if text is not None else content
        else:
            out["content"] = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                out["tool_calls"] = msg["tool_calls"]
            reasoning = msg.get("reasoning", msg.get("reasoning_content"))
            if reasoning is not None:
                out["reasoning"] = reasoning
                out["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            out["name"] = msg["name"]
        conv.append(out)
    # tool-call arguments: JSON strings -> dicts (malformed or non-object -> {}); empty lists dropped
    for m in conv:
        if m["role"] != "assistant" or "tool_calls" not in m or not isinstance(m["tool_calls"], list):
            continue
        if not m["tool_calls"]:
            del m["tool_calls"]
            continue
        for item in m["tool_calls"]:
            fn = item.get("function") if isinstance(item, dict) else None
            if not isinstance(fn, dict):
                continue
            args = fn.get("arguments")
            if not args:
                fn["arguments"] = {}
            elif isinstance(args, str):
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = {}
                fn["arguments"] = parsed if isinstance(parsed, dict) else {}
            elif not isinstance(args, dict):
                fn["arguments"] = {}
    if not developer_role and any(m["role"] == "developer" for m in conv):
        conv = [dict(m, role="system") if m["role"] == "developer" else m for m in conv]
        systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
        if systems and (systems[0] > 0 or len(systems) > 1):
            texts = [t for i in systems if (t := _text_of(conv[i]["content"]) or "")]
            conv = [{"role": "system", "content": "\n\n".join(texts)}] + [m for m in conv if m["role"] != "system"]
    return conv


# ------------------------------------------------------------------------------------------------
# Renderers
# ------------------------------------------------------------------------------------------------
class Renderer:
    name: str = ""

    def render(self, request: dict[str, Any]) -> list[int]:
        raise NotImplementedError

    def render_many(self, requests: list[dict[str, Any]]) -> list[list[int] | Exception]:
        out: list[list[int] | Exception] = []
        for r in requests:
            try:
                out.append(self.render(r))
            except Exception as exc:  # a template that rejects a request is a finding, not a crash
                out.append(exc)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def template_info(self, **chat_template_kwargs: Any) -> TemplateInfo:
        raise NotImplementedError


class _SegmentEncoder:
    """``encode(text, add_special_tokens=False)``, tokenizing each stretch between added tokens once.

    Hugging Face tokenizers cut the text at added tokens (``<|im_start|>``, ``<|im_end|>``,
    ``<tool_call>``...) before normalizing and pre-tokenizing, so every stretch between two of
    them is encoded independently: the ids of a prompt are the concatenation of its stretches'
    ids. The turns of a session repeat in every later prompt, so caching stretches makes
    re-tokenizing a session cost its text once instead of once per call. Exactness is guarded:
    tokenizers whose added tokens strip whitespace or match single words use plain encoding.
    """

    MAX_CACHED_CHARS = 64_000_000

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.ids = {a.content: i for i, a in added.items()}
        plain = all(not (a.lstrip or a.rstrip or a.single_word) for a in added.values())
        self.pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(self.ids, key=len, reverse=True)) + ")") if added and plain else None
        self.cache: dict[str, list[int]] = {}
        self.cached_chars = 0

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        if self.pattern is None:
            return self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []
        split = [self.pattern.split(t) for t in texts]
        todo = list({p for parts in split for i, p in enumerate(parts) if i % 2 == 0 and p and p not in self.cache})
        if todo:
            if self.cached_chars > self.MAX_CACHED_CHARS:
                self.cache.clear()
                self.cached_chars = 0
            for p, ids in zip(todo, self.tok(todo, add_special_tokens=False)["input_ids"]):
                self.cache[p] = ids
                self.cached_chars += len(p)
        out = []
        for parts in split:
            ids: list[int] = []
            for i, p in enumerate(parts):
                if i % 2:
                    ids.append(self.ids[p])
                elif p:
                    ids.extend(self.cache[p])
            out.append(ids)
        return out


@functools.lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    """One tokenizer per model directory per process (loading takes about a second)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, fix_mistral_regex=False)


class ChatTemplateRenderer(Renderer):
    """A Hugging Face tokenizer directory with its chat template (what vLLM serves)."""

    def __init__(self, model_dir: str | Path, *, chat_template: str | None = None, strip_billing_header: bool = True):
        self.strip_billing_header = strip_billing_header
        self.model_dir = str(Path(model_dir).resolve())
        self.name = Path(model_dir).name
        self.tokenizer = load_tokenizer(self.model_dir)  # shared: never mutated here
        template = chat_template if chat_template is not None else self.tokenizer.chat_template or ""
        if not isinstance(template, str):  # a dict of named templates: the default one
            template = template.get("default", "")
        self.chat_template = template
        self._segments = _SegmentEncoder(self.tokenizer)
        self.string_content = _CONTENT_LOOP.search(template) is None
        self.developer_role = '"developer"' in template or "'developer'" in template

    def render_text(self, request: dict[str, Any]) -> str:
        conv = vllm_conversation(
            request,
            string_content=self.string_content,
            developer_role=self.developer_role,
            strip_billing_header=self.strip_billing_header,
        )
        tools = request.get("tools")  # vLLM keeps them even with tool_choice="none" (default flags)
        kwargs = dict(request.get("chat_template_kwargs") or {})
        if request.get("reasoning_effort") is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = request["reasoning_effort"] != "none"
            kwargs.setdefault("reasoning_effort", request["reasoning_effort"])
        kwargs.setdefault("add_generation_prompt", request.get("add_generation_prompt", True))
        kwargs.setdefault("continue_final_message", request.get("continue_final_message", False))
        return self.tokenizer.apply_chat_template(
            conv,
            tools=[_tool_dict(t) for t in tools] if tools else None,
            chat_template=self.chat_template,
            tokenize=False,
            **kwargs,
        )

    def render(self, request: dict[str, Any]) -> list[int]:
        return self._segments.encode_many([self.render_text(request)])[0]

    def render_many(self, requests: list[dict[str, Any]]) -> list[list[int] | Exception]:
        """Render texts one by one (Jinja), tokenize what is new in one batch (parallel in Rust)."""
        texts: list[str | Exception] = []
        for r in requests:
            try:
                texts.append(self.render_text(r))
            except Exception as exc:
                texts.append(exc)
        ok = [t for t in texts if isinstance(t, str)]
        enc = iter(self._segments.encode_many(ok))
        return [next(enc) if isinstance(t, str) else t for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def template_info(self, **chat_template_kwargs: Any) -> TemplateInfo:
        """End-of-turn ids, generation prompt and history assistant header, from the template itself."""
        tok = self.tokenizer
        user = [{"role": "user", "content": "ping"}]
        answer = "pong"

        def ids(messages: list[dict[str, Any]], gen: bool) -> list[int]:
            text = tok.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=gen, **chat_template_kwargs
            )
            return tok.encode(text, add_special_tokens=False)

        base = ids(user, False)
        with_gen = ids(user, True)
        with_answer = ids(user + [{"role": "assistant", "content": answer}], False)
        gen = with_gen[len(base) :] if with_gen[: len(base)] == base else []
        turn = with_answer[len(base) :] if with_answer[: len(base)] == base else []
        header: list[int] = []
        for a, b in zip(gen, turn):
            if a != b:
                break
            header.append(a)
        answer_ids = tok.encode(answer, add_special_tokens=False)
        eot: set[int] = set()
        rest = turn[len(header) :]
        if rest[: len(answer_ids)] == answer_ids and len(rest) > len(answer_ids):
            eot.add(rest[len(answer_ids)])
        if tok.eos_token_id is not None and not eot:
            eot.add(tok.eos_token_id)
        return TemplateInfo(
            eot_ids=frozenset(eot),
            generation_prompt=tuple(gen),
            assistant_header=tuple(header),
            decode=self.decode,
            source=f"chat_template:{self.name}",
        )


def tiktoken_encoding(name: str) -> Any:
    """A tiktoken Encoding read offline from Polar's cache, where ``polar models build <name>`` puts it."""
    import tiktoken

    os.environ["TIKTOKEN_CACHE_DIR"] = str(paths.tiktoken_cache_dir())
    try:
        return tiktoken.get_encoding(name)
    except Exception as exc:  # not in the cache: tiktoken tried the network
        raise RuntimeError(f"tiktoken {name} is not built in {paths.tiktoken_cache_dir()}; "
                           f"run `polar models build {name}` ({type(exc).__name__}: {exc})") from None


class TiktokenRenderer(Renderer):
    """OpenAI-hosted models: tiktoken counts (OpenAI's per-message accounting) and decodes ids."""

    TOKENS_PER_MESSAGE = 3
    TOKENS_PER_NAME = 1
    REPLY_PRIMING = 3

    def __init__(self, model: str):
        self.model = model
        self.encoding_name = "o200k_base" if not re.match(r"^(gpt-4(-|$)|gpt-3\.5|gpt-4-turbo)", model) else "cl100k_base"
        self.encoding = tiktoken_encoding(self.encoding_name)
        self.name = f"tiktoken:{self.encoding_name}"

    def count(self, request: dict[str, Any]) -> int:
        n = self.REPLY_PRIMING
        for m in vllm_conversation(request, developer_role=True):
            n += self.TOKENS_PER_MESSAGE
            for key, value in m.items():
                if key in ("reasoning", "reasoning_content"):
                    continue
                text = value if isinstance(value, str) else json.dumps(value) if value else ""
                n += len(self.encoding.encode(text, disallowed_special=()))
                if key == "name":
                    n += self.TOKENS_PER_NAME
        return n

    def render(self, request: dict[str, Any]) -> list[int]:
        text = "".join(f"{m['role']}\n{_text_of(m.get('content')) or ''}\n" for m in vllm_conversation(request, developer_role=True))
        return self.encoding.encode(text, disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def template_info(self, **chat_template_kwargs: Any) -> TemplateInfo:
        return TemplateInfo(eot_ids=frozenset(), decode=self.decode, source=self.name)


def get_renderer(model: str | Path, *, chat_template: str | None = None) -> Renderer:
    """A renderer for a model directory, a built model's name, or an OpenAI-hosted model name."""
    d = model_dir_for(str(model))
    if d is not None:
        return ChatTemplateRenderer(d, chat_template=chat_template)
    if is_openai_hosted(str(model)):
        return TiktokenRenderer(str(model))
    raise FileNotFoundError(f"no tokenizer for model {model!r}: pass a model directory or build it (`polar models build`)")


def renderer_for_calls(calls_lf: pl.LazyFrame, model: str | Path | None = None) -> Renderer | None:
    """The renderer to use: ``model`` when given, else the most common served model of the capture."""
    if model:
        return get_renderer(model)
    top = (
        calls_lf.select(pl.coalesce(pl.col("served_model").replace("", None), pl.col("requested_model")).alias("m"))
        .drop_nulls()
        .group_by("m")
        .len()
        .sort("len", descending=True)
        .collect()
    )
    for name in top["m"].to_list():
        try:
            return get_renderer(name)
        except (FileNotFoundError, OSError):
            continue
    return None


def tokenizer_fingerprint(renderer: Renderer | None) -> str | None:
    """``polar_core.tokenizer_identity.fingerprint`` of a chat-template renderer's tokenizer (what
    the trajectories record for the trainer to check); None without one (tiktoken, none found)."""
    tok = getattr(renderer, "tokenizer", None)
    if tok is None:
        return None
    from polar_core.tokenizer_identity import fingerprint

    return fingerprint(tok)


def template_info_for(renderer: Renderer | None, calls_lf: pl.LazyFrame | None = None) -> TemplateInfo | None:
    """Template facts with the chat_template_kwargs the capture used (e.g. enable_thinking)."""
    if renderer is None:
        return None
    kwargs: dict[str, Any] = {}
    if calls_lf is not None:
        first = calls_lf.select("normalized_request").drop_nulls().head(1).collect()
        if first.height:
            kwargs = (orjson.loads(first.item()) or {}).get("chat_template_kwargs") or {}
    return renderer.template_info(**kwargs)


# ------------------------------------------------------------------------------------------------
# Alignment
# ------------------------------------------------------------------------------------------------
@dataclass
class Alignment:
    status: str
    n_server: int
    n_rendered: int | None = None
    first_divergence: int | None = None
    server_text: str | None = None
    rendered_text: str | None = None
    detail: str | None = None


def first_divergence(a: np.ndarray, b: np.ndarray) -> int | None:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    if diff.size:
        return int(diff[0])
    return None if a.size == b.size else n


def compare(server: np.ndarray, rendered: list[int], decode: Callable[[list[int]], str], window: int = 12) -> Alignment:
    r = np.asarray(rendered, dtype=np.int64)
    d = first_divergence(server.astype(np.int64), r)
    if d is None:
        return Alignment("exact", int(server.size), int(r.size))
    lo = max(0, d - window)
    return Alignment(
        "diverged",
        int(server.size),
        int(r.size),
        d,
        decode(server[lo : d + window].tolist()),
        decode(r[lo : d + window].tolist()),
        f"before: {decode(server[lo:d].tolist())!r}",
    )


def align(
    calls_lf: pl.LazyFrame,
    renderer: Renderer,
    *,
    batch_size: int = 64,
    progress: Callable[[int], None] | None = None,
) -> pl.DataFrame:
    """One row per call (ALIGN_SCHEMA): exact match, or first divergence with context."""
    rows: list[dict[str, Any]] = []
    cols = ["call_id", "session_id", "call_index", "normalized_request", "prompt_token_ids", "prompt_tokens"]
    for batch in calls_lf.select(cols).collect_batches(chunk_size=batch_size):
        requests = [orjson.loads(r) if r else None for r in batch["normalized_request"].to_list()]
        t0 = time.perf_counter()
        todo = [r for r in requests if r is not None]
        rendered = iter(renderer.render_many(todo)) if not isinstance(renderer, TiktokenRenderer) else iter(())
        per_call_ms = (time.perf_counter() - t0) * 1000 / max(1, len(todo))
        prompt_col = batch["prompt_token_ids"]
        for i, req in enumerate(requests):
            server = prompt_col[i].to_numpy() if prompt_col[i] is not None else np.zeros(0, np.int32)
            base = {"call_id": batch["call_id"][i], "session_id": batch["session_id"][i], "call_index": batch["call_index"][i], "renderer": renderer.name}
            if req is None:
                rows.append(base | {"status": "no_request", "n_server": int(server.size)})
                continue
            if isinstance(renderer, TiktokenRenderer):
                n = renderer.count(req)
                reported = batch["prompt_tokens"][i] or 0
                al = Alignment("count_match" if n == reported else "count_mismatch", int(server.size), n, detail=f"reported prompt_tokens={reported}")
                if server.size:
                    al = compare(server, renderer.render(req), renderer.decode)
            else:
                out = next(rendered)
                if isinstance(out, Exception):
                    al = Alignment("render_error", int(server.size), detail=f"{type(out).__name__}: {out}")
                elif server.size == 0:
                    al = Alignment("no_prompt_ids", 0, len(out))
                else:
                    al = compare(server, out, renderer.decode)
            rows.append(base | al.__dict__ | {"render_ms": per_call_ms})
        if progress:
            progress(batch.height)
    return pl.DataFrame(rows, schema=ALIGN_SCHEMA) if rows else pl.DataFrame(schema=ALIGN_SCHEMA)
