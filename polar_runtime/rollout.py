"""`polar rollout`: run a harness on every task N times through the proxy, verify, record rewards.

Each sample gets its own session id (``<task>.st<step>.s<sample>``), work dir and HOME; the proxy
captures its calls under that id (the task/group ids are registered through the proxy's control
API before the harness starts). Every phase of a sample runs in a sandbox (polar_trial/sandbox,
``auto``: bubblewrap where it is installed):

1. build: the task's environment (its Dockerfile, or the JSONL shorthand's files and setup) is built
   once per task into ``<work>/.builds`` (RUN steps inside the sandbox) and copied to the sample's
   work dir, which the agent sees at the Dockerfile's WORKDIR (``/app`` by default);
2. agent: the harness runs in the sandbox with that work dir, its isolated HOME, the harness install
   read-only, no network but the model proxy (relayed into the sandbox on the same loopback port,
   so base-URL and HTTPS_PROXY modes work unchanged), whatever task.toml says of ``allow_internet``;
   after the harness ends -- or is killed for the timeout, in which case its partial trace is kept
   and the sample is marked ``timeout`` -- every process it left is gone;
3. verifier (polar_trial/verifier.py): the hidden tests, copied only now to ``/tests``, run in a
   sandbox of their own; the float test.sh writes to /logs/verifier/reward.txt is the reward (null
   with ``evaluator_status`` error/timeout when it could not give one: recorded, never fatal).

Results are written per sample as ``<capture_dir>/rollouts/<key>.json`` the moment a sample
finishes (atomic rename), and gathered into ``<capture_dir>/rollouts.parquet`` after every sample.
A re-run skips every sample that already has a result (resume). Several machines may write into one
shared capture directory, each running its own proxy and ``--shard I/N`` of the task list: per-sample
files never collide, and every machine rebuilds the Parquet from all of them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import polars as pl

from polar_core import cancel, paths
from polar_core.schema import SESSIONS_SUBDIR, read_capture_lines, valid_session_id
from polar_runtime.harnesses import Endpoint, Preset, Session, run_invocation, terminate_all
from polar_runtime.harnessruntime import bring_runtime
from polar_trial import (TASKS_DIR, BuildError, Evaluation, Task, begin_step, build_env, builtin_sets,  # noqa: F401
                         finish_steps, load_tasks, open_live_trial, phase_spec, prepare_workdir, resolve_tasks_path,
                         run_step_setup, seal_sample_dir, separate_verifier, task_from_dict, task_image, verify,
                         verify_step)

ROLLOUTS_SUBDIR = "rollouts"
ROLLOUTS_FILE = "rollouts.parquet"

STATUSES = ("ok", "failed", "timeout")
#: After an interruption, how long run_rollout waits for its workers to return once their processes
#: are killed (they return within about a second: kill_group's grace); past it, it re-raises anyway.
STOP_WAIT_S = 30.0

#: rollouts.parquet columns (the first twelve are the contract; the rest are for debugging).
ROLLOUT_SCHEMA: dict[str, pl.DataType] = {
    "task_id": pl.String,
    "sample_index": pl.Int64,
    "session_id": pl.String,
    "group_id": pl.String,
    "step": pl.Int64,
    "status": pl.String,  # ok | failed | timeout
    "reward": pl.Float64,  # null when the evaluator could not give a verdict
    "calls": pl.Int64,  # calls answered (status ok) in this session's captures
    "prompt_tokens": pl.Int64,  # sum over the session's calls of len(prompt_token_ids)
    "sampled_tokens": pl.Int64,  # sum over the session's calls of len(sampled_token_ids)
    "wall_s": pl.Float64,  # harness wall time
    "evaluator_output": pl.String,
    "evaluator_status": pl.String,  # pass | fail | error | timeout | none
    "eval_s": pl.Float64,
    "exit_code": pl.Int64,
    "harness": pl.String,
    "mode": pl.String,
    "model": pl.String,
    "attempt": pl.Int64,
    "error": pl.String,
    "started_at": pl.Float64,
    "workdir": pl.String,
    "error_calls": pl.Int64,  # calls the proxy recorded as errors (upstream down, harness hung up, ...)
    "turns": pl.Int64,  # harness runs of the sample: 1 + the task's follow-ups it reached
    "sandbox": pl.String,  # the sandbox backend every phase of the sample ran in
    "sandbox_notes": pl.String,  # what the sandbox enforced or contained (one sentence per line)
    "verifier_dir": pl.String,  # /logs/verifier of the sample: reward file, test-output.txt
    "step_rewards": pl.String,  # a multi-step task's steps, JSON: [{name, reward, status, agent_status}]
}


# ---------------------------------------------------------------------------------------------
# tasks (polar_trial/tasks: Harbor directories and the JSONL shorthand, one Task object)


def builtin_tasks() -> list[Path]:
    return builtin_sets()


def parse_shard(spec: str | None) -> tuple[int, int]:
    """``"I/N"`` (0-based I) -> (I, N); None -> (0, 1)."""
    if not spec:
        return 0, 1
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m or int(m[2]) < 1 or int(m[1]) >= int(m[2]):
        raise ValueError(f"--shard must be I/N with 0 <= I < N, not {spec!r}")
    return int(m[1]), int(m[2])


def shard_tasks(tasks: list[Task], index: int, count: int) -> list[Task]:
    """Tasks of shard ``index`` of ``count``: chosen by a hash of the task id, so the split does not
    depend on file order and every machine computes the same partition on its own."""
    def bucket(t: Task) -> int:
        return int.from_bytes(hashlib.sha1(t.id.encode()).digest()[:8], "big") % count
    return [t for t in tasks if bucket(t) == index]


# ---------------------------------------------------------------------------------------------
# ids


def _safe(text: str, limit: int = 80) -> str:
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "task"
    s = re.sub(r"\.\.+", ".", s)
    if not s[0].isalnum():
        s = "t" + s
    if len(s) > limit or s != text:  # keep ids distinct when sanitizing merged two task ids
        digest = hashlib.sha1(text.encode()).hexdigest()[:8]
        s = f"{s[: limit - 9]}-{digest}"
    return s


def group_id_for(task_id: str, step: int) -> str:
    return f"{_safe(task_id)}.st{step}"


def sample_key(task_id: str, step: int, sample: int) -> str:
    return f"{group_id_for(task_id, step)}.s{sample}"


def session_id_for(task_id: str, step: int, sample: int, attempt: int = 0) -> str:
    """Deterministic, so a re-run finds its results; ``.r<attempt>`` only when an earlier attempt
    of the same sample left captures but no result (a crash), so attempts never share a session."""
    sid = sample_key(task_id, step, sample) + (f".r{attempt}" if attempt else "")
    assert valid_session_id(sid), sid
    return sid


# ---------------------------------------------------------------------------------------------
# capture statistics


def session_capture_files(capture_dir: Path, session_id: str) -> list[Path]:
    return [p for p in [capture_dir / SESSIONS_SUBDIR / f"{session_id}.jsonl"] if p.exists()]


def capture_stats(capture_dir: Path, session_id: str) -> tuple[int, int, int, int]:
    """(ok calls, error calls, prompt tokens, sampled tokens) of one session, from its capture file.

    Torn or foreign lines are skipped (the loader's rule); counts are of ids as captured."""
    calls = errors = prompt = sampled = 0
    for path in session_capture_files(capture_dir, session_id):
        for rec in read_capture_lines(path):
            if rec.get("record_type", "call") != "call" or rec.get("session_id") != session_id:
                continue
            if rec.get("status", "ok") != "ok":
                errors += 1
                continue
            calls += 1
            prompt += len(rec.get("prompt_token_ids") or ())
            sampled += len(rec.get("sampled_token_ids") or ())
    return calls, errors, prompt, sampled


# ---------------------------------------------------------------------------------------------
# results


class ResultStore:
    """Per-sample result files plus the gathered Parquet, safe for many writers."""

    def __init__(self, capture_dir: Path):
        self.capture_dir = capture_dir
        self.dir = capture_dir / ROLLOUTS_SUBDIR
        self.parquet = capture_dir / ROLLOUTS_FILE
        self._lock = threading.Lock()
        self._last_write = float("-inf")

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def done(self, key: str) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self.path(key).read_text())
        return None

    def put(self, key: str, row: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(row))
        os.replace(tmp, self.path(key))

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                out.append(json.loads(p.read_text()))
        return out

    def frame(self) -> pl.DataFrame:
        rows = [{k: r.get(k) for k in ROLLOUT_SCHEMA} for r in self.rows()]
        return pl.DataFrame(rows, schema=ROLLOUT_SCHEMA).sort("step", "task_id", "sample_index")

    def write_parquet(self, *, min_interval: float = 0.0) -> pl.DataFrame | None:
        """Gather every result file into rollouts.parquet (atomic replace). With ``min_interval``,
        skip (return None) when the last write was more recent: big runs do not rewrite per sample."""
        with self._lock:
            now = time.monotonic()
            if min_interval and now - self._last_write < min_interval:
                return None
            self._last_write = now
            df = self.frame()
            # a temp file per thread: stores of concurrent groups (the asynchronous loop makes one per
            # group) gather at once; a per-process name made one's rename fail on the other's file
            tmp = self.capture_dir / f".{ROLLOUTS_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
            df.write_parquet(tmp)
            os.replace(tmp, self.parquet)
            return df


# ---------------------------------------------------------------------------------------------
# the proxy (and the model server behind it)


class SessionRegistry:
    """Tells the proxy which task/group/sample a session id belongs to, before the harness starts,
    so every capture record carries them. A no-op without a control client (the ids are still in
    rollouts.parquet and join on session_id)."""

    def __init__(self, control: Any | None = None):
        self.control = control  # polar_proxy.process.ProxyControl or None

    def settle(self, capture_dir: Path, session_id: str, timeout: float) -> bool:
        """Wait (bounded) until every call the proxy started for the session is in its capture file:
        a call still in flight when the harness ended is written once the proxy notices the hang-up.
        False when some are still missing at the deadline (an upstream that does not answer)."""
        if self.control is None:
            return True
        deadline = time.monotonic() + timeout
        while True:
            try:
                started = (self.control.sessions().get("sessions") or {}).get(session_id, {}).get("calls", 0)
            except Exception:  # noqa: BLE001 - the proxy is gone: nothing more will be written
                return True
            ok, errors, _, _ = capture_stats(capture_dir, session_id)
            if ok + errors >= started:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def register(self, session_id: str, task_id: str, group_id: str, sample_index: int,
                 harness: str | None = None) -> str | None:
        """Register the session; returns the key the proxy issued for it (the harness's API key:
        the proxy binds the session's calls to it), None without a control client."""
        if self.control is None:
            return None
        item = {"session_id": session_id, "task_id": task_id, "group_id": group_id, "sample_index": sample_index}
        if harness:
            item["harness"] = harness
        answer = self.control.register_sessions([item])
        if answer.get("http_status", 200) >= 400:
            raise RuntimeError(f"proxy refused session {session_id}: {answer}")
        key = (answer.get("keys") or {}).get(session_id)
        if not key:
            raise RuntimeError(f"the proxy issued no key for session {session_id} (an older proxy?): {answer}")
        return key


@dataclass
class Stack:
    """What a rollout talks to: the proxy's endpoint, its capture dir and control client."""

    endpoint: Endpoint
    capture_dir: Path
    served_model: str
    upstream: str
    control: Any | None = None


def served_model_of(upstream: str, timeout: float = 10.0) -> str:
    """The first model an OpenAI-compatible server lists (``GET /v1/models``)."""
    from polar_core.net import http_json

    data = http_json(upstream.rstrip("/").removesuffix("/v1") + "/v1/models", timeout=timeout)
    return data["data"][0]["id"]


def sampling_spec(temperature: float = 1.0, seed: int | None = None) -> str:
    """The ``polar_sampling`` a rollout enforces: plain sampling at ``temperature`` (no top-p/top-k/
    min-p, no penalties), which is the distribution the trainer's logprobs are computed from, and,
    with ``seed``, a per-call seed derived from it (reruns sample the same tokens)."""
    spec = (f"temperature={temperature:g},top_p=1,top_k=-1,min_p=0,repetition_penalty=1,"
            "presence_penalty=0,frequency_penalty=0")
    return spec + (f",seed={seed}" if seed is not None else "")


def failure_summary(rows: list[dict[str, Any]], harness: str) -> str | None:
    """None when the step produced something to learn from; else one paragraph saying why not:
    every sample failed/timed out, or no model call reached the captures. Names the harness, the
    first sample's error line and the path of its stderr log (where the harness said why)."""
    if not rows:
        return f"{harness}: no samples ran"
    calls = sum(r.get("calls") or 0 for r in rows)
    all_failed = all(r.get("status") in ("failed", "timeout") for r in rows)
    if calls and not all_failed:
        return None
    first = min(rows, key=lambda r: (r.get("task_id") or "", r.get("sample_index") or 0))
    err = (first.get("error") or "").strip()
    line = next((ln.strip() for ln in err.splitlines() if ln.strip()), "") or f"exit code {first.get('exit_code')}"
    stderr = Path(first["workdir"]).parent / "logs" / f"{first.get('harness') or harness}.stderr" if first.get("workdir") else None
    what = (f"all {len(rows)} samples failed or timed out" if all_failed else "") + \
        (" and " if all_failed and not calls else "") + ("no model call was captured" if not calls else "")
    return (f"{harness}: {what}. First sample {first.get('session_id')}: {line}"
            + (f"\n  stderr log: {stderr}" if stderr else ""))


@contextlib.contextmanager
def open_stack(
    *,
    mode: str,
    capture_dir: Path | None = None,
    proxy: str | None = None,
    upstream: str | None = None,
    model: str | None = None,
    ca_cert: Path | None = None,
    max_tokens_cap: int = 0,
    max_model_len: int | None = None,
    sampling: str | None = None,
    exact_history: bool = True,
    log: Callable[[str], None] = print,
) -> Iterator[Stack]:
    """Use a running proxy (``proxy``), or start one in front of ``upstream``, or start vLLM too.

    A proxy we start listens in reverse mode for ``base_url`` runs and in regular mode (TLS
    interception of the hosted API hostnames) for ``proxy`` runs. Everything started is stopped on
    exit, also on errors and Ctrl-C.
    """
    from polar_core.control import ProxyControl, find_token
    from polar_proxy.process import ProxyProcess

    with contextlib.ExitStack() as stack:
        if proxy:
            # its control secret: in the proxy's confdir, where its CA is (or $POLAR_CONTROL_TOKEN)
            control = ProxyControl(proxy, token=find_token(proxy, [ca_cert.parent] if ca_cert else []))
            status = control.status()
            proxy_dir = Path(status.get("capture_dir") or "")
            if capture_dir is not None and proxy_dir.resolve() != Path(capture_dir).resolve():
                raise ValueError(f"the proxy at {proxy} writes to {proxy_dir}, not {capture_dir}")
            first = (status.get("upstreams") or [{}])[0]
            up_url = first.get("url", "")
            served = model or first.get("served_model") or (served_model_of(up_url) if up_url else "")
            ca = paths.absolute(ca_cert) if ca_cert else paths.mitmproxy_confdir() / "mitmproxy-ca-cert.pem"
            ep = Endpoint(mode=mode, base_url=proxy, proxy_url=proxy, ca_cert=ca)  # type: ignore[arg-type]
            yield Stack(ep, proxy_dir, served, up_url, control)
            return
        if capture_dir is None:
            raise ValueError("a capture directory is needed when the proxy is started here")
        capture_dir = paths.absolute(capture_dir)
        if upstream:
            served = served_model_of(upstream)
        else:
            from polar_runtime.serve import VLLMServer

            server = VLLMServer(model or "qwen2.5-coder-0.5b-instruct", max_model_len=max_model_len)
            log(f"starting vLLM ({server.served_model_name}) on {server.base_url} ...")
            stack.enter_context(server)
            upstream, served = server.base_url, server.served_model_name
            log(f"vLLM ready in {server.start_seconds or 0:.0f} s")
        options: dict[str, Any] = {"polar_max_tokens_cap": max_tokens_cap} if max_tokens_cap else {}
        if sampling:
            options["polar_sampling"] = sampling
        if exact_history:  # an upstream without the endpoints gets the normal path (records say so)
            options["polar_exact_history"] = True
        # model calls and nothing else: no passthrough, every call bound to its session's issued key
        options["polar_require_session_key"] = True
        px = ProxyProcess(upstream, capture_dir, mode="reverse" if mode == "base_url" else "regular",
                          served_model=served, options=options, log_file=capture_dir / "logs" / "proxy.log",
                          passthrough=False)
        (capture_dir / "logs").mkdir(parents=True, exist_ok=True)
        stack.enter_context(px)
        log(f"proxy ({px.mode} mode) on {px.url} -> {upstream}")
        ep = Endpoint(mode=mode, base_url=px.url, proxy_url=px.url, ca_cert=px.ca_cert)  # type: ignore[arg-type]
        yield Stack(ep, capture_dir, served, upstream, px.control)


# ---------------------------------------------------------------------------------------------
# the runner


@dataclass
class RolloutConfig:
    tasks: list[Task]
    preset: Preset
    endpoint: Endpoint
    capture_dir: Path
    model: str
    samples: int = 4
    concurrency: int = 1
    timeout: float = 600.0
    eval_timeout: float = 120.0
    step: int = 0
    work_root: Path | None = None  # default <capture_dir>/work
    trim: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)
    settle_s: float = 5.0  # how long to wait for in-flight calls to reach the captures after a run
    rerun: frozenset[str] = frozenset()  # statuses whose samples run again (e.g. {"failed"} after an outage)
    #: the sandbox backend of every phase (polar_trial.sandbox.get_sandbox): auto, bubblewrap,
    #: docker, or host (no isolation at all: tests with a fake harness that writes outside)
    sandbox: str = "auto"
    pids: int | None = 4096  # the most processes alive at once in one sample's sandbox
    #: container backends run each sample as one live environment (``polar_trial/sandbox/trial.py``); False
    #: denies the agent phase the package manager's capabilities and the registries there
    agent_privileged: bool = True
    #: the verifier in a fresh environment of its own for every task, as ``[verifier]
    #: environment_mode = "separate"`` asks (``polar_trial/sandbox/trial.py: separate_verifier``)
    separate_verifier: bool = False
    #: a task's ``allow_internet = true`` opens its agent phase to public hosts through the egress
    #: proxy (``polar_trial/sandbox/egress.py``: public addresses only) only when the run sets this; off, the
    #: agent reaches the model (and, in a live trial, the registries) and nothing else
    allow_internet: bool = False
    #: the lowest attempt number of a session id (``.r<n>``): a sample re-run on another machine after
    #: its first one was lost (polar_runtime/cluster) gets a session id of its own there too
    first_attempt: int = 0

    def __post_init__(self) -> None:
        self.capture_dir = paths.absolute(self.capture_dir)
        self.work_root = paths.absolute(self.work_root) if self.work_root is not None else None
        self._sandbox: Any = None

    def get_sandbox(self) -> Any:
        """The sandbox backend, resolved once (SandboxUnavailable says why it cannot run here)."""
        if self._sandbox is None:
            from polar_trial import get_sandbox

            self._sandbox = get_sandbox(self.sandbox)
        return self._sandbox

    @property
    def work(self) -> Path:
        return self.work_root or self.capture_dir / "work"


@dataclass
class Job:
    task: Task
    sample: int


def plan(cfg: RolloutConfig, store: ResultStore) -> tuple[list[Job], list[dict[str, Any]]]:
    """(samples still to run, rows of samples already finished). Task-major order, so each task's
    samples run back to back and the server's prefix cache holds their shared prompt. A sample
    re-run with ``rerun`` gets a fresh session (``.r<n>``) when its earlier attempt left captures;
    its result replaces the earlier one."""
    todo, done = [], []
    for task in cfg.tasks:
        for i in range(cfg.samples):
            row = store.done(sample_key(task.id, cfg.step, i))
            if row is not None and row.get("status") in STATUSES and row["status"] not in cfg.rerun:
                done.append(row)
            else:
                todo.append(Job(task, i))
    return todo, done


def rerun_if_nothing_to_learn(cfg: RolloutConfig, store: ResultStore) -> frozenset[str]:
    """``cfg.rerun`` widened to failed and timed-out samples when the step's stored results are
    what ``failure_summary`` refuses (every one failed or timed out, no model call captured: a vLLM
    that died, a harness that could not start). Reused, they failed the resumed loop again in 0.3 s
    and only ``--fresh`` got past them (the walk of docs/getting-started.md)."""
    stored = [row for task in cfg.tasks for i in range(cfg.samples)
              if (row := store.done(sample_key(task.id, cfg.step, i))) is not None]
    if stored and failure_summary(stored, cfg.preset.name):
        return cfg.rerun | {"failed", "timeout"}
    return cfg.rerun


def next_attempt(cfg: RolloutConfig, task_id: str, sample: int) -> int:
    attempt = cfg.first_attempt
    while session_capture_files(cfg.capture_dir, session_id_for(task_id, cfg.step, sample, attempt)):
        attempt += 1
    return attempt


def _loopback_port(url: str) -> int | None:
    """The port of a proxy URL on this machine's loopback (what the sandbox relays inside)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname in ("127.0.0.1", "localhost", "::1") and parts.port:
        return parts.port
    return None


def agent_spec(cfg: RolloutConfig, task: Task, workdir_host: Path, home: Path, timeout: float,
               image: str | None = None) -> Any:
    """The sandbox of the agent phase (also the oracle's and nop's: exactly the same; ``phase_spec``),
    with what this harness needs: its install, the proxy's CA, the model's port relayed inside."""
    ro: list[tuple[Path, str]] = []
    ep = cfg.endpoint
    needs_model = getattr(cfg.preset, "needs_model", True)
    if cfg.preset.package:
        ro.append((paths.harnesses_dir(), ""))
    if needs_model and ep.mode == "proxy" and ep.ca_cert:
        ro.append((ep.ca_cert, ""))
    port = _loopback_port(ep.proxy_url if ep.mode == "proxy" else ep.base_url) if needs_model else None
    # The agent reaches only the model, and public hosts through the egress proxy where the task
    # allows the internet and the run does too (a harness in proxy mode keeps its HTTPS_PROXY: the
    # model proxy's); the host's network only when the model proxy is on another machine and
    # there is no loopback port to relay
    network = needs_model and port is None
    internet = bool(task.allow_internet and getattr(cfg, "allow_internet", False)) and not network \
        and not (needs_model and ep.mode == "proxy")
    return phase_spec(task, workdir_host, home, timeout, pids=cfg.pids, image=image, ro_binds=ro, network=network,
                      proxy_port=port, internet=internet)


def _map_binds(inv: Any, spec: Any, sandbox: Any) -> None:
    """Add a preset's extra binds to the spec and point its argv at where they are seen inside
    (the same path in a real sandbox; the host path with the ``host`` backend)."""
    for host, dest in inv.binds:
        spec.ro_binds.append((host, dest))
        seen = sandbox.inside(spec, host)
        inv.argv = [seen + a[len(dest):] if a == dest or a.startswith(dest + "/") else a for a in inv.argv]


def run_sample(cfg: RolloutConfig, job: Job, registry: SessionRegistry) -> dict[str, Any]:
    """One sample, end to end (build, agent, verifier); never raises for harness, build or
    verifier failures. What stays in the run dir keeps no link out of the sample's dir."""
    with contextlib.ExitStack() as stack:  # a live trial's environment is removed at the end
        row = _run_sample_phases(cfg, job, registry, stack)
    note = seal_sample_dir(cfg.work / row["session_id"])
    if note:
        row["sandbox_notes"] = "\n".join(n for n in (row.get("sandbox_notes"), note) if n)
    return row


def _run_sample_phases(cfg: RolloutConfig, job: Job, registry: SessionRegistry,
                       stack: contextlib.ExitStack | None = None) -> dict[str, Any]:
    task, i = job.task, job.sample
    attempt = next_attempt(cfg, task.id, i)
    sid = session_id_for(task.id, cfg.step, i, attempt)
    gid = group_id_for(task.id, cfg.step)
    sample_dir = cfg.work / sid
    workdir = sample_dir / "work"
    home = sample_dir / "home"
    logs = sample_dir / "logs"
    row: dict[str, Any] = dict(
        task_id=task.id, sample_index=i, session_id=sid, group_id=gid, step=cfg.step,
        status="failed", reward=None, calls=0, error_calls=0, prompt_tokens=0, sampled_tokens=0, wall_s=0.0,
        evaluator_output="", evaluator_status="none", eval_s=0.0, exit_code=None,
        harness=cfg.preset.name, mode=cfg.endpoint.mode, model=cfg.model, attempt=attempt,
        error=None, started_at=time.time(), workdir=str(workdir), turns=0, sandbox=cfg.sandbox,
        sandbox_notes="", verifier_dir=None,
    )
    notes: list[str] = []
    try:
        sandbox = cfg.get_sandbox()
        row["sandbox"] = sandbox.name
        notes += prepare_workdir(task, workdir, sandbox, cfg.work / ".builds")
        # a container backend runs every phase in the task's built image (``polar_trial/tasks/imagebuild.py``)
        image = task_image(task, sandbox)
        trial = live_trial(cfg, task, sandbox, image, workdir, stack)
    except Exception as exc:  # noqa: BLE001 - no sandbox, a build that fails: this sample failed, visibly
        row["error"] = f"environment: {exc}"
        row["sandbox_notes"] = "\n".join(notes)
        return row
    home.mkdir(parents=True, exist_ok=True)
    solution = None
    if cfg.preset.name == "oracle" and (task.has_solution or task.steps):
        solution = sample_dir / "solution"
        if task.steps:  # each step's is put there before it (steprun.begin_step)
            solution.mkdir(parents=True, exist_ok=True)
        else:
            task.write_solution(solution)
    try:
        key = registry.register(sid, task.id, gid, i, harness=cfg.preset.name)
    except Exception as exc:  # noqa: BLE001 - an unreachable proxy fails this sample, visibly
        row["error"] = f"session registration failed: {exc}"
        return row
    cancel.note_session(sid)  # a cancelled group closes its sessions at the proxy
    limit = task.timeout or cfg.timeout
    wall = 0.0
    # follow-ups are user turns for a model; the oracle and nop act once
    turns = [task.instruction, *(task.followups if getattr(cfg.preset, "needs_model", True) else [])]
    steps: list[Any] = []  # a multi-step task (polar_trial/steprun.py): its steps are its turns
    if task.steps:
        turns = [st.instruction for st in task.steps]
    task_env = {k: v for k, v in build_env(task).items() if k != "PATH" or "PATH" in task.environment.env}  # type: ignore[union-attr]
    extra_env = {**task_env, **cfg.extra_env, **(task.solution_env if solution else {})}
    if getattr(sandbox, "isolates", True):  # the caller's TMPDIR is not visible inside: the private /tmp is
        extra_env.setdefault("TMPDIR", "/tmp")
    result = None
    for turn, text in enumerate(turns):
        # a follow-up continues the harness's own conversation (same session, work dir and HOME)
        name = cfg.preset.name if turn == 0 else f"{cfg.preset.name}.turn{turn}"
        try:
            # a spec the sandbox refuses (a task's WORKDIR at /run/...) fails this sample, not the rollout
            step = task.steps[turn] if task.steps else None
            if step is not None:  # each step its own agent timeout, as Harbor's
                notes += begin_step(task, step, workdir, solution)
                limit = wall + (step.agent_timeout or task.timeout or cfg.timeout)
            spec = agent_spec(cfg, task, workdir, home, max(1.0, limit - wall), image)
            session = Session(session_id=sid, task=text, workdir=Path(sandbox.inside(spec, workdir)), home=home,
                              model=cfg.model, endpoint=cfg.endpoint, trim=cfg.trim, extra_env=dict(extra_env),
                              resume=turn > 0, host_workdir=workdir, solution_dir=solution, key=key)
            inv = cfg.preset.prepare(session)
            _map_binds(inv, spec, sandbox)
            brought = bring_runtime(inv, spec, sandbox)  # a container: the harness's own node/loader
            if brought:
                notes.append(brought)
            box = trial.view("agent", passwd_home=not getattr(cfg.preset, "needs_model", True)) if trial else sandbox
            failed_setup = run_step_setup(step, box, spec, workdir, logs) if step is not None else None
            if failed_setup:
                raise RuntimeError(failed_setup)
            result = run_invocation(inv, max(1.0, limit - wall), logs, name, sandbox=box, spec=spec)
        except Exception as exc:  # noqa: BLE001 - a preset that cannot start is a failed sample, not a crash
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["wall_s"] = round(wall, 3)
            row["sandbox_notes"] = "\n".join(notes)
            return row
        notes += result.notes
        wall += result.wall_s
        row["turns"] = turn + 1
        row["wall_s"] = round(wall, 3)
        row["exit_code"] = result.returncode
        at = f" (turn {turn + 1} of {len(turns)})" if len(turns) > 1 else ""
        if result.timed_out:
            row["status"] = "timeout"
            row["error"] = f"killed after {limit:.0f} s{at}"
        elif result.returncode == 0:
            row["status"] = "ok"
        else:
            row["status"] = "failed"
            row["error"] = (result.tail(600).strip()[-600:] or f"exit code {result.returncode}") + at
        if step is not None:  # the step's tests, in the same environment; min_reward may stop the rest
            vbox = trial.view("verifier", passwd_home=True) if trial else sandbox
            res, step_notes = verify_step(
                task, step, row["status"], sandbox=vbox, sample_dir=sample_dir, workdir=workdir, logs=logs,
                image=image, timeout=cfg.eval_timeout, facts={"session": sid, "task_id": task.id,
                                                              "status": row["status"]})
            steps.append(res)
            notes += step_notes
            if res.stopped:
                break
            continue
        if row["status"] != "ok":
            break
    if cancel.is_cancelled():  # its group was dropped (the asynchronous loop): no verifier, no result
        row.update(status="failed", error="cancelled: its group was dropped", sandbox_notes="\n".join(notes))
        return row
    if not registry.settle(cfg.capture_dir, sid, cfg.settle_s):
        note = "a call still in flight at the end is not in the captures (the upstream has not answered)"
        row["error"] = f"{row['error']}; {note}" if row["error"] else note
    assert result is not None
    if task.steps:  # the trial's reward, from its steps' (Harbor's multi_step_reward_strategy)
        finish_steps(row, task, steps, sample_dir)
        row["sandbox_notes"] = "\n".join(dict.fromkeys(notes))
        row["calls"], row["error_calls"], row["prompt_tokens"], row["sampled_tokens"] = capture_stats(cfg.capture_dir, sid)
        return row
    vbox, vwork = (trial.view("verifier", passwd_home=True) if trial else sandbox), workdir  # the trial's environment
    if trial and (task.verifier_separate or cfg.separate_verifier):
        vwork = sample_dir / "verifier-work"
        vt = separate_verifier(sandbox, trial.cfg, workdir, lambda d: prepare_workdir(task, d, sandbox, cfg.work / ".builds"),
                               task.artifacts, vwork, trial)
        stack.callback(vt.stop)
        vbox = vt.view("verifier", passwd_home=True)
        notes.append("verifier: an environment of its own from the task's image, "
                     + (f"with the artifacts {task.artifacts}" if task.artifacts else "with the sample's work dir"))
    ev = verify(task, sandbox=vbox, sample_dir=sample_dir, workdir_host=vwork, agent_logs=logs, image=image,
                timeout=task.verifier_timeout or cfg.eval_timeout, facts={
                    "session": sid, "task_id": task.id, "status": row["status"],
                    "harness_stdout": str(result.stdout_path), "harness_stderr": str(result.stderr_path)})
    notes += [f"verifier: {n}" for n in ev.notes]
    row.update(reward=ev.reward, evaluator_status=ev.status, evaluator_output=ev.output, eval_s=round(ev.seconds, 3),
               verifier_dir=str(sample_dir / "verifier"), sandbox_notes="\n".join(dict.fromkeys(notes)))
    row["calls"], row["error_calls"], row["prompt_tokens"], row["sampled_tokens"] = capture_stats(cfg.capture_dir, sid)
    return row


def live_trial(cfg: RolloutConfig, task: Task, sandbox: Any, image: str | None, workdir: Path,
               stack: contextlib.ExitStack | None) -> Any:
    """The sample's live environment on a container backend (``polar_trial.open_live_trial``), with
    this run's limits and permissions; None where phases run in sandboxes of their own."""
    return open_live_trial(task, sandbox, image, workdir, stack, pids=cfg.pids, builds=cfg.work / ".builds",
                           agent_privileged=cfg.agent_privileged, allow_internet=cfg.allow_internet)


def run_rollout(
    cfg: RolloutConfig,
    *,
    control: Any | None = None,
    on_start: Callable[[int, int], None] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> pl.DataFrame:
    """Run every sample not finished yet; return the whole rollouts frame (old and new rows)."""
    if cfg.samples < 1 or cfg.concurrency < 1:
        raise ValueError("samples and concurrency must be >= 1")
    cfg.capture_dir.mkdir(parents=True, exist_ok=True)
    store = ResultStore(cfg.capture_dir)
    todo, done = plan(cfg, store)
    if on_start:
        on_start(len(todo), len(done))
    registry = SessionRegistry(control)
    stop = threading.Event()
    # Every process a sample starts is tracked in this scope, so an interruption kills what runs
    # *and* what a worker starts afterwards: a snapshot of the running harnesses alone missed a
    # sample still preparing its sandbox, which then ran its harness to --timeout (600 s) while the
    # main thread waited for it; SIGTERM hung in 3 of 6 tries sent as the first harness started.
    scope = cancel.CancelScope("rollout")

    def one(job: Job) -> dict[str, Any] | None:
        if stop.is_set():
            return None
        with cancel.bound(scope):
            row = run_sample(cfg, job, registry)
        if stop.is_set():  # killed by an interruption: not a result, so a re-run runs it again
            return None
        store.put(sample_key(job.task.id, cfg.step, job.sample), row)
        store.write_parquet(min_interval=10.0)
        return row

    pool = cf.ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="rollout")
    futures: list[cf.Future] = []
    try:
        for j in todo:
            futures.append(pool.submit(one, j))
        pending = set(futures)
        while pending:
            # Short waits: SIGINT may land on a worker or library thread, and Python only runs the
            # handler when the main thread wakes up.
            finished, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                row = fut.result()
                if row is not None and on_result:
                    on_result(row)
    except BaseException:  # Ctrl-C (or a bug): stop the harnesses now, keep what finished
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        scope.cancel(grace=1.0)  # kills what runs; whatever a worker starts from now on dies at once
        terminate_all()
        from polar_trial import terminate_sandboxed

        terminate_sandboxed()
        # A bounded wait: a worker stuck in something no scope tracks must not hold the interruption
        # up; the caller's stop_all_children then kills this process's children, which frees it.
        cf.wait(futures, timeout=STOP_WAIT_S)
        store.write_parquet()
        raise
    pool.shutdown(wait=True)
    df = store.write_parquet()
    assert df is not None
    return df


def summarize(df: pl.DataFrame) -> pl.DataFrame:
    """Per task: samples, status counts, mean reward, calls and tokens -- the table printed at the end."""
    return (
        df.group_by("task_id")
        .agg(
            pl.len().alias("samples"),
            (pl.col("status") == "ok").sum().alias("ok"),
            (pl.col("status") == "timeout").sum().alias("timeout"),
            (pl.col("status") == "failed").sum().alias("failed"),
            pl.col("reward").mean().alias("mean_reward"),
            pl.col("calls").sum().alias("calls"),
            pl.col("sampled_tokens").sum().alias("sampled_tokens"),
            pl.col("wall_s").mean().alias("mean_wall_s"),
        )
        .sort("task_id")
    )
