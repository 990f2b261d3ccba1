"""Checkpoints that vLLM can serve and the trainer can resume from.

Layout of ``<out>/step-000007/``::

    config.json, model.safetensors      save_pretrained (safetensors), what vLLM loads
    tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, special_tokens_map.json,
    chat_template.jinja, generation_config.json     copied from the base model, unchanged, so
                                        the served chat template and sampling defaults stay the same
    trainer_state.pt                    optimizer, scheduler, step, RNG states, train config
    polar_checkpoint.json               step / policy_version, base model, time, last metrics
    adapter_model.safetensors           LoRA runs only: the adapters (model.safetensors has them merged)

A LoRA run saved with ``--lora-save adapter`` has no ``config.json``/``model.safetensors``: it is a
PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors`` under PEFT's names)
plus the files above, served on the base model by vLLM with ``--enable-lora``.

A checkpoint is written into a temporary sibling directory and renamed into place, so a reader
(vLLM reloading weights, a resumed run) never sees half of one. ``<out>/latest`` names the newest.

Tied embeddings are saved *untied* (``tie_word_embeddings: false`` and an explicit
``lm_head.weight`` equal to the input embedding), which computes exactly the same function. The
reason is vLLM's in-place reload (0.32): its layer-wise reloader skips ``lm_head`` for tied models
and puts the old tensor back, so a tied model would keep serving its old output projection. An
untied checkpoint reloads exactly; :func:`servable_copy` makes such a copy of the base model for
the server to start from. The trainer re-ties on load (``tied_embeddings`` in the metadata), so
training dynamics do not change.

``polar_checkpoint.json`` also carries a *probe*: a short token sequence and the logprobs the
trainer's weights give it, which :mod:`polar_training.weights_push` compares with the server's
``prompt_logprobs`` to prove that the served weights are these.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from . import distributed as pdist

#: Files besides the weights that make a model directory servable with the same template.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
)
META_FILE = "polar_checkpoint.json"
STATE_FILE = "trainer_state.pt"
LATEST_FILE = "latest"
ADAPTER_FILE = "adapter_model.safetensors"  # LoRA runs: the adapters alone (the weights file is merged)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        p = Path(src) / name
        if p.is_file():
            shutil.copy2(p, Path(dst) / name)
            copied.append(name)
    return copied


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else {}


def base_model_of(model_dir: str | os.PathLike) -> str:
    """The original model a checkpoint descends from (itself when it is not a checkpoint)."""
    return read_meta(model_dir).get("base_model") or str(model_dir)


def _embedding_keys(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """State-dict names of the input embedding and output projection weights."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    outp = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    k_in = f"{names[id(inp)]}.weight" if inp is not None and id(inp) in names else None
    k_out = f"{names[id(outp)]}.weight" if outp is not None and id(outp) in names else None
    return k_in, k_out


def is_tied(model: torch.nn.Module) -> bool:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(cfg, "tie_word_embeddings", False))


def _set_tied(model: torch.nn.Module, value: bool) -> None:
    model.config.tie_word_embeddings = value
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = value


def retie_if_trained_tied(model: torch.nn.Module, model_dir: str | os.PathLike) -> torch.nn.Module:
    """Undo the untied *format* of our checkpoints when the trained model had tied embeddings."""
    if read_meta(model_dir).get("tied_embeddings") and not is_tied(model):
        _set_tied(model, True)
        model.tie_weights()
    return model


@torch.no_grad()
def probe_logprobs(policy: torch.nn.Module, ids: list[int]) -> list[float]:
    """Logprob of each probe token given the ones before it (collective under FSDP).

    ``policy`` is the trainer's ``TokenLogprobs`` module (or a causal LM, wrapped on the fly).
    """
    from .policy import TokenLogprobs

    if not isinstance(policy, TokenLogprobs):
        policy = TokenLogprobs(policy)
    dev = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()
    n = len(ids)
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    pos = torch.arange(n, device=dev)[None]
    logp, _ = policy(x, pos, torch.arange(n - 1, device=dev), x[0, 1:])
    policy.train(was_training)
    return logp.cpu().tolist()


def save_checkpoint(
    out_dir: str | os.PathLike,
    model: torch.nn.Module,
    tokenizer_dir: str | os.PathLike,
    trainer_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    probe_ids: list[int] | None = None,
    update_latest: bool = True,
    policy: torch.nn.Module | None = None,
    probe_before: list[float] | None = None,
    adapter_only: bool = False,
) -> Path:
    """Write ``out_dir`` atomically (collective under FSDP: call on every rank; rank 0 writes).

    ``policy``: the trainer's (possibly sharded) ``TokenLogprobs`` wrapping ``model``; weights and
    the probe are then taken through it. ``adapter_only`` (a LoRA model, ``--lora-save adapter``):
    the checkpoint is a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``
    under PEFT's names) with no full weights; vLLM serves it on the base model with ``--enable-lora``.
    """
    from . import lora

    out = Path(out_dir)
    adapter = None
    state_dict: dict[str, Any] = {}
    if adapter_only and not lora.is_lora(model):
        raise ValueError("adapter_only needs a LoRA model")
    if adapter_only:
        pass  # the adapters alone, written below
    elif lora.is_lora(model):  # vLLM gets the adapters merged into the base weights (lora.py says why)
        state_dict = lora.merged_state_dict(model)
        adapter = lora.adapter_state_dict(model) if trainer_state is not None else None
    elif policy is not None:
        state_dict = pdist.full_model_state_dict(policy, strip_prefix="lm.")  # collective
    else:
        state_dict = pdist.full_model_state_dict(model)
    probe = None
    if probe_ids:
        probe = {"ids": list(probe_ids), "logprobs": probe_logprobs(policy or model, list(probe_ids))}
        if probe_before is not None:  # the parent weights' logprobs: a no-op reload must not verify
            probe["logprobs_before"] = list(probe_before)
    if not pdist.is_main():
        return out
    tied = is_tied(model)
    if tied and not adapter_only:
        k_in, k_out = _embedding_keys(model)
        if k_in and k_out:
            state_dict = dict(state_dict)
            state_dict[k_out] = state_dict[k_in].detach().clone()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if adapter_only:
            lora.save_peft_adapter(model, tmp, base_model=(meta or {}).get("lora_base") or str(tokenizer_dir))
        else:
            _set_tied(model, False)
            try:
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            finally:
                _set_tied(model, tied)
        copy_tokenizer_files(tokenizer_dir, tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / STATE_FILE)
        if adapter is not None:  # a resumed LoRA run continues from the base model and these
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in adapter.items()}, str(tmp / ADAPTER_FILE))
        info: dict[str, Any] = {
            "saved_at": time.time(),
            "format": "safetensors",
            "tied_embeddings": tied,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        }
        if probe:
            info["probe"] = probe
        info.update(meta or {})
        (tmp / META_FILE).write_text(json.dumps(info, indent=2, default=str))
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if update_latest:
        (out.parent / LATEST_FILE).write_text(out.name + "\n")
    return out


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of a run directory (``latest`` pointer, else the highest step)."""
    run = Path(run_dir)
    pointer = run / LATEST_FILE
    if pointer.is_file():
        cand = run / pointer.read_text().strip()
        if _is_checkpoint(cand):
            return cand
    steps = sorted(p for p in run.glob("step-*") if _is_checkpoint(p))
    return steps[-1] if steps else None


def _is_checkpoint(path: Path) -> bool:
    """A complete checkpoint: a model's config, or a LoRA adapter's (``--lora-save adapter``)."""
    return (path / "config.json").is_file() or (path / "adapter_config.json").is_file()


def resolve_resume(resume: str | os.PathLike) -> Path:
    """A checkpoint directory, or a run directory whose latest checkpoint is meant."""
    p = Path(resume)
    if (p / STATE_FILE).is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None or not (latest / STATE_FILE).is_file():
        raise FileNotFoundError(f"no resumable checkpoint (with {STATE_FILE}) in {p}")
    return latest


def load_trainer_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    return torch.load(Path(checkpoint_dir) / STATE_FILE, map_location="cpu", weights_only=False)


def servable_copy(model_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None) -> Path:
    """A copy of a base model that vLLM can later reload in place (untied, probe included).

    Returns ``model_dir`` itself when its embeddings are not tied (nothing to change).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return Path(model_dir)
    out = Path(out_dir)
    if (out / META_FILE).is_file() and read_meta(out).get("source") == str(Path(model_dir).resolve()):
        return out
    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {"dtype": "auto"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, **kwargs)
    save_checkpoint(out, model, model_dir, meta={"source": str(Path(model_dir).resolve()), "policy_version": 0},
        update_latest=False,
    )
    return out
