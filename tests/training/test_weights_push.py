"""push_weights: gate order, policy version, fallbacks, verification; and against the real vLLM."""

from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from polar_core.net import OPENER  # never via HTTP(S)_PROXY
from polar_training import checkpoint as ckpt
from polar_training.weights_push import PushError, push_weights


class FakeEndpoints:
    """Stands in for the proxy's /_polar control API and vLLM's endpoints, logging every call."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []
        self.drained = True
        self.served_logprobs: list[float] = []  # what /v1/completions reports for the probe
        self.root = "/nonexistent"
        self.server_dtype: str | None = None  # answered on /server_info (dev mode) when set
        self.after_reload: list[float] | None = None  # served_logprobs once FakeServer reloads
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def names(self) -> list[str]:
        return [e for e, _ in self.events]

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, data):
                raw = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self._send(200, {"data": [{"id": "tiny", "root": fake.root}]})
                if self.path.startswith("/server_info") and fake.server_dtype:
                    return self._send(200, {"vllm_config": {"model_config": {"dtype": fake.server_dtype}}})
                self._send(404, {})

            def do_POST(self):
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                name = self.path.split("?")[0]
                fake.events.append((name, body))
                if name == "/_polar/pause":
                    ok = fake.drained
                    return self._send(200 if ok else 504, {"paused": True, "drained": ok})
                if name in ("/_polar/resume", "/reset_prefix_cache", "/collective_rpc"):
                    return self._send(200, {"ok": True})
                if name == "/v1/completions":
                    ids = body["prompt"]
                    served = fake.served_logprobs() if callable(fake.served_logprobs) else fake.served_logprobs
                    plp = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(ids[1:], served)]
                    return self._send(200, {"choices": [{"prompt_logprobs": plp}]})
                self._send(404, {})

        return H


@pytest.fixture
def fake():
    f = FakeEndpoints()
    yield f
    f.close()


class FakeServer:
    def __init__(self, fake: FakeEndpoints | None, reload_error: Exception | None = None, restart_error=None):
        self.fake, self.reload_error, self.restart_error = fake, reload_error, restart_error
        self.calls: list[tuple[str, str]] = []
        self.on_restart = None

    @property
    def base_url(self):
        return self.fake.url if self.fake else None

    def reload_weights(self, model_dir):
        self.calls.append(("reload", str(model_dir)))
        if self.fake:
            self.fake.events.append(("server.reload", {}))
        if self.reload_error:
            raise self.reload_error
        if self.fake and self.fake.after_reload is not None:  # what the reloaded weights serve
            self.fake.served_logprobs = self.fake.after_reload
        return 0.1

    def restart(self, model_dir=None, timeout=900.0):
        self.calls.append(("restart", str(model_dir)))
        if self.fake:
            self.fake.events.append(("server.restart", {}))
        if self.restart_error:
            raise self.restart_error
        if self.on_restart:
            self.on_restart()


def make_checkpoint(path: Path, probe=None, before=None, compute_dtype=None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    meta = {"dtype": "float32"}
    if compute_dtype:
        meta["compute_dtype"] = compute_dtype
    if probe:
        meta["probe"] = {"ids": probe[0], "logprobs": probe[1]}
        if before:
            meta["probe"]["logprobs_before"] = before
    (path / ckpt.META_FILE).write_text(json.dumps(meta))
    return path


def test_gate_closes_reloads_sets_version_and_reopens_in_order(fake, tmp_path):
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.5, -2.25]))
    fake.served_logprobs = [-1.5, -2.25 + 1e-4]
    server = FakeServer(fake)
    res = push_weights(ck, server, fake.url, policy_version=7)
    assert res.method == "reload_weights" and res.policy_version == 7
    assert fake.names() == ["/_polar/pause", "server.reload", "/v1/completions", "/_polar/resume"]
    assert fake.events[0][1]["drain"] is True
    assert fake.events[-1][1] == {"policy_version": 7}
    assert any("probe" in n for n in res.notes) and res.paused_s >= res.reload_s


def test_stale_weights_fail_verification_and_fall_back_to_restart(fake, tmp_path):
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.5, -2.25]))
    fake.served_logprobs = [-1.9, -2.25]  # in-place reload "succeeded" but serves other weights
    server = FakeServer(fake)
    server.on_restart = lambda: setattr(fake, "served_logprobs", [-1.5, -2.25])
    res = push_weights(ck, server, fake.url, policy_version=3)
    assert res.method == "restart"
    assert [c for c, _ in server.calls] == ["reload", "restart"]
    assert any("differ" in n for n in res.notes)
    assert fake.events[-1] == ("/_polar/resume", {"policy_version": 3})


def test_tied_served_model_goes_straight_to_restart(fake, tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    fake.root = str(served)
    server = FakeServer(fake)
    res = push_weights(make_checkpoint(tmp_path / "c"), server, None, policy_version=1)
    assert res.method == "restart" and [c for c, _ in server.calls] == ["restart"]
    assert "tied" in res.notes[0]


def test_failed_push_whose_served_weights_are_unknown_keeps_the_gate_closed(fake, tmp_path):
    server = FakeServer(None, reload_error=RuntimeError("boom"), restart_error=RuntimeError("no restart"))
    with pytest.raises(PushError, match="gate stays closed") as err:
        push_weights(make_checkpoint(tmp_path / "c"), server, fake.url, policy_version=2)
    assert "no restart" in str(err.value) and "policy version 2" in str(err.value)
    assert fake.names() == ["/_polar/pause"]  # never reopened under a label that may be wrong


def test_failed_push_reopens_the_gate_on_the_old_version_when_the_old_weights_are_served(fake, tmp_path):
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.0, -2.0]), before=[-1.5, -2.5])
    fake.served_logprobs = [-1.5, -2.5]  # still the previous weights
    server = FakeServer(fake, reload_error=RuntimeError("boom"), restart_error=RuntimeError("no restart"))
    with pytest.raises(RuntimeError, match="no restart"):
        push_weights(ck, server, fake.url, policy_version=2)
    assert fake.names()[-1] == "/_polar/resume" and fake.events[-1][1] == {}


def test_a_reload_that_changed_nothing_fails_verification(fake, tmp_path):
    """The update (0.01 nats on average) is below the float32 tolerance, so only the comparison
    with the previous weights' logprobs can tell that the server still serves those."""
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.501, -2.249]), before=[-1.5, -2.25])
    fake.served_logprobs = [-1.5, -2.25]
    with pytest.raises(PushError, match="did not move from the previous version"):
        push_weights(ck, FakeServer(fake), None, policy_version=5, allow_restart=False)
    fake.after_reload = [-1.501, -2.249]
    assert push_weights(ck, FakeServer(fake), None, policy_version=5).method == "reload_weights"


def test_probe_tolerance_follows_the_dtypes_in_play(fake, tmp_path):
    from polar_training.weights_push import probe_tolerance

    assert probe_tolerance("float32", "float32") == 2e-3
    assert probe_tolerance("float32", "bfloat16") == probe_tolerance("bfloat16", None) == 0.3
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.5, -2.25]))
    fake.served_logprobs = [-1.6, -2.25]  # 0.1 off: bf16 rounding on the server, not other weights
    fake.server_dtype = "torch.bfloat16"
    assert push_weights(ck, FakeServer(fake), None, policy_version=1).method == "reload_weights"
    fake.server_dtype = "float32"  # the same gap between two float32 computations means other weights
    with pytest.raises(PushError, match="off by 0.1"):
        push_weights(ck, FakeServer(fake), None, policy_version=1, allow_restart=False)


def test_undrained_proxy_abandons_the_push(fake, tmp_path):
    fake.drained = False
    server = FakeServer(None)
    with pytest.raises(PushError, match="did not finish"):
        push_weights(make_checkpoint(tmp_path / "c"), server, fake.url, policy_version=2)
    assert server.calls == [] and fake.names() == ["/_polar/pause", "/_polar/resume"]


def test_bare_url_uses_collective_rpc_and_resets_the_prefix_cache(fake, tmp_path):
    ck = make_checkpoint(tmp_path / "c")
    res = push_weights(ck, fake.url + "/v1", None, policy_version=4)
    assert res.method == "collective_rpc"
    (rpc, body), (reset, _) = fake.events
    assert rpc == "/collective_rpc" and body["method"] == "reload_weights"
    assert body["kwargs"] == {"weights_path": str(ck.resolve())} and reset == "/reset_prefix_cache"


#: Per-token serving noise the fakes add: float32 as measured (trainer vs vLLM on CPU, ~1e-5);
#: bf16 as in the issue's counterexample (old weights plus 0.05 noise passed after a 0.005 update).
SERVING_NOISE = {"float32": 1e-5, "bfloat16": 0.05}
#: The update's per-token probe change: under each dtype's tolerance of |served - new| (PROBE_TOL),
#: so only the comparison with the previous weights can tell.
UPDATE = {"float32": 5e-4, "bfloat16": 0.005}


# -- several replicas -------------------------------------------------------------------------------

@pytest.fixture
def two():
    """Two replicas, each with a proxy in front (the fakes answer both), logging into one list."""
    a, b = FakeEndpoints(), FakeEndpoints()
    b.events = a.events
    yield a, b
    a.close()
    b.close()


def _two_replicas(two, tmp_path, b_reloads: bool = True):
    a, b = two
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.0, -2.0]), before=[-1.5, -2.5])
    for f in (a, b):
        f.served_logprobs = [-1.5, -2.5]  # the previous weights
        f.after_reload = [-1.0, -2.0]
    b.after_reload = [-1.0, -2.0] if b_reloads else None  # b "reloads" but keeps serving the old weights
    return ck, FakeServer(a), FakeServer(b)


def test_push_to_two_replicas_closes_every_gate_then_reloads_and_verifies_each(two, tmp_path):
    ck, sa, sb = _two_replicas(two, tmp_path)
    a, b = two
    res = push_weights(ck, [sa, sb], [a.url, b.url], policy_version=4)
    names = a.names()
    assert names[:2] == ["/_polar/pause", "/_polar/pause"]  # both gates closed before any reload
    assert names.count("server.reload") == 2 and names[-2:] == ["/_polar/resume", "/_polar/resume"]
    assert [body for n, body in a.events if n == "/_polar/resume"] == [{"policy_version": 4}] * 2
    assert res.method == "reload_weights" and res.policy_version == 4
    assert [(r["server"], r["state"], r["method"]) for r in res.replicas] == [
        (a.url, "new", "reload_weights"), (b.url, "new", "reload_weights")]
    assert all(any("probe" in n for n in r["notes"]) for r in res.replicas)  # verified one by one


def test_a_replica_that_fails_is_named_with_the_others_state_and_the_gates_stay_closed(two, tmp_path):
    ck, sa, sb = _two_replicas(two, tmp_path, b_reloads=False)
    a, b = two
    with pytest.raises(PushError) as err:
        push_weights(ck, [sa, sb], [a.url, b.url], policy_version=4, allow_restart=False)
    msg = str(err.value)
    assert f"{b.url} failed (PushError: served weights differ" in msg and f"{a.url} failed" not in msg
    assert f"{a.url}: new, {b.url}: previous" in msg and "gates stay closed" in msg
    assert "/_polar/resume" not in a.names()  # a mixed fleet is never labelled with one version


def test_replicas_that_all_still_serve_the_previous_weights_reopen_on_the_previous_version(two, tmp_path):
    ck, _, _ = _two_replicas(two, tmp_path)
    a, b = two
    servers = [FakeServer(f, reload_error=RuntimeError(f"boom {i}"), restart_error=RuntimeError("no restart"))
               for i, f in enumerate(two)]
    with pytest.raises(PushError, match="reopened on the previous version") as err:
        push_weights(ck, servers, [a.url, b.url], policy_version=4)
    assert f"{a.url}: previous, {b.url}: previous" in str(err.value)
    assert [body for n, body in a.events if n == "/_polar/resume"] == [{}, {}]


def test_comma_separated_urls_push_to_each_replica_over_http(two, tmp_path):
    """``polar train --push-to URL,URL --proxy-control URL``: bare URLs reload through vLLM's RPC."""
    a, b = two
    ck = make_checkpoint(tmp_path / "c", probe=([5, 6, 7], [-1.0, -2.0]))
    a.served_logprobs = b.served_logprobs = [-1.0, -2.0]
    res = push_weights(ck, f"{a.url},{b.url}", a.url, policy_version=9)
    assert [r["method"] for r in res.replicas] == ["collective_rpc", "collective_rpc"]
    assert a.names().count("/collective_rpc") == 2 and a.names().count("/reset_prefix_cache") == 2
    assert a.names()[0] == "/_polar/pause" and a.names()[-1] == "/_polar/resume"


def _probe_case(update: float, n: int = 48, seed: int = 0):
    rng = random.Random(seed)
    old = [-rng.uniform(0.1, 6.0) for _ in range(n - 1)]
    new = [o + rng.gauss(0.0, update) for o in old]
    return list(range(100, 100 + n)), old, new


def _plus(xs, sd, rng):
    return [x + rng.gauss(0.0, sd) for x in xs]


def _resumes(fake) -> list[dict]:
    return [body for name, body in fake.events if name == "/_polar/resume"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("noise_kind", ["fixed", "fresh"])
def test_old_weights_plus_noise_fail_the_push_check(fake, tmp_path, dtype, noise_kind):
    """A reload (and a restart) after which the server still serves the previous weights plus its
    dtype's noise, after an update below the dtype's tolerance (0.005 nats in bf16): the push fails and the gate is never reopened under
    the new version. "fixed": the same noise on every query (deterministic kernels); "fresh": new
    noise on each query. The old check passed the bf16 case (tolerance 0.3, the move check skipped
    below a 0.015 mean change) and sent /_polar/resume {"policy_version": 2}."""
    ids, old, new = _probe_case(update=UPDATE[dtype])
    ck = make_checkpoint(tmp_path / "c", probe=(ids, new), before=old, compute_dtype=dtype)
    fake.server_dtype = dtype
    rng = random.Random(1)
    sd = SERVING_NOISE[dtype]
    fixed = _plus(old, sd, rng)
    fake.served_logprobs = fixed if noise_kind == "fixed" else (lambda: _plus(old, sd, rng))
    with pytest.raises(PushError, match="did not move from the previous version|gate stays closed"):
        push_weights(ck, FakeServer(fake), fake.url, policy_version=2)
    assert all("policy_version" not in body for body in _resumes(fake))
    if noise_kind == "fixed":  # provably the previous weights: reopened without a new version
        assert _resumes(fake) == [{}]
    # and without a baseline measured on the server (a stopped server), the same answer
    from polar_training.weights_push import probe_verdict

    assert probe_verdict(fixed, new, old, dtype).state != "new"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_new_weights_pass_the_push_check(fake, tmp_path, dtype):
    """The server serves the new weights: their logprobs plus the same systematic kernel error as
    before the reload (the dtype's noise, 0.05 nats in bf16: ten times the update) plus a small
    change of that error with the weights. Verified as the new version; the gate reopens under it."""
    ids, old, new = _probe_case(update=UPDATE[dtype])
    ck = make_checkpoint(tmp_path / "c", probe=(ids, new), before=old, compute_dtype=dtype)
    fake.server_dtype = dtype
    rng = random.Random(2)
    sd = SERVING_NOISE[dtype]
    error = [rng.gauss(0.0, sd) for _ in old]
    fake.served_logprobs = [a + e for a, e in zip(old, error)]
    fake.after_reload = [a + e + rng.gauss(0.0, UPDATE[dtype] / 10) for a, e in zip(new, error)]
    res = push_weights(ck, FakeServer(fake), fake.url, policy_version=2)
    assert res.method == "reload_weights", res.notes
    assert _resumes(fake) == [{"policy_version": 2}]
    from polar_training.weights_push import ServedBefore, probe_verdict

    served_before = [a + e for a, e in zip(old, error)]
    verdict = probe_verdict(fake.after_reload, new, old, dtype, ServedBefore(served_before))
    print(f"{dtype}: {verdict.describe()}")
    assert verdict.state == "new" and abs(verdict.alpha - 1) < 0.2


def test_served_version_after_a_failed_push_is_decided_not_a_coin_flip(fake, tmp_path):
    """bf16, a 0.005-nat update under 0.05 noise: the old state said ``previous`` or ``new`` by which
    of two nearly equal distances was smaller. Without a baseline the answer is ``unknown`` (the gate
    stays closed) on every draw; with the baseline measured before the reload it is ``previous``
    when nothing changed, and ``new`` only for the new weights."""
    from polar_training.weights_push import served_version_state

    ids, old, new = _probe_case(update=0.005)
    ck = make_checkpoint(tmp_path / "c", probe=(ids, new), before=old, compute_dtype="bfloat16")
    fake.server_dtype = "bfloat16"
    states = set()
    for seed in range(20):
        rng = random.Random(seed)
        fake.served_logprobs = _plus(old if seed % 2 else new, 0.05, rng)
        states.add(served_version_state(fake.url, str(ck)))
    assert states == {"unknown"}
    from polar_training.weights_push import ServedBefore

    rng = random.Random(3)
    error = [rng.gauss(0.0, 0.05) for _ in old]
    served_old = [a + e for a, e in zip(old, error)]
    fake.served_logprobs = served_old
    assert served_version_state(fake.url, str(ck), before=ServedBefore(served_old)) == "previous"
    fake.served_logprobs = [a + e for a, e in zip(new, error)]
    assert served_version_state(fake.url, str(ck), before=ServedBefore(served_old)) == "new"
    fake.served_logprobs = [a + e + 0.5 * (b - a) for a, b, e in zip(old, new, error)]  # half loaded
    assert served_version_state(fake.url, str(ck), before=ServedBefore(served_old)) == "unknown"


# ---- the real thing ----------------------------------------------------------------------------


def _served_prompt_logprobs(server, ids):
    from polar_core.net import http_json

    out = http_json(
        f"{server.base_url}/v1/completions",
        {"model": server.served_model_name, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
        timeout=120,
    )
    return [e[str(t)]["logprob"] for t, e in zip(ids[1:], out["choices"][0]["prompt_logprobs"][1:])]


def _chat(url: str, session: str, results: dict, key: str) -> None:
    import urllib.request

    body = {"model": "tiny-qwen", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 6,
            "temperature": 1.0}  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json", "x-polar-session": session}
    )
    with OPENER.open(req, timeout=300) as resp:
        results[key] = (resp.status, json.loads(resp.read()))


@pytest.mark.vllm
@pytest.mark.slow
def test_push_through_the_proxy_into_the_running_vllm(vllm_tiny, tiny_qwen_dir, tiny_model, make_frame, tmp_path):
    """One GRPO step on tiny-qwen, pushed into the running vLLM while the real proxy holds a call:
    the call is answered (no error), recorded as the new policy version, and its captured logprobs
    are the new weights' (and the served probe equals the trainer's)."""
    import time

    import torch

    from polar_proxy.process import ProxyProcess
    from polar_training.loss import LossConfig
    from polar_training.policy import TokenLogprobs
    from polar_training.trainer import GRPOTrainer, TrainConfig

    frame = make_frame(groups=1, samples=4, min_len=12, max_len=24, seed=9)
    probe = list(frame["input_ids"][0])
    before = _served_prompt_logprobs(vllm_tiny, probe)
    trainer = GRPOTrainer(tiny_model, TrainConfig(lr=5e-3, loss=LossConfig(kl_coef=0.0)))
    trainer.fit(frame)
    out = ckpt.save_checkpoint(tmp_path / "step-000001", trainer.model, tiny_qwen_dir, probe_ids=probe)

    proxy = ProxyProcess(vllm_tiny.base_url, tmp_path / "captures", confdir=tmp_path / "mitm", upstream_timeout=300)
    proxy.start()
    try:
        ctl = proxy.control
        ctl.set_policy_version(0)
        results: dict = {}
        _chat(proxy.url, "before-push", results, "before")
        ctl.pause(drain=True, timeout=60)
        held = threading.Thread(target=_chat, args=(proxy.url, "during-push", results, "held"))
        held.start()
        time.sleep(0.5)
        assert "held" not in results and ctl.status()["waiting"] == 1
        res = push_weights(out, vllm_tiny, proxy.url, policy_version=trainer.step)
        held.join(300)
        assert res.method == "reload_weights", res.notes
        assert results["before"][0] == 200 and results["held"][0] == 200
        assert ctl.status()["paused"] is False and ctl.status()["policy_version"] == 1

        after = _served_prompt_logprobs(vllm_tiny, probe)
        want = ckpt.read_meta(out)["probe"]["logprobs"]
        assert max(abs(a - w) for a, w in zip(after, want)) < 2e-3
        assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2  # the weights did change

        records = {}
        for sid in ("before-push", "during-push"):
            [line] = (tmp_path / "captures" / "sessions" / f"{sid}.jsonl").read_text().splitlines()
            records[sid] = json.loads(line)
        assert records["before-push"]["policy_version"] == 0 and records["during-push"]["policy_version"] == 1
        rec = records["during-push"]
        ids = rec["prompt_token_ids"] + rec["sampled_token_ids"]
        n_p, n_s = len(rec["prompt_token_ids"]), len(rec["sampled_token_ids"])
        with torch.no_grad():
            x = torch.tensor([ids])
            lp, _ = TokenLogprobs(trainer.model)(x, torch.arange(len(ids))[None], torch.arange(n_p - 1, n_p + n_s - 1), x[0, n_p:])
        assert max(abs(a - b) for a, b in zip(lp.tolist(), rec["sampled_logprobs"])) < 2e-3
        print(f"\nin-place reload {res.reload_s:.2f}s, calls held {res.paused_s:.2f}s; {res.notes}")
    finally:  # the server is shared by the session: serve the original weights again
        proxy.stop()
        vllm_tiny.reload_weights(tiny_qwen_dir)
    restored = _served_prompt_logprobs(vllm_tiny, probe)
    assert max(abs(a - b) for a, b in zip(restored, before)) < 1e-4


@pytest.mark.vllm
@pytest.mark.slow
def test_two_real_replicas_behind_one_proxy(vllm_tiny, tiny_qwen_dir, tiny_model, make_frame, tmp_path):
    """Two vLLM servers of tiny-qwen behind one proxy: sessions spread over both and stay; one GRPO
    step pushed to both (each reloads in place and is verified), every later call recorded under
    the new version with the new weights' logprobs on whichever replica served it; then a replica
    goes away and its session moves, saying so, with its answer still the new weights'."""
    import torch

    from polar_core.schema import read_capture_lines
    from polar_proxy.process import ProxyProcess
    from polar_proxy.upstreams import SESSION_MOVED
    from polar_runtime import models
    from polar_runtime.serve import VLLMServer
    from polar_training.loss import LossConfig
    from polar_training.policy import TokenLogprobs
    from polar_training.trainer import GRPOTrainer, TrainConfig

    # the session's server and one of our own (started while the trainer steps); ours is the one stopped
    own = VLLMServer(models.TINY_QWEN, served_model_name="tiny-qwen", max_model_len=4096, log_path=tmp_path / "vllm.log")
    servers = [vllm_tiny, own]
    before = _served_prompt_logprobs(vllm_tiny, list(make_frame(groups=1, samples=4, min_len=12, max_len=24,
                                                                 seed=9)["input_ids"][0]))
    proxy = None
    try:
        own.start(wait=False)
        frame = make_frame(groups=1, samples=4, min_len=12, max_len=24, seed=9)
        probe = list(frame["input_ids"][0])
        trainer = GRPOTrainer(tiny_model, TrainConfig(lr=5e-3, loss=LossConfig(kl_coef=0.0)))
        trainer.fit(frame)  # while the servers start
        out = ckpt.save_checkpoint(tmp_path / "step-000001", trainer.model, tiny_qwen_dir, probe_ids=probe)
        own.wait_ready()
        urls = [s.base_url for s in servers]
        proxy = ProxyProcess(urls, tmp_path / "captures", confdir=tmp_path / "mitm", upstream_timeout=300).start()
        proxy.control.set_policy_version(0)
        results: dict = {}
        for sid in ("s0", "s1"):
            _chat(proxy.url, sid, results, sid)

        def recs(sid):
            return list(read_capture_lines(tmp_path / "captures" / "sessions" / f"{sid}.jsonl"))

        assert [recs(sid)[0]["upstream"] for sid in ("s0", "s1")] == urls  # equal load: list order

        res = push_weights(out, servers, proxy.url, policy_version=trainer.step)
        assert [(r["server"], r["method"], r["state"]) for r in res.replicas] == [
            (u, "reload_weights", "new") for u in urls], res.replicas
        want = ckpt.read_meta(out)["probe"]["logprobs"]
        for s in servers:
            assert max(abs(a - w) for a, w in zip(_served_prompt_logprobs(s, probe), want)) < 2e-3

        def new_weights_sampled(rec):
            ids = rec["prompt_token_ids"] + rec["sampled_token_ids"]
            n_p, n_s = len(rec["prompt_token_ids"]), len(rec["sampled_token_ids"])
            with torch.no_grad():
                x = torch.tensor([ids])
                lp, _ = TokenLogprobs(trainer.model)(x, torch.arange(len(ids))[None],
                                                      torch.arange(n_p - 1, n_p + n_s - 1), x[0, n_p:])
            return max(abs(a - b) for a, b in zip(lp.tolist(), rec["sampled_logprobs"])) < 2e-3

        for sid, url in zip(("s0", "s1"), urls):  # each session stays on its replica, now serving v1
            _chat(proxy.url, sid, results, sid)
            rec = recs(sid)[-1]
            assert (rec["upstream"], rec["policy_version"]) == (url, 1) and new_weights_sampled(rec)

        own.stop()  # s1's replica goes away: s1 moves to the other one
        _chat(proxy.url, "s1", results, "s1")
        rec = recs("s1")[-1]
        assert results["s1"][0] == 200 and rec["upstream"] == urls[0] and rec["policy_version"] == 1
        assert any(n.startswith(f"{SESSION_MOVED} from {urls[1]}") for n in rec["translation_notes"])
        assert new_weights_sampled(rec)
        print(f"\npush to 2 replicas: reload {res.reload_s:.2f}s, calls held {res.paused_s:.2f}s")
    finally:  # the session's server serves the original weights again
        if proxy is not None:
            proxy.stop()
        own.stop()
        vllm_tiny.reload_weights(tiny_qwen_dir)
    assert max(abs(a - b) for a, b in zip(_served_prompt_logprobs(vllm_tiny, probe), before)) < 1e-4
