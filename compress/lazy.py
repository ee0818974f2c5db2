"""A model whose decoder blocks stay on disk until they are needed.

``open_model`` builds the model's skeleton without weights (the meta device), reads
the tensors outside the decoder blocks (embeddings, final norm, head) at once, and
reads one block's tensors from the checkpoint's safetensors files when
``StreamedModel.block(i)`` is entered; leaving it frees them again. So compressing or
evaluating a 70B model needs the memory of one block, not of the model.

Our own exports read back as ``models.load_model`` reads them: packed weights are
dequantized with compressed-tensors' own code, factored layers are rebuilt, an
exported LoRA adapter is merged into its linear, W8A8 linears quantize their inputs,
a quantized KV cache is marked on the attention modules.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from . import factored, kv_quant, moe
from .arch import arch_of, decoder_layers
from .quant import ActivationScheme, quantize_inputs

# what passes leave on a linear besides its weight (quant.attach, sparsity.apply_mask, LoRC):
# dropped with the block's tensors
_RECORDS = ("quantized", "prune_mask", "lora", "bnb_4bit")


class CheckpointError(RuntimeError):
    pass


class Checkpoint:
    """The tensors of a safetensors checkpoint (one file, or shards listed by an index), by name.

    Files are opened for each read and closed after it: a memory map kept open would count
    every page ever read in the process's resident memory."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.file_of = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder} has no *.safetensors file (only safetensors checkpoints are read)")
            self.file_of = {}
            for f in files:
                with self._open(f) as st:
                    self.file_of.update({k: f for k in st.keys()})

    def _open(self, path: Path):
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({e}); re-download or re-export it"
            ) from None

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def read(self, keys) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.file_of[k], []).append(k)
        out = {}
        for path, names in by_file.items():
            with self._open(path) as st:
                for k in names:
                    out[k] = st.get_tensor(k).clone()  # our own memory, not a view of the file's map
        return out


class _CompressedTensors:
    """How an export of the compressed-tensors layout stores each quantized linear."""

    def __init__(self, qconfig: dict):
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig.model_validate(qconfig)
        self.format = config.format
        self.compressor = BaseCompressor.get_value_from_registry(config.format)
        self.ignore = set(config.ignore or [])
        self.groups = list(config.config_groups.values())

    def scheme_of(self, name: str, module: torch.nn.Module):
        if not isinstance(module, torch.nn.Linear) or name in self.ignore:
            return None
        for scheme in self.groups:
            for target in scheme.targets:
                regex = target.startswith("re:") and re.fullmatch(target[3:], name)
                if target == "Linear" or target == name or regex:
                    return scheme
        return None

    def keys(self, stored: str, checkpoint: Checkpoint) -> list[str]:
        return [f"{stored}.{k}" for k in _QUANTIZED_PARTS if f"{stored}.{k}" in checkpoint]

    def weight(self, tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
        return self.compressor.decompress(tensors, scheme)["weight"]


class _Bitsandbytes4bit:
    """An export whose linears are stored as transformers saves a ``load_in_4bit`` model (QLoRA's
    ``base: nf4``): each dequantized by bitsandbytes' own code."""

    format = "bitsandbytes-4bit"

    def __init__(self, qconfig: dict, checkpoint: Checkpoint):
        if not qconfig.get("load_in_4bit"):
            raise CheckpointError(f"{checkpoint.folder}: bitsandbytes 8-bit checkpoints cannot be read (4-bit can)")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise CheckpointError(f"{checkpoint.folder} holds bitsandbytes 4-bit weights: pip install bitsandbytes")
        self.checkpoint = checkpoint

    def scheme_of(self, name: str, module: torch.nn.Module) -> bool | None:
        """True for a linear stored in 4 bits (its block scales are there), None for a dense one."""
        if isinstance(module, torch.nn.Linear) and f"{name}.weight.absmax" in self.checkpoint:
            return True
        return None

    def keys(self, stored: str, checkpoint: Checkpoint) -> list[str]:
        return [f"{stored}.weight"] + [k for k in checkpoint.file_of if k.startswith(f"{stored}.weight.")]

    def weight(self, tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
        from . import bnb

        return bnb.dequantize_4bit(tensors)


class _Adapter:
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


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class StreamedModel:
    """A transformers model whose blocks are read from ``checkpoint`` one at a time.

    ``checkpoint`` None: every tensor is in memory already (a model loaded whole, as the
    recovery passes need it) and ``block(i)`` just hands the block over: one code path
    serves both."""

    def __init__(
        self,
        model: torch.nn.Module,
        checkpoint: Checkpoint | None = None,
        dtype: torch.dtype | None = None,
        quantized: _CompressedTensors | _Bitsandbytes4bit | None = None,
        adapter: _Adapter | None = None,
    ):
        self.model, self.checkpoint = model, checkpoint
        self.dtype = dtype or model.dtype
        self.quantized, self.adapter = quantized, adapter
        self.prefix = arch_of(model).layers + "."
        self.resident = set(range(len(self.layers))) if checkpoint is None else set()

    @property
    def layers(self) -> torch.nn.ModuleList:
        return decoder_layers(self.model)

    @property
    def config(self):
        return self.model.config

    def __len__(self) -> int:
        return len(self.layers)

    @contextlib.contextmanager
    def block(self, i: int, keep: bool = False):
        """Block ``i`` with its tensors read; freed on exit unless it was resident or ``keep``."""
        block = self.layers[i]
        if i in self.resident:
            yield block
            return
        self.read(block, f"{self.prefix}{i}.")
        try:
            yield block
        finally:
            if keep:
                self.resident.add(i)
            else:
                release(block)

    def load_all(self) -> torch.nn.Module:
        """Read every block and keep it (recovery training and data-free calibration need the whole model)."""
        for i in range(len(self)):
            with self.block(i, keep=True):
                pass
        return self.model

    def read(self, module: torch.nn.Module, prefix: str, recurse: bool = True) -> None:
        """Give ``module``'s parameters their values from the checkpoint (CPU, the storage dtype),
        all read in one pass over the files."""
        ckpt = self.checkpoint
        subs = module.named_modules(prefix=prefix.rstrip(".")) if recurse else [(prefix.rstrip("."), module)]
        renames = moe.checkpoint_renames(module, prefix)  # Mixtral's experts are under another name on disk
        wanted = []  # (module name, its name on disk, module, leaf, quantization scheme or None, checkpoint keys)
        for name, sub in subs:
            scheme = self.quantized.scheme_of(name, sub) if self.quantized else None
            stored = moe.renamed(name, renames)
            for leaf, _ in sub.named_parameters(recurse=False):
                if leaf == "weight" and scheme is not None:  # decompressed as its library does it
                    keys = self.quantized.keys(stored, ckpt)
                else:
                    keys = [f"{stored}.{leaf}"]
                if keys[0] not in ckpt:
                    raise CheckpointError(f"{ckpt.folder} has no tensor {keys[0]} (a checkpoint of another model?)")
                wanted.append((name, stored, sub, leaf, scheme if leaf == "weight" else None, keys))
        tensors = ckpt.read([k for *_, keys in wanted for k in keys])
        for name, stored, sub, leaf, scheme, keys in wanted:
            if scheme is not None:
                value = self.quantized.weight({k[len(stored) + 1 :]: tensors.pop(k) for k in keys}, scheme)
            else:
                value = tensors.pop(keys[0])
            if leaf == "weight" and self.adapter is not None:
                value = self.adapter.merge(name, value)
            p = sub._parameters[leaf]
            if tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{ckpt.folder}: {name}.{leaf} has shape {tuple(value.shape)}, the config says {tuple(p.shape)}"
                )
            value = value.to(self.dtype) if value.is_floating_point() else value
            sub._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


_QUANTIZED_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


def streamed(model) -> StreamedModel:
    """``model`` as a ``StreamedModel``: a plain transformers model counts as all read."""
    return model if isinstance(model, StreamedModel) else StreamedModel(model)


def release(module: torch.nn.Module) -> None:
    """Free ``module``'s tensors: parameters become meta tensors of the same shape and dtype, and
    what passes recorded on its linears goes too. Structure and hooks stay."""
    for sub in module.modules():
        for leaf, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[leaf] = torch.nn.Parameter(_meta_like(p), requires_grad=False)
        for attr in _RECORDS:
            sub.__dict__.pop(attr, None)
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Give the freed block back to the system. glibc serves tensors under its (self-raising)
    mmap threshold from the heap and keeps their pages after ``free``: without this, resident
    memory grew by ~18 MB per block read and freed (Llama-3-8B widths, a throwaway loop), and a
    whole apply peaked at 12.7 GB with 56 layers against 7.6 GB with 2 (bench_scale.py).
    A no-op where the C library has no ``malloc_trim``."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


def open_model(where: Path, dtype: torch.dtype, trust_remote_code: bool = False) -> StreamedModel:
    """The skeleton of the model in ``where``, with everything but its decoder blocks read."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    qconfig = getattr(config, "quantization_config", None)
    if qconfig is not None:
        qconfig = qconfig if isinstance(qconfig, dict) else qconfig.to_dict()
        del config.quantization_config  # we dequantize as we read; the model is built plain
    with init_empty_weights():  # parameters on meta; buffers (rotary tables) computed for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    if (ranks := getattr(config, factored.CONFIG_KEY, None)) is not None:
        factored.install(model, ranks)
    checkpoint, method = Checkpoint(where), qconfig and qconfig.get("quant_method")
    if method == "compressed-tensors":
        quantized = _CompressedTensors(qconfig)
    elif method == "bitsandbytes":
        quantized = _Bitsandbytes4bit(qconfig, checkpoint)
    elif qconfig is not None:
        raise CheckpointError(
            f"{where}: quantization method {method!r} cannot be read here "
            "(compressed-tensors and bitsandbytes 4-bit exports and plain checkpoints can)"
        )
    else:
        quantized = None
    adapter = _Adapter(where / "adapter") if (where / "adapter" / "adapter_config.json").exists() else None
    streamed = StreamedModel(model, checkpoint, dtype, quantized, adapter)
    layers = streamed.prefix.rstrip(".")
    for name, sub in model.named_modules():
        if name != layers and not name.startswith(layers + ".") and sub._parameters:
            if name == "lm_head" and "lm_head.weight" not in streamed.checkpoint and config.tie_word_embeddings:
                continue
            streamed.read(sub, name, recurse=False)
    model.tie_weights()
    if quantized is not None and quantized.format == "int-quantized":
        _quantize_inputs(model, quantized)
    if (kv := getattr(config, kv_quant.CONFIG_KEY, None)) is not None:
        kv_quant.install(model, {k: v for k, v in kv.items() if k != "method"})
    if (where / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(where)
    model.eval()
    return streamed


def _quantize_inputs(model: torch.nn.Module, quantized: _CompressedTensors) -> None:
    """W8A8 exports: their linears see int8 inputs, as our evaluation simulated them before export."""
    for name, module in model.named_modules():
        scheme = quantized.scheme_of(name, module)
        if scheme is not None and scheme.input_activations is not None:
            act = scheme.input_activations
            quantize_inputs(module, ActivationScheme(act.num_bits, per_token=act.strategy == "token"))
