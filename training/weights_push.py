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
   one step, so every call recorded from then on carries version N. When the reload failed, the
   gate is reopened (without a new version) only if the probe shows the previous weights are still
   served; otherwise it stays closed and the push stops with an error that says so (a call must
   never be recorded under a policy_version that does not match the served weights).

After the reload the served weights are *verified*: the checkpoint carries a probe (token ids and
the trainer's logprobs for them, see checkpoint.py) and the server's ``prompt_logprobs`` for the
same ids must agree within ``tol`` (following the dtypes in play: the trainer's compute dtype and
the server's), and must have moved from the previous weights' logprobs (also in the probe) to
the new ones by a margin derived from the serving noise (:func:`probe_verdict`): the probe is
served once more before the reload, which measures that noise in place and gives the baseline the
served change is measured from. A reload that changed nothing fails, and so does an update too small
to be told from the noise (the check cannot pass by default). An in-place reload that does not verify falls back to a
restart. vLLM 0.32's in-place reload is known to keep a stale ``lm_head`` when the *served* model
has tied embeddings (its layer-wise reloader restores the old tensor), so such a server is
restarted on the (untied) checkpoint directly; serve ``checkpoint.servable_copy(base)`` from the
start to make every push an in-place reload.

Several replicas (a multi-node placement): ``server`` a list of them (or base URLs comma-separated)
and ``proxy_control_url`` every proxy in front of them. All gates close first, every replica
reloads the same directory at once and is verified on its own, and the gates reopen under N only
when all verified; a failing replica is named with the state of the others (``new``, ``previous``
or ``unknown``), and the gates stay closed unless every replica still serves the previous weights.

``server`` may be an object (duck-typed: ``reload_weights`` and/or ``restart``, and ``base_url``
or ``url``) or the base URL of a running vLLM (``http://127.0.0.1:8000``), which is what
``polar train --push-to`` uses (a bare URL cannot be restarted).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_core.control import ProxyControl

# The push check lives in push_probe.py; its names stay importable from here.
from .push_probe import (  # noqa: F401
    ALPHA_TOL,
    MIN_SEPARATION,
    PROBE_NOISE,
    PROBE_TOL,
    ProbeVerdict,
    PushError,
    ServedBefore,
    _post,
    _verified,
    measure_served_before,
    probe_tolerance,
    probe_verdict,
    served_dtype,
    served_model,
    served_probe_logprobs,
    served_tied,
    served_version_state,
    verify_served,
)

log = logging.getLogger("polar.train.push")


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
    #: per replica: server, method, reload_s, notes, state (new; after a failure previous|unknown), error
    replicas: list[dict[str, Any]] = field(default_factory=list)


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


def reload_server(
    server: Any, checkpoint_dir: str, allow_restart: bool = True, verify: bool = True, tol: float | None = None,
    before: ServedBefore | None = None,
) -> tuple[str, list[str]]:
    """Load ``checkpoint_dir`` into ``server`` (in place if it verifies, else by restart).
    ``before``: the probe as served before the reload (:func:`measure_served_before`)."""
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
                notes.append(_verified(base, checkpoint_dir, tol, before))
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
        notes.append(_verified(base, checkpoint_dir, tol, before))
    return "restart", notes


def replicas_of(server: Any) -> list[Any]:
    """The replicas a push goes to: a list or tuple of servers, a comma-separated string of base URLs,
    or one server."""
    if isinstance(server, (list, tuple)):
        return list(server)
    if isinstance(server, str) and "," in server:
        return [u.strip() for u in server.split(",") if u.strip()]
    return [server]


def proxies_of(proxy_control_url: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The proxies whose gates a push holds: one per node agent in a multi-node placement."""
    if not proxy_control_url:
        return []
    if isinstance(proxy_control_url, str):
        return [u.strip() for u in proxy_control_url.split(",") if u.strip()]
    return list(proxy_control_url)


@dataclass
class _Replica:
    """One replica's part of a push: reload and verify, or the exception that stopped it."""

    server: Any
    url: str | None
    before: ServedBefore | None = None
    method: str = ""
    notes: list[str] = field(default_factory=list)
    reload_s: float = 0.0
    error: BaseException | None = None
    state: str = ""  # after a failed push: new | previous | unknown

    def name(self) -> str:
        return self.url or type(self.server).__name__

    def report(self) -> dict[str, Any]:
        return {"server": self.name(), "method": self.method, "reload_s": round(self.reload_s, 3),
                "notes": list(self.notes), "state": self.state or "new",
                "error": f"{type(self.error).__name__}: {self.error}" if self.error else None}


def _reload_one(rep: _Replica, ckpt: str, allow_restart: bool, verify: bool, tol: float | None) -> None:
    t0 = time.perf_counter()
    try:
        rep.before = measure_served_before(rep.url, ckpt) if verify else None
        t0 = time.perf_counter()
        rep.method, rep.notes = reload_server(rep.server, ckpt, allow_restart=allow_restart, verify=verify, tol=tol,
                                              before=rep.before)
    except BaseException as exc:  # noqa: BLE001 - decided per replica by the caller
        rep.error = exc
    rep.reload_s = time.perf_counter() - t0


def push_weights(
    checkpoint_dir: str | os.PathLike,
    server: Any,
    proxy_control_url: str | list[str] | tuple[str, ...] | None,
    policy_version: int,
    *,
    allow_restart: bool = True,
    verify: bool = True,
    tol: float | None = None,
    drain_timeout: float = 600.0,
) -> PushResult:
    """Serve ``checkpoint_dir`` as ``policy_version`` while the proxies hold incoming calls.

    ``server``: one server, or the replicas of a placement (a list, or base URLs comma-separated).
    Every replica reloads the same weights directory in place (or restarts on it) and is verified on
    its own; they reload at once (threads: a push holds the gates for the slowest replica, not the
    sum). ``proxy_control_url``: the proxy, or every proxy in front of the replicas (a list, or
    comma-separated); all are drained before the first reload and reopened under the new version
    after the last. A replica that fails is named in the error with the state of the others; the
    gates reopen (on the previous version) only when every replica provably still serves the
    previous weights, else they stay closed: a mixed fleet must not record calls under one label.
    """
    ckpt = str(Path(checkpoint_dir).resolve())
    if not (Path(ckpt) / "config.json").is_file():
        raise PushError(f"{ckpt} is not a model directory (no config.json)")
    servers = replicas_of(server)
    if not servers:
        raise PushError("no server to push to")
    ctls = [ProxyControl(u, timeout=60.0) for u in proxies_of(proxy_control_url)]
    t_pause = time.perf_counter()
    paused: list[ProxyControl] = []
    try:
        for ctl in ctls:
            pause_proxy(ctl, drain_timeout)
            paused.append(ctl)
    except BaseException:
        for ctl in paused:
            ctl.resume()
        raise
    reps = [_Replica(srv, server_url(srv)) for srv in servers]
    if len(reps) == 1:
        _reload_one(reps[0], ckpt, allow_restart, verify, tol)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(reps), thread_name_prefix="push") as pool:
            list(pool.map(lambda r: _reload_one(r, ckpt, allow_restart, verify, tol), reps))
    reload_s = max(r.reload_s for r in reps)
    failed = [r for r in reps if r.error is not None]
    if failed:
        _after_failure(reps, failed, ckpt, policy_version, tol, ctls)
    for ctl in ctls:
        ctl.resume(policy_version)
    methods = sorted({r.method for r in reps})
    result = PushResult(methods[0] if len(methods) == 1 else "mixed", int(policy_version), ckpt, reload_s=reload_s,
                        notes=reps[0].notes if len(reps) == 1 else
                        [f"{r.name()}: {r.method}; {'; '.join(r.notes)}" for r in reps],
                        replicas=[r.report() for r in reps])
    result.paused_s = time.perf_counter() - t_pause if ctls else 0.0
    log.info("pushed %s as policy version %d to %d replica(s) via %s (%.1fs)", ckpt, policy_version, len(reps),
             result.method, result.reload_s)
    return result


def _after_failure(reps: list[_Replica], failed: list[_Replica], ckpt: str, policy_version: int, tol: float | None,
                   ctls: list[ProxyControl]) -> None:
    """Raise for a push with failed replicas, reopening the gates only under a label that matches
    what every replica serves: the previous version when each provably still serves the old weights;
    otherwise the gates stay closed."""
    for r in reps:
        r.state = "new" if r.error is None else served_version_state(r.url, ckpt, tol, r.before)
    exc = failed[0].error
    assert exc is not None
    if len(reps) == 1:  # one server: its own exception, as before
        if ctls and reps[0].state != "previous":
            raise PushError(
                f"push of {ckpt} as policy version {policy_version} failed ({type(exc).__name__}: {exc}) and the "
                f"served weights could not be shown to be the previous version's (they are {reps[0].state}): the "
                "proxy's gate stays closed so that no call is recorded under a wrong policy_version. Serve a known "
                "checkpoint, then reopen with POST /_polar/resume {\"policy_version\": N}"
            ) from exc
        for ctl in ctls:
            ctl.resume(None)
        raise exc
    why = "; ".join(f"{r.name()} failed ({type(r.error).__name__}: {r.error})" for r in failed)
    states = ", ".join(f"{r.name()}: {r.state}" for r in reps)
    reopen = all(r.state == "previous" for r in reps)
    if reopen:
        for ctl in ctls:
            ctl.resume(None)
        tail = "every replica still serves the previous weights: the gates were reopened on the previous version"
    else:
        tail = ("the replicas do not provably serve one version, so the proxies' gates stay closed (no call may be "
                "recorded under a wrong policy_version). Serve a known checkpoint on every replica, then reopen "
                "with POST /_polar/resume {\"policy_version\": N}" if ctls else "nothing was reopened")
    raise PushError(f"push of {ckpt} as policy version {policy_version} to {len(reps)} replicas: {why}. "
                    f"Served now: {states}; {tail}") from exc
