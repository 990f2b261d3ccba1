"""LoRA serving routes on a real vLLM: the adapter merged into the weights before each push (what
the product does, ``training/lora.py``) against one vLLM LoRA adapter per policy version
(``--enable-lora``, ``/v1/load_lora_adapter``).

    flock /tmp/polar-heavy.lock timeout 900 .venv/bin/python benchmarks/bench_lora_serving.py

The trainer's side: Qwen2.5-Coder-0.5B (float32) with peft LoRA (rank 16, alpha 32, all seven
projections: ``lora.apply_lora``), the adapters' B matrices drawn at random (peft starts them at
zero, where both routes serve the base model and compare nothing) so the adapter moves the probe's
logprobs by a visible amount; a second draw is the next policy version. Per version each route
writes what vLLM needs: the merged handoff directory (``TrainSession.write_handoff``, the product's
path, with the probe) or a peft adapter directory (``adapter_config.json`` + 35 MB safetensors).

Measured, each route on its own vLLM (started one after the other, same flags otherwise):
- per policy version: the trainer's write, then vLLM's load (merged: the in-place reload,
  ``collective_rpc reload_weights``; adapter: ``/v1/load_lora_adapter`` under a new name);
- decode tokens/s (streamed, greedy, ``ignore_eos``; first to last token), the merged model against
  the adapter, and the LoRA-enabled server's base model without an adapter;
- the trainer-vs-vLLM logprob gap over the probe, for both routes.
Writes ``benchmarks/results/lora_serving.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results" / "lora_serving.json"
PROBE_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
              "    for _ in range(n):\n        a, b = b, a + b\n    return a\n")
DECODE_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def post(url: str, body: dict, timeout: float = 300.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def decode_rate(base: str, model: str, tokens: int) -> dict:
    """Greedy streamed completion of ``tokens`` tokens: decode tokens/s from the first to the last."""
    body = {"model": model, "prompt": DECODE_PROMPT, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    stamps: list[float] = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                obj = json.loads(line[5:])
                if obj.get("choices") and obj["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter())
    n = len(stamps)
    return {"chunks": n, "ttft_s": stamps[0] - t0, "decode_tok_s": (n - 1) / (stamps[-1] - stamps[0])}


def served_logprobs(base: str, model: str, ids: list[int]) -> list[float]:
    status, raw = post(f"{base}/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                                  "prompt_logprobs": 0})
    if status != 200:
        raise RuntimeError(f"prompt logprobs of {model}: HTTP {status} {raw[:300]}")
    entries = json.loads(raw)["choices"][0]["prompt_logprobs"][1:]
    return [float((e.get(str(t)) or next(iter(e.values())))["logprob"]) for t, e in zip(ids[1:], entries)]


def gap(a: list[float], b: list[float]) -> dict:
    d = [abs(x - y) for x, y in zip(a, b)]
    return {"max": max(d), "mean": sum(d) / len(d)}


def write_adapter(model, settings, out: Path) -> float:
    """The adapters in peft's on-disk format (what ``/v1/load_lora_adapter`` reads); seconds."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    from polar_training.lora import ADAPTER, adapter_state_dict

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v.contiguous()
               for k, v in adapter_state_dict(model).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"))
    LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.targets),
               lora_dropout=0.0, bias="none").save_pretrained(str(out))
    return time.perf_counter() - t0


def save(res: dict) -> None:
    """Written after every phase: a run cut by its timeout keeps what it measured."""
    for route in ("merged", "adapter"):
        r = res.get(route) or {}
        for key in [k for k in r if k.startswith("decode") and isinstance(r[k], list)]:
            r[key + "_median_tok_s"] = statistics.median(d["decode_tok_s"] for d in r[key]) if r[key] else None
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2))


def main() -> None:
    import signal

    # `timeout` sends SIGTERM: leave through the context managers, so the vLLM servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--b-std", type=float, default=0.005, help="std of the random LoRA B matrices")
    ap.add_argument("--tokens", type=int, default=64, help="decode length per measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    args = ap.parse_args()

    import torch

    from polar_runtime import models
    from polar_runtime.loop.phases import servable_dir
    from polar_runtime.serve import VLLMServer
    from polar_training import checkpoint as ckpt
    from polar_training.config import LossConfig, TrainConfig
    from polar_training.lora import LoraSettings, _lora_layers, ADAPTER
    from polar_training.session import TrainSession
    from polar_training.weights_push import PushError, verify_served
    from transformers import AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 2)
    model_dir = models.ensure_model(args.model) if args.model in models.SPECS else Path(args.model)
    serve_dir = servable_dir(model_dir, print)
    work = Path(tempfile.mkdtemp(prefix="bench-lora-serving-", dir=REPO / "runs" if (REPO / "runs").is_dir() else None))
    res: dict = {"model": args.model, "rank": args.rank, "alpha": 2.0 * args.rank, "b_std": args.b_std,
                 "decode_tokens": args.tokens, "reps": args.reps, "cpus": os.cpu_count(),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": []}
    try:
        # -- the trainer: LoRA model, two policy versions, each written both ways ------------------------
        settings = LoraSettings(rank=args.rank, alpha=2.0 * args.rank)
        cfg = TrainConfig(lr=1e-6, token_budget=8192, loss=LossConfig(kl_coef=0.0))
        t0 = time.perf_counter()
        session = TrainSession(model_dir, work / "run", cfg, handoff_root=work / "handoff", keep_reference=False,
                               lora=settings)
        res["trainer_load_s"] = time.perf_counter() - t0
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        probe = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        res["probe_tokens"] = len(probe)
        base_lp = ckpt.probe_logprobs(session.trainer.policy, probe)
        layers = _lora_layers(session.trainer.model)
        gen = torch.Generator().manual_seed(0)
        versions = []
        for v in (1, 2):
            with torch.no_grad():
                for layer in layers.values():
                    w = layer.lora_B[ADAPTER].weight
                    w.copy_(torch.randn(w.shape, generator=gen) * args.b_std)
            session._probe = (probe, base_lp)  # the probe the push check compares (as a step sets it)
            session.trainer.step = v  # the handoff's name and policy_version
            t0 = time.perf_counter()
            handoff = session.write_handoff()
            merged_s = time.perf_counter() - t0
            keep = work / f"merged-v{v}"
            shutil.move(str(handoff), keep)  # kept for the servers (the next handoff would remove it)
            session._handoff = None
            adapter_dir = work / f"adapter-v{v}"
            adapter_s = write_adapter(session.trainer.model, settings, adapter_dir)
            trainer_lp = ckpt.read_meta(keep)["probe"]["logprobs"]
            size = sum(f.stat().st_size for f in adapter_dir.iterdir())
            versions.append({"version": v, "merged_dir": str(keep), "adapter_dir": str(adapter_dir),
                             "trainer_lp": trainer_lp})
            res["versions"].append({"version": v, "merged_write_s": merged_s, "adapter_write_s": adapter_s,
                                    "adapter_bytes": size, "adapter_moves_probe": gap(trainer_lp, base_lp)})
            save(res)
            print(f"v{v}: merged handoff written in {merged_s:.1f} s, adapter ({size / 1e6:.1f} MB) in {adapter_s:.2f} s; "
                  f"the adapter moves the probe by {gap(trainer_lp, base_lp)['mean']:.3f} (mean |dlogp|)", flush=True)
        session.close(checkpoint=False)
        del session, layers
        import gc

        gc.collect()

        # -- route 1: merged weights, reloaded in place (the product) -------------------------------------
        server = VLLMServer(serve_dir, served_model_name="bench", max_model_len=2048, kv_cache_gib=args.kv_cache_gib,
                            log_path=work / "vllm-merged.log")
        merged: dict = {"loads": [], "gap": [], "decode": []}
        with server:
            merged["start_s"] = server.start_seconds
            print(f"merged route: vLLM ready in {server.start_seconds} s", flush=True)
            for ver in versions:
                t = server.reload_weights(ver["merged_dir"])
                try:
                    verdict = f"verified ({verify_served(server.base_url, ver['merged_dir']):.2e})"
                except PushError as exc:
                    verdict = f"NOT verified: {exc}"
                served = served_logprobs(server.base_url, "bench", probe)
                merged["loads"].append({"version": ver["version"], "reload_s": t, "push_check": verdict})
                merged["gap"].append(gap(served, ver["trainer_lp"]))
                print(f"  v{ver['version']}: reload {t:.1f} s, push check {verdict}, gap max "
                      f"{merged['gap'][-1]['max']:.2e}", flush=True)
            decode_rate(server.base_url, "bench", 8)  # warm-up
            for _ in range(args.reps):
                merged["decode"].append(decode_rate(server.base_url, "bench", args.tokens))
                res["merged"] = merged
                save(res)
            print(f"  decode {statistics.median(d['decode_tok_s'] for d in merged['decode']):.2f} tok/s", flush=True)
        res["merged"] = merged
        save(res)

        # -- route 2: one vLLM adapter per policy version -------------------------------------------------
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        server = VLLMServer(serve_dir, served_model_name="bench", max_model_len=2048, kv_cache_gib=args.kv_cache_gib,
                            log_path=work / "vllm-lora.log",
                            extra_args=("--enable-lora", "--max-lora-rank", str(args.rank), "--max-loras", "1"))
        lora_route: dict = {"loads": [], "gap": [], "decode_adapter": [], "decode_base": []}
        res["adapter"] = lora_route
        try:
            with server:
                lora_route["start_s"] = server.start_seconds
                print(f"adapter route: vLLM (--enable-lora) ready in {server.start_seconds} s", flush=True)
                for ver in versions:
                    name = f"policy-{ver['version']}"
                    t0 = time.perf_counter()
                    status, raw = post(f"{server.base_url}/v1/load_lora_adapter",
                                       {"lora_name": name, "lora_path": ver["adapter_dir"]})
                    t = time.perf_counter() - t0
                    if status != 200:
                        raise RuntimeError(f"load_lora_adapter: HTTP {status} {raw[:500]}")
                    t0 = time.perf_counter()
                    served = served_logprobs(server.base_url, name, probe)  # the first request also activates it
                    first = time.perf_counter() - t0
                    lora_route["loads"].append({"version": ver["version"], "load_s": t, "first_request_s": first})
                    lora_route["gap"].append(gap(served, ver["trainer_lp"]))
                    print(f"  {name}: load_lora_adapter {t:.2f} s, first probe request {first:.2f} s, gap max "
                          f"{lora_route['gap'][-1]['max']:.2e}", flush=True)
                    res["adapter"] = lora_route
                    save(res)
                last = f"policy-{versions[-1]['version']}"
                decode_rate(server.base_url, last, 8)
                decode_rate(server.base_url, "bench", 8)
                for _ in range(args.reps):  # interleaved: the adapter and the base on the same server
                    lora_route["decode_adapter"].append(decode_rate(server.base_url, last, args.tokens))
                    lora_route["decode_base"].append(decode_rate(server.base_url, "bench", args.tokens))
                    save(res)
                print(f"  decode with the adapter {statistics.median(d['decode_tok_s'] for d in lora_route['decode_adapter']):.2f}"
                      f" tok/s, base on the same server "
                      f"{statistics.median(d['decode_tok_s'] for d in lora_route['decode_base']):.2f} tok/s", flush=True)
        except Exception as exc:  # noqa: BLE001 - a refusal is the result: keep it with the log's tail
            lora_route["error"] = f"{type(exc).__name__}: {exc}"
            lora_route["log_tail"] = server.log_tail(30) if hasattr(server, "log_tail") else ""
            print(f"adapter route failed: {lora_route['error']}", flush=True)
        res["adapter"] = lora_route
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save(res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("versions",)}, indent=1)[:4000])
    print(f"results in {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
