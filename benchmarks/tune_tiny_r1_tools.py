"""Fine-tune tiny-r1 for one harness until it makes tool calls: the live check of reasoning with tool calls.

Why: `tiny-r1` (the real DeepSeek-R1-Distill-Qwen tokenizer and template, random 2-layer weights)
never writes `</think>` nor a tool call, so a live run through a real harness never has a
tool-call turn to re-send. This script teaches a copy of it two answers, from the harness's own
prompts as the proxy captured them on tiny-r1 (`bench_reasoning_live.py`'s captures):

- the last message is the user's -> ``<think>`` reasoning ``</think>`` then a tool call of the
  harness's shell tool (``{"name": ..., "arguments": ...}``, read by Polar's lenient vLLM parser);
- the last message is a tool result -> reasoning without ``<think>`` (as a template that opens the
  block leaves it), ``</think>``, then a short answer (``TOOL_REASONING``, ``FINAL_ANSWER``).

The contexts are the captured prompt ids (user-last) and the same requests with a tool call and
its result appended, rendered by the model's own chat template (transformers' ``apply_chat_template``
with the request's tools; checked against the captured ids on the captured requests). Full
fine-tuning, loss on the answer ids only, until every answer id has probability > 0.98 (so a
harness sampling at T=1 follows the script). The result is a model directory like tiny-r1's
(same tokenizer, template and reasoning-parser file), served by ``polar rollout --model DIR``.
One model per harness keeps the task trivial for 2 layers (no harness identity to learn).

    .venv/bin/python benchmarks/tune_tiny_r1_tools.py --captures runs/reasoning-live/codex \
        --out runs/models/tiny-r1-tools-codex-chain --calls 3 --outputs 2 --augment 1 --noise 0.3 --tail 1024
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


#: The two taught answers differ at their first id and share no id but ``</think>`` (and the end of
#: sequence), and the tool call's JSON is spaced so that no id repeats within it: each next id then
#: follows from the current one (plus, at ``</think>``, whether ``<think>`` was written), which 2
#: layers carry over a 4k-id prompt they were not taught. With the plain ``json.dumps`` spacing
#: (``": "`` three times) and both answers opening ``<think>\n``, Codex's model (taught on all
#: three captured prompts to 0.991) answered its first live prompt with the tool-result answer and
#: wrote ``{"name": {"cmd": "arguments": ...`` on the third. The final answer starting inside its
#: reasoning (no ``<think>``) is what templates that open the block themselves produce; the
#: deepseek_r1 parser reads it as reasoning up to ``</think>``.
TOOL_REASONING = "<think>\nI will look at the files first.\n</think>\n\n"
FINAL_ANSWER = "The command ran</think>Done"


def call_json(tok: Any, name: str, arguments: dict[str, Any], avoid: str = "") -> str:
    """The ``{"name": ..., "arguments": ...}`` text, spaced so that as few ids as possible repeat
    (none for ``exec_command``/``bash`` with a string command) and none is shared with ``avoid``."""
    import itertools

    taken = set(tok(avoid, add_special_tokens=False)["input_ids"]) if avoid else set()
    best: tuple[int, str] | None = None
    for after_name, after_value, after_args, inner in itertools.product((": ", ":"), (", ", ","), (": ", ":"), (": ", ":")):
        text = ('{"name"' + after_name + json.dumps(name) + after_value + '"arguments"' + after_args
                + json.dumps(arguments, separators=(",", inner)) + "}")
        ids = tok(text, add_special_tokens=False)["input_ids"]
        repeats = len(ids) - len(set(ids)) + len(taken.intersection(ids))
        if best is None or repeats < best[0]:
            best = (repeats, text)
    return best[1]


def examples(records: list[dict[str, Any]], tok: Any, max_calls: int, outputs: int) -> tuple[list[tuple[list[int], list[int]]], dict[str, Any]]:
    """(context ids, answer ids) pairs, and what was built."""
    calls = [r for r in records if r.get("status") == "ok" and r.get("prompt_token_ids") and r.get("normalized_request")]
    if not calls:
        raise SystemExit("no captured call with prompt ids and a normalized request")
    calls = calls[:max_calls]
    tools = calls[0]["normalized_request"].get("tools") or []
    name, arguments = shell_tool(tools)
    tool_answer = TOOL_REASONING + call_json(tok, name, arguments, avoid=FINAL_ANSWER)
    final_answer = FINAL_ANSWER
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
                   "examples": len(pairs), "tool_answer": tool_answer, "final_answer": final_answer}


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


def answer_logprobs(model: Any, ctx: list[int], ans: list[int]) -> Any:
    """Log-probabilities of the answer ids after the context, one unpadded sequence (no mask, so
    SDPA's causal kernel: a 4.3k-id sequence takes 0.55 s forward and backward, where a padded
    batch of 30 took 57 s a step)."""
    import torch

    hidden = model.model(input_ids=torch.tensor([ctx + ans[:-1]])).last_hidden_state[0, len(ctx) - 1:]
    return torch.log_softmax(model.lm_head(hidden).float(), -1).gather(-1, torch.tensor(ans)[:, None])[:, 0]


def lowest_prob(model: Any, pairs: list[tuple[list[int], list[int]]]) -> float:
    """The lowest probability of any answer id over the pairs: what a T=1 sample may miss."""
    import torch

    with torch.no_grad():
        return min(float(answer_logprobs(model, c, a).min().exp()) for c, a in pairs)


def train(model: Any, pairs: list[tuple[list[int], list[int]]], max_steps: int, lr: float, target: float,
          tail: int = 0, seed: int = 0) -> dict[str, Any]:
    """AdamW on everything but the input embeddings (their dense gradient over 151k rows was most
    of a step), one step per pass over the pairs. ``tail`` > 0: each step sees only the last
    ``tail/4``-``tail`` ids of each context (random), 5-30x cheaper than Codex's 4.3k-id prompts;
    the stop is then checked on the whole contexts, so the figure reported is theirs."""
    import random

    import torch

    rng = random.Random(seed)
    model.model.embed_tokens.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    t0, worst, whole = time.monotonic(), 0.0, None
    for step in range(1, max_steps + 1):
        opt.zero_grad()
        worst = 1.0
        for ctx, ans in pairs:
            if tail:
                ctx = ctx[-rng.randint(max(1, tail // 4), tail):]
            logp = answer_logprobs(model, ctx, ans)
            (-logp.sum() / sum(len(a) for _, a in pairs)).backward()
            worst = min(worst, float(logp.detach().min().exp()))
        opt.step()
        whole = lowest_prob(model, pairs) if tail and (worst > target or step % 10 == 0) else (None if tail else worst)
        if step % 10 == 0 or worst > target:
            print(f"step {step}: lowest answer-id probability {worst:.3f}"
                  + (f", on whole contexts {whole:.3f}" if tail else "") + f" ({time.monotonic() - t0:.0f} s)", flush=True)
        if worst > target and (whole or 0.0) > target:
            break
    return {"steps": step, "lowest_answer_prob": round(whole if whole is not None else lowest_prob(model, pairs), 4),
            "tail": tail, "seconds": round(time.monotonic() - t0, 1)}


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
    ap.add_argument("--tail", type=int, default=0, help="train on the last tail/4..tail ids of each context (see train())")
    ap.add_argument("--noise", type=float, default=0.1, help="fraction of a noisy copy's context ids replaced")
    ap.add_argument("--outputs", type=int, default=len(TOOL_OUTPUTS), help="tool outputs taught per call")
    args = ap.parse_args()
    base = models.ensure_model(models.TINY_R1)
    tok = AutoTokenizer.from_pretrained(base)
    records = [r for f in sorted((args.captures / "sessions").glob("*.jsonl")) for r in read_capture_lines(f)]
    pairs, built = examples(records, tok, args.calls, args.outputs)
    pairs = augment(pairs, args.augment, vocab=len(tok), fraction=args.noise)
    built["augment"], built["noise"], built["examples"] = args.augment, args.noise, len(pairs)
    print(json.dumps(built), flush=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM.from_pretrained(args.init or base, dtype=torch.float32)
    fit = train(model, pairs, args.max_steps, args.lr, args.target_prob, tail=args.tail)
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
