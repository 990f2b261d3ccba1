"""Record a small real run's saved flows, as ``tests/fixtures/demo-run/captures/flows.mitm`` holds.

A real vLLM (the 0.5B by default), the real proxy in reverse mode saving its flows
(``save_stream_file``, as ``polar demo`` does) and the real Pi harness (``pi-chat``) on one built-in
task, a few samples, plain sampling at temperature 1 seeded per call, answers capped, exact history
on (the demo's proxy options). Writes
``OUT/captures/{flows.mitm,sessions/,rollouts.parquet}``; copy what the fixture needs from there.

    .venv/bin/python scripts/record_flows_fixture.py --out /tmp/flows-run
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--harness", default="pi-chat")
    ap.add_argument("--task", default="hello-file")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="vLLM's OpenMP threads (default: every usable core)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-exact-history", dest="exact_history", action="store_false",
                    help="polar_exact_history off (on by default, as in polar rollout and polar demo)")
    args = ap.parse_args()

    from polar_proxy.process import ProxyProcess
    from polar_runtime import harnesses as h
    from polar_runtime import rollout as r
    from polar_runtime.serve import VLLMServer

    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    captures = out / "captures"
    (out / "logs").mkdir(parents=True)
    tasks = [t for t in r.load_tasks("coding") if t.id == args.task]
    assert tasks, f"no built-in task {args.task}"
    preset = h.get_preset(args.harness)
    t0 = time.time()
    with VLLMServer(args.model, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                    threads=args.threads, log_path=out / "logs" / "vllm.log") as server:
        print(f"vLLM {server.served_model_name} ready in {server.start_seconds} s at {server.base_url}", flush=True)
        options = {"polar_max_tokens_cap": args.max_tokens, "save_stream_file": str(captures / "flows.mitm"),
                   "polar_sampling": r.sampling_spec(1.0, args.seed), "polar_exact_history": args.exact_history}
        with ProxyProcess(server.base_url, captures, mode="reverse", served_model=server.served_model_name,
                          options=options, log_file=out / "logs" / "proxy.log", startup_timeout=180.0) as proxy:
            proxy.control.set_policy_version(0)
            endpoint = h.Endpoint(mode="base_url", base_url=proxy.url, proxy_url=proxy.url, ca_cert=proxy.ca_cert)
            cfg = r.RolloutConfig(tasks=tasks, preset=preset, endpoint=endpoint, capture_dir=captures,
                                  model=server.served_model_name, samples=args.samples,
                                  concurrency=args.samples, timeout=args.timeout, step=0)
            df = r.run_rollout(cfg, control=proxy.control,
                               on_result=lambda row: print(f"  {row['session_id']}: {row['status']} "
                                                           f"reward={row['reward']} calls={row['calls']}", flush=True))
    print(df.select("session_id", "status", "reward", "calls", "wall_s"))
    print(f"done in {time.time() - t0:.0f} s: {captures}")


if __name__ == "__main__":
    main()
