"""PEFT's LoRA adapter: the corrections kept on linears (``state.LoRA``) written as an adapter folder
beside the base weights, with scale 1 (``lora_alpha = r``), so that
``PeftModel.from_pretrained(base, folder / "adapter")`` applies them; read back merged into each
weight as peft's ``merge_and_unload`` would."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..state import LoRA
from .safetensors import Checkpoint, umask

ADAPTER = "adapter"


def write(loras: dict[str, LoRA], folder: Path) -> None:
    """``folder / "adapter"`` holding ``loras`` (linear name -> its correction); nothing when empty."""
    if not loras:
        return
    from peft import LoraConfig

    ranks = {name: lora.B.shape[1] for name, lora in loras.items()}
    r = max(ranks.values())
    uneven = {n: k for n, k in ranks.items() if k != r}
    config = LoraConfig(
        r=r,
        lora_alpha=r,
        target_modules=sorted(loras),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        rank_pattern=uneven,
        alpha_pattern=uneven,
    )
    (folder / ADAPTER).mkdir()
    config.save_pretrained(folder / ADAPTER)
    tensors = {}
    for name, lora in loras.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = lora.A.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = lora.B.detach().cpu().contiguous()
    weights = folder / ADAPTER / "adapter_model.safetensors"
    save_file(tensors, weights, metadata={"format": "pt"})
    weights.chmod(0o666 & ~umask())  # safetensors writes it private (0600); readable as its neighbours


class Reader:
    """An exported LoRA adapter (LoRC, QLoRA), merged into each linear as it is read, as peft's
    ``merge_and_unload`` would: ``W + (B @ A) * alpha / r`` in float32, rounded once."""

    def __init__(self, folder: Path):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        self.r, self.alpha = cfg["r"], cfg.get("lora_alpha", cfg["r"])
        self.rank_pattern, self.alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
        self.checkpoint = Checkpoint(folder)

    def merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        a, b = f"base_model.model.{name}.lora_A.weight", f"base_model.model.{name}.lora_B.weight"
        if a not in self.checkpoint:
            return weight
        t = self.checkpoint.read([a, b])
        scaling = self.alpha_pattern.get(name, self.alpha) / self.rank_pattern.get(name, self.r)
        return (weight.float() + (t[b].float() @ t[a].float()) * scaling).to(weight.dtype)
