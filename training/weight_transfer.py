"""New weights into a running vLLM through its weight-transfer API (CUDA IPC), without a file.

vLLM 0.32's RL routes (served with ``VLLM_SERVER_DEV_MODE=1``: ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) move weights with the
backend named by ``--weight-transfer-config``: ``nccl`` (a process group between trainer and
workers: other GPUs, other machines) or ``ipc`` (CUDA IPC handles: the trainer and vLLM on the
same GPU, which is the one-GPU setting of ``polar demo --gpu``). Both are CUDA-only; on CPU the
session's weights-only handoff directory and ``reload_weights`` are the path (session.py).

This is the trainer's side of the ``ipc`` backend, spoken over HTTP with the standard library (the
main venv has no vLLM): each tensor is exported with ``torch.multiprocessing.reductions.
reduce_tensor``, the handles are pickled and base64-encoded (``ipc_handles_pickled``; the server
needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` to accept them, loopback only), and vLLM's layer-wise
reloader loads them between start and finish, exactly as vLLM's own ``IPCTrainerWeightTransferEngine``
with its ``HTTPVLLMWeightSyncClient`` does. The exported copies (cast to the served dtype) stay
alive until ``finish`` returns. The served weights are then checked with the push check
(``weights_push.verify_served``) like any other push. Not run on CPU: ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import base64
import pickle
import time
from typing import Iterable

import torch

from polar_core.net import http_request

#: The server flags of this path (with VLLM_SERVER_DEV_MODE=1 and VLLM_ALLOW_INSECURE_SERIALIZATION=1).
SERVER_ARGS = ("--weight-transfer-config", '{"backend": "ipc"}')
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


class WeightTransferError(RuntimeError):
    pass


def _post(base: str, path: str, body: dict | None, timeout: float) -> None:
    status, raw = http_request(f"{base.rstrip('/')}/{path}", body or {}, timeout=timeout)
    if status >= 300:
        raise WeightTransferError(f"vLLM {path} answered {status}: {raw[:500]!r}")


def served_names(state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """The checkpoint-format names vLLM's ``load_weights`` takes; a tied model's output projection
    is sent explicitly (the served copy is untied, see checkpoint.py)."""
    out = dict(state_dict)
    if tied and "lm_head.weight" not in out and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@torch.no_grad()
def send_weights_ipc(base_url: str, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16,
                     version: int | None = None, timeout: float = 600.0, init: bool = True) -> float:
    """Hand ``weights`` (CUDA tensors) to the vLLM at ``base_url`` by CUDA IPC; returns seconds."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not torch.cuda.is_available():
        raise WeightTransferError("the ipc weight transfer needs CUDA tensors (on CPU: the handoff directory)")
    t0 = time.perf_counter()
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    names, dtypes, shapes, handles, keep = [], [], [], [], []
    for name, tensor in weights:
        t = tensor.detach().to(device="cuda", dtype=dtype).contiguous()
        keep.append(t)
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        handles.append({uuid: reduce_tensor(t)[1]})
    torch.cuda.synchronize()
    pickled = base64.b64encode(pickle.dumps(handles)).decode()
    if init:
        _post(base_url, "init_weight_transfer_engine", {"init_info": {"packed": False}}, timeout)
    _post(base_url, "start_weight_update", None, timeout)
    _post(base_url, "update_weights", {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes,
                                                       "ipc_handles_pickled": pickled}}, timeout)
    _post(base_url, "finish_weight_update", {"weight_version": str(version)} if version is not None else None, timeout)
    _post(base_url, "reset_prefix_cache", None, 60.0)  # KV blocks of the old weights
    del keep
    torch.cuda.ipc_collect()
    return time.perf_counter() - t0
