"""vLLM replicas of the Ray placement: servers owned by an actor on their node, or URLs you run.

A :class:`VLLMReplica` is a plain object (``placement.py`` makes it an actor pinned to a node) that
owns one ``polar_runtime.serve.VLLMServer``: started from the base model or a checkpoint, stopped
with its actor. Its :meth:`reload` is the in-place reload of ``training/weights_push.py`` (vLLM's
``reload_weights`` on the weights directory, else a restart on it) *verified on this replica*: the
checkpoint's probe logprobs served before and after, as in a single-server push. Running on the
replica's node, it can restart the server when an in-place reload does not verify.

:class:`UrlReplica` is a server the user runs (``[placement] replicas = ["http://..."]``): reloaded
through vLLM's ``/collective_rpc`` (the server must run with ``VLLM_SERVER_DEV_MODE=1``), verified
the same way, never restarted (we do not own it).

The proxy's gate is not touched here: the placement closes every node's gate, reloads every replica,
and reopens the gates under the new version only when every live replica verified.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional


def reload_verified(server: Any, checkpoint: str, allow_restart: bool) -> dict[str, Any]:
    """Reload ``checkpoint`` into ``server`` (an object or a URL) and verify it; what happened."""
    from polar_training.weights_push import measure_served_before, reload_server, server_url

    ckpt = str(Path(checkpoint).resolve())
    before = measure_served_before(server_url(server), ckpt)
    t0 = time.perf_counter()
    method, notes = reload_server(server, ckpt, allow_restart=allow_restart, verify=True, before=before)
    return {"method": method, "notes": notes, "reload_s": round(time.perf_counter() - t0, 3),
            "url": server_url(server)}


class VLLMReplica:
    """One vLLM server on this node (see the module docstring)."""

    def __init__(self, model: str, served_model: str, *, max_model_len: Optional[int] = None,
                 kv_cache_gib: Optional[float] = None, tool_parser: Optional[str] = None, gpu: bool = False,
                 log_dir: Optional[str] = None, record_dir: Optional[str] = None) -> None:
        self.model, self.served_model = model, served_model
        # the server's pid with its start time: a lost node's leftovers can be stopped where visible
        self.record_dir = Path(record_dir) / "replica" if record_dir else None
        self.kwargs: dict[str, Any] = {"max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib, "gpu": gpu}
        if tool_parser:
            self.kwargs["tool_parser"] = tool_parser
        self.log_dir = Path(log_dir) if log_dir else None
        self.server: Any = None

    def start(self, serve_from: Optional[str] = None) -> dict[str, Any]:
        """Serve ``serve_from`` (a checkpoint) or the model; returns the URL and the start-up time."""
        from polar_runtime import models
        from polar_runtime.loop.phases import servable_dir
        from polar_runtime.serve import VLLMServer, resolve_model

        if self.model in models.SPECS:
            models.ensure_model(self.model)
        model_dir, _ = resolve_model(self.model)
        path = Path(serve_from) if serve_from else servable_dir(model_dir, lambda _m: None)
        log = self.log_dir / "vllm.log" if self.log_dir else None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
        extra = ("--gpu-memory-utilization", "0.35") if self.kwargs["gpu"] else ()
        self.server = VLLMServer(path, served_model_name=self.served_model, extra_args=extra, log_path=log,
                                 **{k: v for k, v in self.kwargs.items() if v is not None})
        from polar_runtime.loop.placement import ChildRecord

        if self.record_dir is not None:  # what a killed earlier run left on this node
            self.record_dir.mkdir(parents=True, exist_ok=True)
            ChildRecord(self.record_dir).stop_leftovers(lambda _m: None)
        self.server.start(wait=True)
        if self.record_dir is not None:
            ChildRecord(self.record_dir).add("vllm", getattr(self.server.proc, "pid", None), group=True)
        return {"url": self.server.base_url, "start_s": self.server.start_seconds,
                "pid": getattr(self.server.proc, "pid", None)}

    def url(self) -> str:
        return self.server.base_url

    def reload(self, checkpoint: str) -> dict[str, Any]:
        res = reload_verified(self.server, checkpoint, allow_restart=True)
        if self.record_dir is not None and res["method"] == "restart":  # a restart is a new pid
            from polar_runtime.loop.placement import ChildRecord

            ChildRecord(self.record_dir).add("vllm", getattr(self.server.proc, "pid", None), group=True)
        return res

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class UrlReplica:
    """A vLLM server someone else runs, reached by URL."""

    def __init__(self, url: str) -> None:
        self.base_url = url.rstrip("/")

    def url(self) -> str:
        return self.base_url

    def reload(self, checkpoint: str) -> dict[str, Any]:
        return reload_verified(self.base_url, checkpoint, allow_restart=False)

    def stop(self) -> None:
        return None
