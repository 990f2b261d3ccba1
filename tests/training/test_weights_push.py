"""push_weights: gate order, policy version, fallbacks, verification; and against the real vLLM."""

from __future__ import annotations

import json
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
                    plp = [None] + [{str(t): {"logprob": lp}} for t, lp in zip(ids[1:], fake.served_logprobs)]
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
        return 0.1

    def restart(self, model_dir=None, timeout=900.0):
        self.calls.append(("restart", str(model_dir)))
        if self.fake:
            self.fake.events.append(("server.restart", {}))
        if self.restart_error:
            raise self.restart_error
        if self.on_restart:
            self.on_restart()


def make_checkpoint(path: Path, probe=None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    meta = {"dtype": "float32"}
    if probe:
        meta["probe"] = {"ids": probe[0], "logprobs": probe[1]}
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


def test_failed_push_reopens_the_gate_without_a_new_version(fake, tmp_path):
    server = FakeServer(None, reload_error=RuntimeError("boom"), restart_error=RuntimeError("no restart"))
    with pytest.raises(RuntimeError, match="no restart"):
        push_weights(make_checkpoint(tmp_path / "c"), server, fake.url, policy_version=2)
    assert fake.names() == ["/_polar/pause", "/_polar/resume"]
    assert fake.events[-1][1] == {}


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
