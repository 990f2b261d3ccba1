"""Put a new checkpoint into the running inference server without a harness ever seeing an error.

Sequence (``push_weights``):

1. ``POST <proxy>/_polar/pause {"drain": true}``: the proxy's gate holds new model calls (they
   wait, they do not fail) and answers once in-flight calls have finished, so no generation mixes
   two weight versions. If they do not drain in time the push is abandoned (gate reopened, error).
2. Reload the weights:
   * in place, when the server allows it: a ``VLLMServer``-like object's ``reload_weights(path)``,
     or vLLM's dev endpoint ``POST /collective_rpc {"method": "reload_weights", "kwargs":
     {"weights_path": DIR}}`` (vLLM started with ``VLLM_SERVER_DEV_MODE=1``), followed by
     ``POST /reset_prefix_cache`` because cached KV blocks were computed by the old weights;
   * otherwise a controlled restart of the server on the checkpoint (``server.restart(...)``),
     keeping its served model name and port.
3. ``POST <proxy>/_polar/resume {"policy_version": N}``: the version is set and the gate reopened in
   one step, so every call recorded from then on carries version N. The gate is reopened even when
   the reload failed (without a new version), so held calls are never left hanging; the error is
   raised afterwards.

After the reload the served weights are *verified*: the checkpoint carries a probe (token ids and
the trainer's logprobs for them, see checkpoint.py) and the server's ``prompt_logprobs`` for the
same ids must agree within ``tol``. An in-place reload that does not verify falls back to a
restart. vLLM 0.32's in-place reload is known to keep a stale ``lm_head`` when the *served* model
has tied embeddings (its layer-wise reloader restores the old tensor), so such a server is
restarted on the (untied) checkpoint directly; serve ``checkpoint.servable_copy(base)`` from the
start to make every push an in-place reload.

``server`` may be an object (duck-typed: ``reload_weights`` and/or ``restart``, and ``base_url``
or ``url``) or the base URL of a running vLLM (``http://127.0.0.1:8000``), which is what
``polar train --push-to`` uses (a bare URL cannot be restarted).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_core.control import ProxyControl
from polar_core.net import http_json, http_request

log = logging.getLogger("polar.train.push")


class PushError(RuntimeError):
    pass


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    return http_request(url, body or {}, timeout=timeout)


def pause_proxy(control: Any, drain_timeout: float) -> None:
    """Close the proxy's gate and wait for in-flight calls; reopen and raise if they do not finish."""
    data = control.pause(drain=True, timeout=drain_timeout)
    if data.get("http_status") == 504 or data.get("drained") is False:
        control.resume()
        raise PushError(f"in-flight calls did not finish within {drain_timeout:.0f}s; push abandoned")
    if data.get("http_status"):
        raise PushError(f"proxy pause answered HTTP {data['http_status']}: {data}")


@dataclass
class PushResult:
    method: str  # reload_weights | collective_rpc | restart
    policy_version: int
    checkpoint_dir: str
    paused_s: float = 0.0  # how long harness calls were held at the proxy's gate
    reload_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def reload_via_http(base_url: str, checkpoint_dir: str, timeout: float = 600.0) -> None:
    """vLLM in-place reload through its dev RPC endpoint, then drop the stale prefix cache."""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    status, raw = _post(
        f"{base}/collective_rpc",
        {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint_dir)}, "timeout": timeout},
        timeout,
    )
    if status == 404:
        raise NotImplementedError("vLLM has no /collective_rpc (start it with VLLM_SERVER_DEV_MODE=1)")
    if status >= 300:
        raise PushError(f"vLLM reload_weights answered {status}: {raw[:500]!r}")
    status, raw = _post(f"{base}/reset_prefix_cache", None, 60.0)
    if status >= 300 and status != 404:
        raise PushError(f"vLLM reset_prefix_cache answered {status}: {raw[:300]!r}")


def _restart(server: Any, checkpoint_dir: str) -> None:
    restart = getattr(server, "restart", None)
    if restart is None:
        raise PushError(f"{type(server).__name__} can neither reload weights nor restart")
    params = inspect.signature(restart).parameters
    for name in ("model_dir", "model", "model_path", "checkpoint_dir"):
        if name in params:
            restart(**{name: checkpoint_dir})
            return
    if params:
        restart(checkpoint_dir)
    else:  # a server that re-reads its model directory on start
        restart()


def server_url(server: Any) -> str | None:
    """Root URL (no ``/v1``) of the inference server, when known."""
    if isinstance(server, str):
        url = server
    else:
        url = next((getattr(server, a) for a in ("base_url", "url", "api_base") if getattr(server, a, None)), None)
        if callable(url):
            url = url()
    if not url:
        return None
    url = str(url).rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def served_model(base: str) -> tuple[str, str | None]:
    """(served model name, the model path it was started from) from ``/v1/models``."""
    data = http_json(f"{base}/v1/models")["data"][0]
    return data["id"], data.get("root")


def served_tied(base: str) -> bool:
    """Does the server run a model directory with tied embeddings (in-place reload unsafe)?"""
    try:
        _, root = served_model(base)
        cfg = json.loads((Path(root) / "config.json").read_text()) if root else {}
    except (OSError, ValueError, KeyError):  # HTTP errors are OSErrors too
        return False
    text = cfg.get("text_config") or cfg
    return bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))


def verify_served(base: str, checkpoint_dir: str, tol: float | None = None) -> float:
    """Largest |served - trained| logprob over the checkpoint's probe; raises PushError above ``tol``."""
    from .checkpoint import read_meta

    meta = read_meta(checkpoint_dir)
    probe = meta.get("probe")
    if not probe:
        return 0.0
    if tol is None:
        tol = 2e-3 if meta.get("dtype", "float32") == "float32" else 0.1
    name, _ = served_model(base)
    ids = probe["ids"]
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    status, raw = _post(f"{base}/v1/completions", body, 120.0)
    if status >= 300:
        raise PushError(f"probe completion answered {status}: {raw[:300]!r}")
    entries = json.loads(raw)["choices"][0]["prompt_logprobs"][1:]
    worst = 0.0
    for tok, expected, entry in zip(ids[1:], probe["logprobs"], entries):
        got = entry.get(str(tok)) or next(iter(entry.values()))
        worst = max(worst, abs(float(got["logprob"]) - float(expected)))
    if worst > tol:
        raise PushError(f"served weights differ from {checkpoint_dir}: probe logprob off by {worst:.4g} > {tol}")
    return worst


def reload_server(
    server: Any, checkpoint_dir: str, allow_restart: bool = True, verify: bool = True, tol: float | None = None
) -> tuple[str, list[str]]:
    """Load ``checkpoint_dir`` into ``server`` (in place if it verifies, else by restart)."""
    notes: list[str] = []
    base = server_url(server)
    in_place = True
    if base and served_tied(base):
        in_place = False
        notes.append("served model has tied embeddings: vLLM's in-place reload would keep a stale lm_head")
    if in_place:
        try:
            if isinstance(server, str) or getattr(server, "reload_weights", None) is None:
                if not base:
                    raise NotImplementedError("server has neither reload_weights nor a URL")
                reload_via_http(base, checkpoint_dir)
                method = "collective_rpc"
            else:
                if server.reload_weights(checkpoint_dir) is False:
                    raise NotImplementedError("reload_weights returned False")
                method = "reload_weights"
            if verify and base:
                notes.append(f"probe max |dlogp| {verify_served(base, checkpoint_dir, tol):.2e}")
            return method, notes
        except Exception as exc:  # noqa: BLE001 - any in-place failure falls back to a restart
            if not allow_restart or isinstance(server, str):
                raise
            notes.append(f"in-place reload failed: {type(exc).__name__}: {exc}")
    if not allow_restart or isinstance(server, str):
        raise PushError("cannot load the checkpoint in place and cannot restart the server: " + "; ".join(notes))
    _restart(server, checkpoint_dir)
    base = server_url(server)
    if verify and base:
        notes.append(f"probe max |dlogp| {verify_served(base, checkpoint_dir, tol):.2e}")
    return "restart", notes


def push_weights(
    checkpoint_dir: str | os.PathLike,
    server: Any,
    proxy_control_url: str | None,
    policy_version: int,
    *,
    allow_restart: bool = True,
    verify: bool = True,
    tol: float | None = None,
    drain_timeout: float = 600.0,
) -> PushResult:
    """Serve ``checkpoint_dir`` as ``policy_version`` while the proxy holds incoming calls."""
    ckpt = str(Path(checkpoint_dir).resolve())
    if not (Path(ckpt) / "config.json").is_file():
        raise PushError(f"{ckpt} is not a model directory (no config.json)")
    ctl = ProxyControl(proxy_control_url, timeout=60.0) if proxy_control_url else None
    t_pause = time.perf_counter()
    if ctl:
        pause_proxy(ctl, drain_timeout)
    result: PushResult | None = None
    try:
        t0 = time.perf_counter()
        method, notes = reload_server(server, ckpt, allow_restart=allow_restart, verify=verify, tol=tol)
        result = PushResult(method, int(policy_version), ckpt, reload_s=time.perf_counter() - t0, notes=notes)
    finally:
        if ctl:
            ctl.resume(policy_version if result is not None else None)
    result.paused_s = time.perf_counter() - t_pause if ctl else 0.0
    log.info("pushed %s as policy version %d via %s (%.1fs)", ckpt, policy_version, result.method, result.reload_s)
    return result
