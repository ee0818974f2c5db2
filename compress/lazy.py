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
from collections.abc import Callable
from pathlib import Path

import torch

from . import factored, hadamard, kv_fp8, kv_quant, moe
from .arch import arch_of, decoder_layers
from .formats import bitsandbytes, compressed_tensors, peft_adapter
from .formats.safetensors import Checkpoint, CheckpointError
from .quant import ActivationScheme, InputScale
from .state import drop_all


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
        quantized: compressed_tensors.Reader | bitsandbytes.Reader | None = None,
        adapter: peft_adapter.Reader | None = None,
    ):
        self.model, self.checkpoint = model, checkpoint
        self.dtype = dtype or model.dtype
        self.quantized, self.adapter = quantized, adapter
        self.prefix = arch_of(model).layers + "."
        self.resident = set(range(len(self.layers))) if checkpoint is None else set()
        self.on_read: Callable[[torch.nn.Module], None] | None = None  # each block as read (``rotate``)

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
        if self.on_read is not None:
            self.on_read(block)
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

    def check(self) -> None:
        """Every tensor the config's blocks need is in the checkpoint with the shape they need, and
        the checkpoint holds no block the config lacks: a broken folder is named before any compute
        (transformers would fill a missing tensor with random values and carry on)."""
        shapes = self.checkpoint.shapes()
        for i, block in enumerate(self.layers):
            wanted, _ = self._plan(block, f"{self.prefix}{i}.")
            for _, _, sub, leaf, scheme, keys in wanted:
                need, has = tuple(sub._parameters[leaf].shape), tuple(shapes[keys[0]])
                if scheme is None and has != need:  # packed weights: their shapes are checked as read
                    raise CheckpointError(f"{self.checkpoint.folder}: {keys[0]} is {has}, the config says {need}")
        extra = f"{self.prefix}{len(self.layers)}."
        if any(k.startswith(extra) for k in shapes):
            raise CheckpointError(
                f"{self.checkpoint.folder} holds more blocks than its config's {len(self.layers)} "
                f"({extra.rstrip('.')} and on): fix num_hidden_layers in config.json or re-download the model"
            )

    def _plan(self, module: torch.nn.Module, prefix: str, recurse: bool = True):
        """What reading ``module`` takes: (module name, its name on disk, module, leaf, quantization
        scheme or None, checkpoint keys) per parameter, and (module name, module, the keys of its
        calibrated scales, the state they make); a tensor missing from the checkpoint is an error."""
        ckpt = self.checkpoint
        subs = module.named_modules(prefix=prefix.rstrip(".")) if recurse else [(prefix.rstrip("."), module)]
        renames = moe.checkpoint_renames(module, prefix)  # Mixtral's experts are under another name on disk
        wanted = []  # (module name, its name on disk, module, leaf, quantization scheme or None, checkpoint keys)
        wanted_scales = []  # (module name, module, its calibrated scales' keys, the state they make)
        for name, sub in subs:
            scheme = self.quantized.scheme_of(name, sub) if self.quantized else None
            stored = moe.renamed(name, renames)
            if scheme is not None and (act := ActivationScheme.of(sub)) is not None and act.calibrated:
                wanted_scales.append((name, sub, self.quantized.input_keys(stored, ckpt), InputScale))
            if getattr(self.quantized, "fp8_kv_cache", False) and kv_quant.is_attention(sub):
                wanted_scales.append((name, sub, [f"{stored}.k_scale", f"{stored}.v_scale"], kv_fp8.KVScale))
            for leaf, _ in sub.named_parameters(recurse=False):
                if leaf == "weight" and scheme is not None:  # decompressed as its library does it
                    keys = self.quantized.keys(stored, ckpt)
                else:
                    keys = [f"{stored}.{leaf}"]
                if keys[0] not in ckpt:
                    raise CheckpointError(f"{ckpt.folder} has no tensor {keys[0]} (a checkpoint of another model?)")
                wanted.append((name, stored, sub, leaf, scheme if leaf == "weight" else None, keys))
        for name, _, keys, _ in wanted_scales:
            if not keys or any(k not in ckpt for k in keys):
                raise CheckpointError(f"{ckpt.folder} lacks the calibrated scales of {name} that its config names")
        return wanted, wanted_scales

    def read(self, module: torch.nn.Module, prefix: str, recurse: bool = True) -> None:
        """Give ``module``'s parameters their values from the checkpoint (CPU, the storage dtype),
        all read in one pass over the files."""
        ckpt = self.checkpoint
        wanted, wanted_scales = self._plan(module, prefix, recurse)
        scale_keys = [k for _, _, keys, _ in wanted_scales for k in keys]
        tensors = ckpt.read([k for *_, keys in wanted for k in keys] + scale_keys)
        for _, sub, keys, kind in wanted_scales:
            kind(*(tensors.pop(k) for k in keys)).attach(sub)
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
    drop_all(module)
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
        try:
            quantized = compressed_tensors.Reader(qconfig)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
    elif method == "bitsandbytes":
        quantized = bitsandbytes.Reader(qconfig, checkpoint)
    elif qconfig is not None:
        raise CheckpointError(
            f"{where}: quantization method {method!r} cannot be read here "
            "(compressed-tensors and bitsandbytes 4-bit exports and plain checkpoints can)"
        )
    else:
        quantized = None
    adapter = peft_adapter.Reader(where / "adapter") if (where / "adapter" / "adapter_config.json").exists() else None
    streamed = StreamedModel(model, checkpoint, dtype, quantized, adapter)
    if isinstance(quantized, compressed_tensors.Reader):  # before any read: calibrated input scales come with a block
        _quantize_inputs(model, quantized)
    streamed.check()
    layers = streamed.prefix.rstrip(".")
    for name, sub in model.named_modules():
        if name != layers and not name.startswith(layers + ".") and sub._parameters:
            if name == "lm_head" and "lm_head.weight" not in streamed.checkpoint and config.tie_word_embeddings:
                continue
            streamed.read(sub, name, recurse=False)
    model.tie_weights()
    if (kv := getattr(config, kv_quant.CONFIG_KEY, None)) is not None:
        kv_quant.install(model, {k: v for k, v in kv.items() if k != "method"})
    if (where / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(where)
    model.eval()
    return streamed


def _quantize_inputs(model: torch.nn.Module, quantized: compressed_tensors.Reader) -> None:
    """Exports with quantized inputs (W8A8, FP8, W4AFP8, NVFP4, MXFP4, W4A8, W4A4) or inputs rotated
    online: their linears see them rotated and rounded as our evaluation did before export
    (calibrated scales are read with the blocks)."""
    for name, module in model.named_modules():
        if name in quantized.rotations:
            if quantized.rotations[name] != hadamard.block_size(module.in_features):
                raise CheckpointError(
                    f"{name}: a Hadamard block of {quantized.rotations[name]}; we write and read "
                    f"the largest power of two dividing its width, {hadamard.block_size(module.in_features)}"
                )
            hadamard.InputRotation().attach(module)
        if (scheme := quantized.input_scheme(name, module)) is not None:
            scheme.attach(module)
