"""Fine-tune tiny-r1 for one harness until it makes tool calls: the live check of reasoning with tool calls.

Why: `tiny-r1` (the real DeepSeek-R1-Distill-Qwen tokenizer and template, random 2-layer weights)
never writes `</think>` nor a tool call, so a live run through a real harness never has a
tool-call turn to re-send. This script teaches a copy of it two answers, from the harness's own
prompts as the proxy captured them on tiny-r1 (`bench_reasoning_live.py`'s captures):

- the last message is the user's -> ``<think>`` reasoning ``</think>`` then a tool call of the
  harness's shell tool (``{"name": ..., "arguments": ...}``, read by Polar's lenient vLLM parser);
- the last message is a tool result -> ``<think>`` reasoning ``</think>`` then a short answer.

The contexts are the captured prompt ids (user-last) and the same requests with a tool call and
its result appended, rendered by the model's own chat template (transformers' ``apply_chat_template``
with the request's tools; checked against the captured ids on the captured requests). Full
fine-tuning, loss on the answer ids only, until every answer id has probability > 0.98 (so a
harness sampling at T=1 follows the script). The result is a model directory like tiny-r1's
(same tokenizer, template and reasoning-parser file), served by ``polar rollout --model DIR``.
One model per harness keeps the task trivial for 2 layers (no harness identity to learn).

    .venv/bin/python benchmarks/tune_tiny_r1_tools.py --captures runs/reasoning-live/pi-anthropic \
        --out runs/models/tiny-r1-tools-pi-anthropic
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from polar_core.schema import read_capture_lines  # noqa: E402

#: tool names harnesses give their shell tool, and how each takes its command
SHELL_TOOLS = ("bash", "Bash", "shell", "exec_command", "shell_command", "run_shell_command", "run_command")
TOOL_OUTPUTS = ("notes.txt\n", "", "first\n", "2 notes.txt\n", "Exit code: 0\n")
FOLLOWUPS = ("Now append a second line to notes.txt: second", "Finally, tell me how many lines notes.txt has.",
             "Thanks. Anything else?")


def shell_tool(tools: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a harmless ``ls`` through the request's shell tool."""
    by_name = {(t.get("function") or t).get("name"): (t.get("function") or t) for t in tools or []}
    for name in SHELL_TOOLS:
        if name in by_name:
            props = (by_name[name].get("parameters") or {}).get("properties") or {}
            key = next((k for k in ("command", "cmd") if k in props), None)
            if key is None:
                continue
            value: Any = ["bash", "-lc", "ls"] if props[key].get("type") == "array" else "ls"
            return name, {key: value}
    raise SystemExit(f"no shell tool among the request's tools: {sorted(by_name)}")


def examples(records: list[dict[str, Any]], tok: Any, max_calls: int, outputs: int) -> tuple[list[tuple[list[int], list[int]]], dict[str, Any]]:
    """(context ids, answer ids) pairs, and what was built."""
    calls = [r for r in records if r.get("status") == "ok" and r.get("prompt_token_ids") and r.get("normalized_request")]
    if not calls:
        raise SystemExit("no captured call with prompt ids and a normalized request")
    calls = calls[:max_calls]
    tools = calls[0]["normalized_request"].get("tools") or []
    name, arguments = shell_tool(tools)
    call_text = json.dumps({"name": name, "arguments": arguments})
    tool_answer = f"<think>\nI will look at the files first.\n</think>\n\n{call_text}"
    final_answer = "<think>\nThe command ran.\n</think>\n\nDone."
    eos = [tok.eos_token_id]

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + eos

    def render(messages: list[dict[str, Any]]) -> list[int]:
        out = tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) else out)

    # a re-sent tool call's content is null or "" depending on the harness's wire format; the
    # template renders the two differently, so both are taught
    tool_msgs = [{"role": "assistant", "content": content,
                  "tool_calls": [{"id": "call_0", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(arguments)}}]}
                 for content in (None, "")]
    pairs: list[tuple[list[int], list[int]]] = []
    rendered_equal = 0
    for r in calls:
        messages = r["normalized_request"]["messages"]
        rendered_equal += render(messages) == r["prompt_token_ids"]
        pairs.append((list(r["prompt_token_ids"]), ids(tool_answer)))
        for i, out in enumerate(TOOL_OUTPUTS[:outputs]):
            tool_msg = tool_msgs[i % 2]
            after = [*messages, tool_msg, {"role": "tool", "tool_call_id": "call_0", "content": out}]
            pairs.append((render(after), ids(final_answer)))
            follow = [*after, {"role": "assistant", "content": "Done."},
                      {"role": "user", "content": FOLLOWUPS[i % len(FOLLOWUPS)]}]
            pairs.append((render(follow), ids(tool_answer)))
    return pairs, {"tool": name, "arguments": arguments, "calls": len(calls), "rendered_equal": rendered_equal,
                   "examples": len(pairs)}


def augment(pairs: list[tuple[list[int], list[int]]], copies: int, vocab: int, seed: int = 0,
            keep_tail: int = 64, fraction: float = 0.1) -> list[tuple[list[int], list[int]]]:
    """The pairs plus ``copies`` noisy copies of each: a ``fraction`` of the context ids before its
    last ``keep_tail`` replaced by random ids. A harness's live prompt differs from the captured one
    (date, paths, ids): on Codex's 4k-id prompt a model taught one exact prompt wrote the wrong answer
    after its reasoning in 2 of 3 live calls; the noise teaches it to decide on the turn's end."""
    import random

    rng = random.Random(seed)
    out = list(pairs)
    for _ in range(copies):
        for ctx, ans in pairs:
            noisy = list(ctx)
            for i in rng.sample(range(max(0, len(ctx) - keep_tail)), int(fraction * max(0, len(ctx) - keep_tail))):
                noisy[i] = rng.randrange(vocab)
            out.append((noisy, ans))
    return out


def train(model: Any, pairs: list[tuple[list[int], list[int]]], max_steps: int, lr: float, target: float) -> dict[str, Any]:
    """AdamW on everything but the input embeddings (their dense gradient over 151k rows was most
    of a step), all pairs in one right-padded batch."""
    import torch

    model.model.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    width = max(len(c) + len(a) - 1 for c, a in pairs)
    seqs = torch.zeros(len(pairs), width, dtype=torch.long)
    mask = torch.zeros(len(pairs), width, dtype=torch.long)
    rows, cols, targets = [], [], []
    for i, (ctx, ans) in enumerate(pairs):
        seq = ctx + ans[:-1]
        seqs[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
        for j, t in enumerate(ans):
            rows.append(i), cols.append(len(ctx) - 1 + j), targets.append(t)
    rows_t, cols_t, targets_t = torch.tensor(rows), torch.tensor(cols), torch.tensor(targets)
    t0, worst = time.monotonic(), 0.0
    for step in range(1, max_steps + 1):
        opt.zero_grad()
        hidden = model.model(input_ids=seqs, attention_mask=mask).last_hidden_state[rows_t, cols_t]
        tok_logp = torch.log_softmax(model.lm_head(hidden).float(), -1).gather(-1, targets_t[:, None])[:, 0]
        (-tok_logp.mean()).backward()
        opt.step()
        worst = float(tok_logp.detach().min().exp())
        if step % 10 == 0 or worst > target:
            print(f"step {step}: lowest answer-id probability {worst:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
        if worst > target:
            break
    return {"steps": step, "lowest_answer_prob": round(worst, 4), "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from polar_runtime import models

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--captures", type=Path, required=True, help="a capture dir of one harness on tiny-r1")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--target-prob", type=float, default=0.98,
                    help="stop when every answer id has at least this probability (0.9 still let a T=1 "
                         "sample of Pi's run switch answers mid-way in 2 of 4 calls)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--calls", type=int, default=3, help="captured calls used (a long prompt costs a lot per step)")
    ap.add_argument("--init", type=Path, default=None, help="start from this tuned model instead of tiny-r1")
    ap.add_argument("--augment", type=int, default=0, help="noisy copies of each context (see augment())")
    ap.add_argument("--outputs", type=int, default=len(TOOL_OUTPUTS), help="tool outputs taught per call")
    args = ap.parse_args()
    base = models.ensure_model(models.TINY_R1)
    tok = AutoTokenizer.from_pretrained(base)
    records = [r for f in sorted((args.captures / "sessions").glob("*.jsonl")) for r in read_capture_lines(f)]
    pairs, built = examples(records, tok, args.calls, args.outputs)
    pairs = augment(pairs, args.augment, vocab=len(tok))
    built["augment"], built["examples"] = args.augment, len(pairs)
    print(json.dumps(built), flush=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(args.init or base, dtype=torch.float32)
    fit = train(model, pairs, args.max_steps, args.lr, args.target_prob)
    tmp = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    for name in (models.REASONING_PARSER_FILE,):
        shutil.copy(base / name, tmp / name)
    (tmp / "polar_tuned.json").write_text(json.dumps({"base": models.TINY_R1, "init": str(args.init) if args.init else None, **built, **fit}, indent=2))
    shutil.rmtree(args.out, ignore_errors=True)
    tmp.rename(args.out)
    print(json.dumps({"out": str(args.out), **fit}))


if __name__ == "__main__":
    main()
