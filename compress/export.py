"""Write a deployable checkpoint: safetensors in the compressed-tensors layout.

Quantized linears become ``weight_packed`` (int32, packed by compressed-tensors),
``weight_scale``, ``weight_shape`` and, when asymmetric, a packed
``weight_zero_point``; config.json gets the ``quantization_config`` that
transformers and vLLM read. Everything is written to a temporary folder next to
the target and renamed at the end, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import kvcache, lowrank
from .quant import ActivationScheme, QuantizedWeight, QuantScheme, input_quant_of, quantized_of

MAX_SHARD_BYTES = 2 * 1024**3
MANIFEST = "compress_manifest.json"


class ExportError(RuntimeError):
    pass


def _ct_args(scheme: QuantScheme):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=scheme.bits, type="int", symmetric=scheme.symmetric,
        strategy="channel" if scheme.group_size == -1 else "group",
        group_size=None if scheme.group_size == -1 else scheme.group_size,
    )


def _activation_args(scheme: ActivationScheme):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=scheme.bits, type="int", symmetric=True, dynamic=True,
                            strategy="token" if scheme.per_token else "tensor")


def _int8_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """``int-quantized`` (W8A8): the int8 weight as it is, the layout int8 kernels read."""
    out = {f"{name}.weight": qw.q, f"{name}.weight_scale": qw.scale}
    if not qw.scheme.symmetric:
        out[f"{name}.weight_zero_point"] = qw.zero_point
    return out


def _packed_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {
        f"{name}.weight_packed": pack_to_int32(qw.q, qw.scheme.bits),
        f"{name}.weight_scale": qw.scale,
        f"{name}.weight_shape": torch.tensor(qw.q.shape),
    }
    if not qw.scheme.symmetric:
        out[f"{name}.weight_zero_point"] = pack_to_int32(qw.zero_point, qw.scheme.bits, packed_dim=0)
    return out


def _format(model: torch.nn.Module) -> str:
    """``int-quantized`` when activations are quantized too (W8A8), else ``pack-quantized``."""
    w8a8 = [name for name, m in model.named_modules() if input_quant_of(m) is not None]
    if not w8a8:
        return "pack-quantized"
    for name in w8a8:
        qw = quantized_of(model.get_submodule(name))
        if qw is None or qw.scheme.bits != 8:
            raise ExportError(f"{name} has int8 activations but {'dense' if qw is None else qw.scheme.describe()} "
                              "weights; W8A8 needs 8-bit weights on the same linears")
    return "int-quantized"


def quantization_config(model: torch.nn.Module) -> dict | None:
    """compressed-tensors config: one group per distinct scheme, every other linear ignored."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    by_scheme: dict[tuple[QuantScheme, ActivationScheme | None], list[str]] = {}
    dense_linears = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            qw = quantized_of(module)
            if qw is None:
                dense_linears.append(name)
            else:
                by_scheme.setdefault((qw.scheme, input_quant_of(module)), []).append(name)
    if not by_scheme:
        return None
    single = len(by_scheme) == 1
    groups = {
        f"group_{i}": QuantizationScheme(targets=["Linear"] if single else names, weights=_ct_args(scheme),
                                         input_activations=_activation_args(act) if act else None)
        for i, ((scheme, act), names) in enumerate(by_scheme.items())
    }
    config = QuantizationConfig(
        config_groups=groups, format=_format(model), quantization_status="compressed",
        ignore=dense_linears if single else [],
    )
    data = config.model_dump(exclude=["quant_method"])
    data.update(quant_method="compressed-tensors", version=compressed_tensors.__version__, sparsity_config={},
                transform_config={})
    return data


def _state_dict(model: torch.nn.Module):
    """(name, tensor) pairs to save: quantized linears packed, tied tensors once."""
    quantized = {name: qw for name, m in model.named_modules() if (qw := quantized_of(m)) is not None}
    tensors_of = _int8_tensors if _format(model) == "int-quantized" else _packed_tensors
    seen = set()
    for key, tensor in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if module in quantized:
            if leaf == "weight":
                yield from tensors_of(module, quantized[module]).items()
            continue
        if tensor.data_ptr() in seen:  # tied lm_head / embeddings
            continue
        seen.add(tensor.data_ptr())
        yield key, tensor


def _write_shards(model, folder: Path) -> list[str]:
    shards, current, size = [], {}, 0
    for key, tensor in _state_dict(model):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor.detach().cpu().contiguous()
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return ["model.safetensors"]
    names, index = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / fname, metadata={"format": "pt"})
        names.append(fname)
        index.update({k: fname for k in shard})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))
    return names


ADAPTER = "adapter"


def _write_adapter(model: torch.nn.Module, folder: Path) -> None:
    """Low-rank corrections kept on linears (``linear.lora = (B, A)``) as a PEFT LoRA adapter with
    scale 1 (lora_alpha = r): ``PeftModel.from_pretrained(base, folder / "adapter")`` applies it."""
    loras = {name: m.lora for name, m in model.named_modules() if getattr(m, "lora", None) is not None}
    if not loras:
        return
    from peft import LoraConfig

    ranks = {name: B.shape[1] for name, (B, _) in loras.items()}
    r = max(ranks.values())
    uneven = {n: k for n, k in ranks.items() if k != r}
    config = LoraConfig(r=r, lora_alpha=r, target_modules=sorted(loras), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", rank_pattern=uneven, alpha_pattern=uneven)
    (folder / ADAPTER).mkdir()
    config.save_pretrained(folder / ADAPTER)
    tensors = {}
    for name, (B, A) in loras.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = A.detach().cpu().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = B.detach().cpu().contiguous()
    save_file(tensors, folder / ADAPTER / "adapter_model.safetensors", metadata={"format": "pt"})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("compress", "torch", "transformers", "compressed-tensors", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def check_output(out: Path, overwrite: bool) -> None:
    """Fail before any compute when the output folder exists and --overwrite is not given."""
    if out.exists() and not overwrite:
        raise ExportError(f"output {out} exists; pass --overwrite or choose another --output")


def export(model, tokenizer, out: str | Path, recipe_text: str, manifest: dict, overwrite: bool = False) -> Path:
    out = Path(out)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _write_shards(model, tmp)
        _write_adapter(model, tmp)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        qconfig = quantization_config(model)
        if qconfig is not None:
            config["quantization_config"] = qconfig
        config.pop(lowrank.CONFIG_KEY, None)
        if ranks := lowrank.factored_ranks(model):
            config[lowrank.CONFIG_KEY] = ranks  # our loader (and docs/design.md's recipe) rebuild these layers
        config.pop(kvcache.CONFIG_KEY, None)
        if (kv := kvcache.scheme_of(model)) is not None:
            config[kvcache.CONFIG_KEY] = kvcache.config_entry(kv)  # our evaluator and decoder read it
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "recipe.yaml").write_text(recipe_text)
        files = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {**manifest, "versions": _versions(), "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / out.name)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def size_on_disk(folder: Path) -> int:
    """Bytes of weights: the checkpoint's safetensors and an adapter's, if any."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors"))
