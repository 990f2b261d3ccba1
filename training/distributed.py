"""Multi-process training with PyTorch FSDP2 (``fully_shard``).

``polar train`` run under ``torchrun --nproc-per-node N`` initializes a process group (NCCL on
GPUs, gloo on CPU), shards every decoder layer and then the root module, and every rank trains on
its share of the packed micro-batches (see :mod:`polar_training.trainer`). Everything here is a
no-op in a plain single process.

Its self-check (one process and N agree) is :mod:`polar_training.parity`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .packing import MicroBatch, padding_microbatch


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_and_world()[0] == 0


def init_from_env() -> bool:
    """Join the process group torchrun describes in the environment; False when not under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return True


def shutdown(timeout_s: float = 60.0) -> None:
    """Leave the process group so that no rank exits while another still holds its gloo sockets.

    ``barrier(); destroy_process_group()`` alone lets a fast rank 0 destroy its group and exit
    while a slower rank (a loaded machine) is still tearing its own down; gloo's I/O thread there
    can read the closed connection and throw, which aborts the process: the likely cause of rank
    1's abort at exit in tests/training/test_distributed.py under load (reported, not reproduced
    here: 4 runs, 3 of them next to two busy loops, passed with this exit path). So each rank, once
    its group is destroyed, checks in at the rendezvous store (torchrun's agent holds it, so it
    outlives every rank) and waits until all have before it exits."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    _, world = rank_and_world()
    dist.barrier()
    store = distributed_c10d._get_default_store()
    dist.destroy_process_group()
    store.add("polar/left", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("polar/left", 0) < world and time.monotonic() < deadline:
        time.sleep(0.02)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_model(model: torch.nn.Module, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """FSDP2: shard each transformer block, then the root (embeddings, final norm, tied lm_head).

    ``model`` is the module whose ``forward`` training calls (a ``TokenLogprobs`` wrapper), so that
    the root's parameters are gathered for exactly that call. ``param_dtype`` (bf16): mixed
    precision, the sharded float32 master weights are cast for compute when gathered and gradients
    are reduced in float32 (``MixedPrecisionPolicy``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    kw = {}
    if param_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    lm = getattr(model, "lm", model)
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """FSDP2: whether the next backward reduce-scatters gradients (off for all but the last
    micro-batch of an optimizer step: they accumulate unsharded locally). No-op without FSDP."""
    fn = getattr(model, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(enabled)


def shard_microbatches(microbatches: list[MicroBatch], rank: int, world: int) -> list[MicroBatch]:
    """This rank's micro-batches: longest-first to the least-loaded rank, then padded to equal count."""
    if world <= 1:
        return microbatches
    load = [0] * world
    owned: list[list[MicroBatch]] = [[] for _ in range(world)]
    for mb in sorted(microbatches, key=lambda m: -m.n_tokens):
        r = min(range(world), key=lambda i: (load[i], i))
        owned[r].append(mb)
        load[r] += mb.n_tokens
    most = max(len(o) for o in owned)
    mine = owned[rank]
    return mine + [padding_microbatch() for _ in range(most - len(mine))]


def all_reduce_dict(values: dict[str, float], op: str = "sum") -> dict[str, float]:
    if not is_distributed() or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return dict(zip(keys, t.cpu().tolist()))


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global grad norm (over all shards) before clipping; clips in place when finite ``max_norm``."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if math.isfinite(max_norm) else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def full_model_state_dict(model: torch.nn.Module, strip_prefix: str = "") -> dict[str, torch.Tensor] | None:
    """The unsharded weights on rank 0 (``None`` elsewhere); the plain state dict without FSDP."""
    if not is_distributed():
        sd = {k: v.detach() for k, v in model.state_dict().items()}
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_main():
            return None
    if strip_prefix:
        sd = {k.removeprefix(strip_prefix): v for k, v in sd.items()}
    return sd


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if not is_distributed():
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    if not is_distributed():
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients by parameter name (a collective under FSDP: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g.detach().cpu().clone()
    return out
