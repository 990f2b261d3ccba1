"""LoRA for the GRPO trainer (peft): low-rank adapters trained, the base weights frozen.

``apply_lora`` injects peft's LoRA layers into the Hugging Face model in place and freezes
everything else, so :class:`~polar_training.trainer.GRPOTrainer` (which optimizes the parameters
that require a gradient) gives AdamW only the adapters: on the 0.5B at rank 16 on every
projection, 8.8M trainable parameters instead of 630M, i.e. AdamW moments and gradients of ~100 MB
instead of 7.0 GiB (the figures are in ``benchmarks/history/lora.md``, "LoRA against full fine-tuning").

How vLLM gets the policy: *merged before the push*. ``merged_state_dict`` adds each adapter's
``B A * alpha / r`` to its frozen base weight without touching the model (peft's ``merge_adapter``
/ ``unmerge_adapter`` round trip would add and subtract in float32 and drift a little at every
push), under the base model's own parameter names, so the handoff directory is an ordinary
servable model: the same in-place reload, the same probe check, no ``--enable-lora`` on the server.
The alternative, one vLLM LoRA adapter per policy version (``--enable-lora`` and
``/v1/load_lora_adapter``), moves only the adapter but makes every decode step pay for the
adapter's extra matmuls and caps the rank at ``--max-lora-rank``; the benchmark compares them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

#: Every attention and MLP projection of a Qwen2/Llama-style decoder.
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"


@dataclass
class LoraSettings:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, not {self.rank}")
        self.targets = tuple(self.targets)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` (in place) and freeze all but the adapters; returns ``model``
    (the Hugging Face model itself, not a PeftModel wrapper: the trainer calls its decoder)."""
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                     target_modules=list(settings.targets), bias="none")
    model = inject_adapter_in_model(cfg, model, adapter_name=ADAPTER)
    n = 0
    for name, p in model.named_parameters():
        trainable = "lora_" in name
        p.requires_grad_(trainable)
        n += p.numel() if trainable else 0
    if n == 0:
        raise ValueError(f"no LoRA target among the model's modules ({', '.join(settings.targets)})")
    model.polar_lora = settings  # type: ignore[attr-defined]
    return model


def is_lora(model: torch.nn.Module) -> bool:
    return getattr(model, "polar_lora", None) is not None


def trainable_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter merged in: ``W + B A * alpha / r`` under the
    base names (``...q_proj.weight``), adapter tensors left out. The model is not modified."""
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            owner = key.split(".base_layer.")[0]
            name = key.replace(".base_layer.", ".")
            if key.endswith(".weight") and owner in layers and ADAPTER in layers[owner].lora_A:
                # W + s B A in one pass (peft's get_delta_weight, then an add, took 3.5x as long:
                # 16.5 vs 4.6 s for the 0.5B's 168 adapted weights on a loaded 2-core machine)
                layer = layers[owner]
                value = torch.addmm(value, layer.lora_B[ADAPTER].weight.to(value.dtype),
                                    layer.lora_A[ADAPTER].weight.to(value.dtype), alpha=layer.scaling[ADAPTER])
            out[name] = value
        else:
            out[key] = value
    return out


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone (what a resumed LoRA run or vLLM's ``--enable-lora`` needs)."""
    return {k: v.detach() for k, v in model.state_dict().items() if ".lora_" in k}


#: ``--lora-save``: how a LoRA run's checkpoints hold the policy
LORA_SAVE = ("merged", "adapter")
PEFT_PREFIX = "base_model.model."


def peft_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's file names (``base_model.model.<module>.lora_A.weight``: no
    adapter name), what ``PeftModel.from_pretrained`` and vLLM's ``--enable-lora`` read."""
    out = {}
    for k, v in adapter_state_dict(model).items():
        out[PEFT_PREFIX + k.replace(f".{ADAPTER}.", ".")] = v.contiguous()
    return out


def from_peft_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's names back to the injected model's (``...lora_A.default.weight``); ours pass as they are."""
    out = {}
    for k, v in sd.items():
        if k.startswith(PEFT_PREFIX):
            k = k[len(PEFT_PREFIX):]
            for part in ("lora_A", "lora_B"):
                k = k.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[k] = v
    return out


def save_peft_adapter(model: torch.nn.Module, out_dir: Any, base_model: str) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``out_dir`` (PEFT's
    adapter directory: ``vllm serve BASE --enable-lora --lora-modules NAME=DIR``, or
    ``POST /v1/load_lora_adapter``). The base weights are not written: a step costs the adapters'
    megabytes instead of the model's gigabytes."""
    from pathlib import Path

    from peft import LoraConfig
    from safetensors.torch import save_file

    s: LoraSettings = model.polar_lora  # type: ignore[attr-defined]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout, target_modules=list(s.targets),
                     bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base_model))
    cfg.save_pretrained(str(out))
    save_file(peft_state_dict(model), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
