"""Reconstruction and alignment speed on a realistic synthetic capture (10,000 calls, 500 sessions).

The capture is built the way a real one comes about, with the real Qwen2.5 tokenizer and chat
template (tiny-qwen): every chain's first prompt is rendered by the template (Pi's real system
prompt and tools when the harness fixtures are around), later prompts grow by the sampled ids plus
the tokenized tool result and template glue (thousands of tokens, growing every turn). Sessions
mix in interleaved sub-agents, compaction calls (a summary without tools, then a fresh history),
re-tokenized answers (``[fish, ing]``-style splits), truncated turns and failed calls.

Measured, for the first 1k calls and for all 10k: JSONL -> Parquet conversion, prefix-merge
reconstruction (calls frame -> trajectory frame, coverage verified id by id), and re-rendering
alignment (template + tokenizer per call). Prints tokens/s and the 10k/1k time ratio next to the
10x token ratio: reconstruction must stay close to linear in total tokens.

    .venv/bin/python benchmarks/bench_reconstruction.py [--calls 10000 --sessions 500] [--align-calls 1000]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from polar_analysis import alignment, frames  # noqa: E402
from polar_analysis.synthetic import fake_logprobs  # noqa: E402
from polar_analysis.trajectories import prefix_merge  # noqa: E402
from polar_core.paths import harness_request_fixtures  # noqa: E402

FIXTURES = [harness_request_fixtures()]


def _pi_request() -> tuple[str, list]:
    for d in FIXTURES:
        f = d / "pi.chat.second.json"
        if f.exists():
            body = json.loads(f.read_text())["body"]
            return body["messages"][0]["content"], body["tools"]
    tools = [{"type": "function", "function": {"name": n, "description": f"{n} a file or run a command", "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "command": {"type": "string"}}}}} for n in ("read", "bash", "edit", "write")]
    return "You are an expert coding assistant. " * 60, tools


def _snippets(n: int, rng: random.Random) -> list[str]:
    """Tool results: real source text of this repository, 5..120 lines each."""
    lines: list[str] = []
    for p in sorted((REPO / "polar_analysis").rglob("*.py")) + sorted((REPO / "addon").rglob("*.py")):
        lines += p.read_text(errors="replace").splitlines()
    lines = [ln for ln in lines if ln.strip()] or ["x = 1"]
    out = []
    for _ in range(n):
        k = rng.randint(5, 120)
        i = rng.randrange(max(1, len(lines) - k))
        out.append("\n".join(lines[i : i + k]))
    return out


class Builder:
    """Writes one session file at a time; token ids composed exactly as the template renders them."""

    def __init__(self, renderer: alignment.ChatTemplateRenderer, out: Path, seed: int):
        self.r, self.tok = renderer, renderer.tokenizer
        self.rng = random.Random(seed)
        self.out = out / "sessions"
        self.out.mkdir(parents=True, exist_ok=True)
        self.system, self.tools = _pi_request()
        self.sub_system = "You are a search sub-agent. Find files and report paths only."
        self.eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.results = _snippets(300, self.rng)
        self.result_ids: dict[int, np.ndarray] = {}
        self.answers = ["I will look at the file first.", "Running the tests now.", "Let me check the imports.", "Fixing the failing assertion.", ""]
        self.stats = {"calls": 0, "prompt_tokens": 0, "sampled_tokens": 0}

    def enc(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int32)

    def delta(self, k: int) -> np.ndarray:
        """Ids after an answer's <|im_end|>: the tool result turn and the next generation prompt."""
        if k not in self.result_ids:
            self.result_ids[k] = self.enc("\n<|im_start|>user\n<tool_response>\n" + self.results[k] + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        return self.result_ids[k]

    def chain(self, system: str, task: str, tools) -> dict:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        req = {"model": "tiny-qwen", "messages": msgs}
        if tools:
            req["tools"] = tools
        return {"messages": msgs, "tools": tools, "prompt": np.asarray(self.r.render(req), dtype=np.int32), "n": 0}

    def call(self, sid: str, idx: int, ch: dict, *, kind: str = "tool") -> dict:
        """One call on chain ``ch``; advances the chain unless the call failed."""
        rng = self.rng
        req = {"model": "tiny-qwen", "messages": list(ch["messages"])}
        if ch["tools"]:
            req["tools"] = ch["tools"]
        prompt = ch["prompt"]
        content = rng.choice(self.answers)
        name, args = rng.choice([("read", {"path": f"src/mod_{rng.randint(0, 99)}.py"}), ("bash", {"command": f"pytest -x tests/test_{rng.randint(0, 99)}.py"})])
        text = (content + "\n" if content else "") + "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
        finish = "tool_calls"
        if kind == "final":
            text, finish = "All tests pass now; the fix is in place.", "stop"
        sampled = np.concatenate([self.enc(text), [self.eot]]).astype(np.int32)
        echoed = sampled
        if kind == "retok" and content:  # the model spelled its first word letter by letter
            word = content.split(" ")[0]
            split = [self.enc(c) for c in word] + [self.enc(text[len(word) :]), np.asarray([self.eot])]
            sampled = np.concatenate(split).astype(np.int32)  # same text, other ids than the template's
        if kind == "length":
            sampled, finish, text = sampled[: max(3, len(sampled) // 2)], "length", ""
        status = "error" if kind == "error" else "ok"
        if status == "error":
            sampled = np.zeros(0, np.int32)
        rec = {
            "schema_version": 1, "record_type": "call", "call_id": f"{sid}-{idx}", "session_id": sid, "call_index": idx,
            "provider": "openai_chat", "harness": "pi", "served_model": "tiny-qwen", "status": status,
            "finish_reason": finish if status == "ok" else None, "normalized_request": req,
            "prompt_token_ids": prompt, "sampled_token_ids": sampled,
            "sampled_logprobs": fake_logprobs(sampled.tolist(), f"{sid}-{idx}"),
            "output_text": content if kind not in ("final", "length") else (text if kind == "final" else ""),
            "output_tool_calls": [{"id": f"c{idx}", "name": name, "arguments": json.dumps(args)}] if finish == "tool_calls" else [],
            "t_request_in": 1.0e9 + idx, "t_response_out": 1.0e9 + idx + 0.5, "policy_version": 0,
        }
        self.stats["calls"] += 1
        self.stats["prompt_tokens"] += int(prompt.size)
        self.stats["sampled_tokens"] += int(sampled.size)
        if status == "ok" and kind != "final":
            msg = {"role": "assistant", "content": (text.split("<tool_call>")[0].rstrip("\n") if kind != "length" else "")}
            if finish == "tool_calls":
                msg["tool_calls"] = [{"id": f"c{idx}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]
            k = rng.randrange(len(self.results))
            ch["messages"] = ch["messages"] + [msg, {"role": "tool", "tool_call_id": f"c{idx}", "content": self.results[k]}]
            if kind == "length":  # the harness echoes an empty turn: re-render from the messages
                r = {"model": "tiny-qwen", "messages": ch["messages"], **({"tools": ch["tools"]} if ch["tools"] else {})}
                ch["prompt"] = np.asarray(self.r.render(r), dtype=np.int32)
            else:
                ch["prompt"] = np.concatenate([prompt, echoed, self.delta(k)]).astype(np.int32)
            ch["n"] += 1
        return rec

    def session(self, s: int, n_calls: int) -> None:
        rng, sid = self.rng, f"bench-{s:04d}"
        main = self.chain(self.system, f"Task {s}: make the failing test in tests/test_{s}.py pass.", self.tools)
        sub = self.chain(self.sub_system, f"Find every file that imports module_{s}.", self.tools[:2]) if rng.random() < 0.2 else None
        compact_at = rng.randrange(6, n_calls) if rng.random() < 0.1 and n_calls > 8 else None
        lines = []
        for i in range(n_calls):
            ch = sub if sub is not None and rng.random() < 0.3 else main
            kind = "tool"
            u = rng.random()
            if i == n_calls - 1:
                kind = "final"
            elif u < 0.05:
                kind = "retok"
            elif u < 0.06:
                kind = "error"
            elif u < 0.07:
                kind = "length"
            if compact_at is not None and i == compact_at and ch is main:
                summary = {"role": "user", "content": "Summarize the work so far in a few lines."}
                req = {"model": "tiny-qwen", "messages": main["messages"] + [summary]}
                rec = self.call(sid, i, {"messages": req["messages"], "tools": None, "prompt": np.asarray(self.r.render(req), np.int32), "n": 0}, kind="final")
                lines.append(rec)
                main = self.chain(self.system, f"Task {s}, continued. Summary: tests were inspected and one import fixed.", self.tools)
                continue
            lines.append(self.call(sid, i, ch, kind=kind))
        with open(self.out / f"{sid}.jsonl", "wb") as fh:
            for rec in lines:
                fh.write(orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")


def build_capture(out: Path, n_calls: int, n_sessions: int, renderer, seed: int = 0) -> dict:
    b = Builder(renderer, out, seed)
    per = [n_calls // n_sessions + (1 if i < n_calls % n_sessions else 0) for i in range(n_sessions)]
    for s, n in enumerate(per):
        b.session(s, n)
    return b.stats


def timed(fn, *a, **kw):
    gc.collect()
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=10_000)
    ap.add_argument("--sessions", type=int, default=500)
    ap.add_argument("--small", type=int, default=1_000, help="calls in the small capture (same session length)")
    ap.add_argument("--align-calls", type=int, default=1_000, help="calls to re-render per capture (0: skip)")
    ap.add_argument("--model", default="tiny-qwen")
    ap.add_argument("--keep", type=Path, default=None, help="write the captures here and keep them")
    args = ap.parse_args()

    renderer = alignment.get_renderer(args.model)
    template = renderer.template_info()
    root = args.keep or Path(tempfile.mkdtemp(prefix="polar-bench-recon-"))
    results = {}
    try:
        for label, calls, sessions in (("1k", args.small, max(1, args.sessions * args.small // args.calls)), ("10k", args.calls, args.sessions)):
            d = root / label
            shutil.rmtree(d, ignore_errors=True)
            stats, t_build = timed(build_capture, d, calls, sessions, renderer)
            mb = sum(f.stat().st_size for f in (d / "sessions").glob("*.jsonl")) / 2**20
            _, t_conv = timed(lambda: frames.calls(d, rewards=None).select("call_id").collect())
            lf = frames.calls(d, rewards=None)
            (traj, st), t_merge = timed(prefix_merge.build, lf, template=template)
            tokens = stats["prompt_tokens"] + stats["sampled_tokens"]
            res = dict(calls=calls, sessions=sessions, jsonl_mb=mb, tokens=tokens, build_s=t_build, convert_s=t_conv, merge_s=t_merge,
                       sequences=st.sequences, coverage=st.coverage, merge_rate=st.merge_rate, exact_merge_rate=st.exact_merge_rate,
                       calls_per_sequence=st.calls_per_sequence, breaks=dict(st.break_reasons), kinds=dict(st.merge_kinds))
            if args.align_calls:
                sub = lf.head(args.align_calls)
                n_align_tokens = sub.select(frames.pl.col("n_prompt_ids").sum()).collect().item()
                al, t_align = timed(alignment.align, sub, renderer)
                res.update(align_calls=al.height, align_s=t_align, align_tokens=n_align_tokens,
                           align_exact=float((al["status"] == "exact").mean()))
            results[label] = res
            del traj, lf
            print(f"[{label}] {calls} calls / {sessions} sessions, {tokens / 1e6:.1f}M tokens, {mb:.0f} MB JSONL (built in {t_build:.1f}s)")
            print(f"      convert JSONL->Parquet {t_conv:6.2f}s  ({tokens / t_conv / 1e6:6.2f}M tok/s)")
            print(f"      prefix-merge           {t_merge:6.2f}s  ({tokens / t_merge / 1e6:6.2f}M tok/s)  "
                  f"{st.sequences} sequences, coverage {st.coverage:.2%}, merge rate {st.merge_rate:.1%}, exact {st.exact_merge_rate:.1%}, "
                  f"{st.calls_per_sequence:.1f} calls/sequence, breaks {dict(st.break_reasons)}")
            if args.align_calls:
                print(f"      alignment ({res['align_calls']} calls) {res['align_s']:6.2f}s  ({res['align_tokens'] / res['align_s'] / 1e6:6.3f}M tok/s, "
                      f"{res['align_s'] / res['align_calls'] * 1000:.1f} ms/call), exact {res['align_exact']:.1%}")
        a, b = results["1k"], results["10k"]
        print(f"\nscaling 1k -> 10k: tokens x{b['tokens'] / a['tokens']:.1f}, prefix-merge time x{b['merge_s'] / a['merge_s']:.1f}, "
              f"conversion time x{b['convert_s'] / a['convert_s']:.1f}")
        print(json.dumps({k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()} for k, v in results.items()}))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
