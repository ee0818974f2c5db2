"""An EAGLE draft head beside the model it drafts for: ``eagle/`` in the export, in EAGLE-1's layout.

``eagle/model.safetensors`` holds ``fc.weight`` and ``layers.0.*`` (a Llama decoder layer without
its input norm) as the published EAGLE-1 heads do, which vLLM's ``method: eagle`` loads
(``speculative_config={"method": "eagle", "model": "OUT/eagle"}``; the embedding and lm_head are
the target's, shared, so the head holds neither), plus ``draft_tokens``, the reduced vocabulary our
decoder drafts from (vLLM drafts over the whole vocabulary and does not read it).
``eagle/config.json`` is the Llama config of that one layer, with our ``eagle`` entry: the
draft vocabulary and how the head was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..eagle import EagleHead, HeadConfig

FOLDER = "eagle"


class HeadFormatError(ValueError):
    """A folder that does not hold a head we can read; the message says what is wrong."""


def write(head: EagleHead, folder: Path, log: dict) -> Path:
    """``folder / "eagle"``: the head's tensors and config (inside an export's temporary folder,
    so the export's atomic rename publishes it with the model)."""
    c = head.config
    out = folder / FOLDER
    out.mkdir()
    tensors = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.eps,
        "rope_theta": c.rope_theta,
        "hidden_act": "silu",
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "eagle": {"version": 1, "head": c.to_dict(), "training": log},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return out


def find(path: str | Path) -> Path | None:
    """The head folder at ``path``: the folder itself, or its ``eagle/`` (an export); None if neither."""
    path = Path(path)
    for folder in (path, path / FOLDER):
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            if "eagle" in json.loads((folder / "config.json").read_text()):
                return folder
    return None


def read(path: str | Path) -> EagleHead:
    """The head saved at ``path`` (a head folder or an export holding one), in float32."""
    folder = find(path)
    if folder is None:
        raise HeadFormatError(f"{path} holds no EAGLE head (an eagle/ folder with config.json and model.safetensors)")
    try:
        config = HeadConfig(**json.loads((folder / "config.json").read_text())["eagle"]["head"])
        tensors = load_file(folder / "model.safetensors")
    except (KeyError, TypeError, ValueError, SafetensorError) as e:
        raise HeadFormatError(f"{folder} is not a head this version reads ({type(e).__name__}: {e})") from None
    head = EagleHead(config, tensors.get("draft_tokens"))
    missing, unexpected = head.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=False
    )
    if missing or unexpected:
        raise HeadFormatError(f"{folder}: tensors missing {missing[:3]} or unexpected {unexpected[:3]}")
    return head.eval().requires_grad_(False)


def load_matching(path: str | Path, model_config) -> EagleHead:
    """``read``, refusing a head trained for another model in one line."""
    head = read(path)
    if (why := head.config.problem(model_config)) is not None:
        raise HeadFormatError(f"the EAGLE head in {path} was trained for another model: it has {why}")
    return head
