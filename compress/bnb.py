"""bitsandbytes baselines: a model as ``load_in_4bit`` / ``load_in_8bit`` gives it, scored by our
evaluation.

Many users compare any 4-bit method with what one line of transformers gives them: the weights
rounded by bitsandbytes when the model loads (NF4 or FP4 in blocks of 64, optionally with the
block scales themselves quantized, "double quantization", as the QLoRA paper does; or LLM.int8,
int8 rows with the outlier input columns kept in 16 bits). So the model is loaded exactly that
way, through transformers' ``BitsAndBytesConfig`` (bitsandbytes' own modules, lm_head kept dense
as transformers keeps it), and scored on the same windows as every other row: the rows are
comparable because the only thing that differs is who rounded the weights. Nothing is exported:
these formats are not compressed-tensors ones, and transformers reloads them only through
bitsandbytes.

The QLoRA pass's ``base: nf4`` rounds the weights with the same bitsandbytes call
(``round_4bit``) and exports them as transformers serializes a ``load_in_4bit`` model
(``export_tensors``, ``export_config``), so that ``from_pretrained`` loads the export as
``Linear4bit`` modules and peft puts the adapter on them, as QLoRA's users do.
"""

from __future__ import annotations

import functools
import json
import logging

import torch

from . import lazy, models

# scheme -> BitsAndBytesConfig keywords (compute dtype added at load)
SCHEMES = {
    "nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "nf4-double": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
    "int8": {"load_in_8bit": True},  # LLM.int8(): outlier threshold 6.0, transformers' default
}


def load(source: str, scheme: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> models.Loaded:
    """``source`` (an alias or a local Hugging Face folder of a dense model) quantized by
    bitsandbytes on load, on ``device``, as a ``lazy.StreamedModel`` held whole, and its tokenizer.
    bitsandbytes multiplies in our evaluation's compute dtype (fp32 on the CPU)."""
    if scheme not in SCHEMES:
        raise models.ModelLoadError(f"--bitsandbytes {scheme}: choose one of {', '.join(SCHEMES)}")
    folder = models.local_folder(source)
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        raise models.ModelLoadError(
            f"--bitsandbytes rounds a dense model's weights; {source} is already quantized "
            f"({config['quantization_config'].get('quant_method', 'quantization_config')}): give the original"
        )
    _quiet()
    try:
        import bitsandbytes  # noqa: F401 - only to say what is missing before transformers does
    except ImportError:
        raise models.ModelLoadError("--bitsandbytes needs the bitsandbytes package: pip install bitsandbytes") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    compute = models.compute_dtype(device, dtype)
    kwargs = {"bnb_4bit_compute_dtype": compute} if "load_in_4bit" in SCHEMES[scheme] else {}
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=dtype,
        use_safetensors=True,
        local_files_only=True,
        device_map={"": str(device)},
        quantization_config=BitsAndBytesConfig(**SCHEMES[scheme], **kwargs),
    )
    models.cast_params(model, device, compute)  # the rest (norms, embeddings, lm_head) as we evaluate it
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return models.Loaded(lazy.StreamedModel(model.eval()), tokenizer)


BLOCKSIZE = 64  # what load_in_4bit uses


def round_4bit(linear: torch.nn.Linear, dtype: torch.dtype, quant_type: str = "nf4") -> None:
    """Round ``linear``'s weight, seen in ``dtype`` (the checkpoint's: what ``load_in_4bit`` rounds),
    to bitsandbytes' 4-bit codes in blocks of 64. The codes are kept on the linear for the export
    (``rounded_4bit_of``); its weight becomes what bitsandbytes dequantizes them to."""
    _quiet()
    import bitsandbytes.functional as F

    weight = linear.weight.data
    codes, state = F.quantize_4bit(
        weight.detach().cpu().to(dtype).contiguous(), blocksize=BLOCKSIZE, quant_type=quant_type
    )
    linear.bnb_4bit = (codes, state)
    linear.weight.data = F.dequantize_4bit(codes, state).to(weight.device, weight.dtype)


def rounded_4bit_of(linear: torch.nn.Module):
    """(codes, bitsandbytes QuantState) of a linear ``round_4bit`` rounded, else None."""
    return getattr(linear, "bnb_4bit", None)


def export_tensors(name: str, rounded) -> dict[str, torch.Tensor]:
    """A rounded linear's weight as transformers saves a ``Linear4bit``: the packed codes under
    ``{name}.weight``, the block scales and code table beside them."""
    codes, state = rounded
    return {f"{name}.weight": codes, **{f"{name}.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}


def stored_bits(rounded) -> int:
    """Bits a rounded linear stores: codes and block scales (4.5 per weight with fp32 scales)."""
    codes, state = rounded
    return 8 * (codes.nbytes + state.absmax.nbytes)


def export_config(quant_type: str, dtype: torch.dtype, dense: list[str]) -> dict:
    """The ``quantization_config`` transformers writes for a ``load_in_4bit`` model, with the linears
    left dense (lm_head, ``ignore``) named, as transformers' default list would not know them."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=dense
    ).to_dict()


def dequantize_4bit(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A weight from ``export_tensors``' parts (keys without the linear's name), as bitsandbytes'
    ``Linear4bit`` dequantizes it."""
    _quiet()
    import bitsandbytes.functional as F

    state = F.QuantState.from_dict({k.removeprefix("weight."): v for k, v in tensors.items() if k != "weight"}, "cpu")
    return F.dequantize_4bit(tensors["weight"], state)


@functools.cache
def _quiet() -> None:
    """Drop two messages bitsandbytes logs that say nothing to act on: that its optional CPU kernels
    from the hub's ``kernels`` package are absent (it falls back to its own), and, on every
    LLM.int8 call, that the rows are cast to fp16 (that is how LLM.int8 multiplies)."""
    for logger, text in (
        ("bitsandbytes.backends.cpu.ops", "kernels-community"),
        ("bitsandbytes.autograd._functions", "inputs will be cast"),
    ):
        logging.getLogger(logger).addFilter(lambda record, text=text: text not in record.getMessage())


def bits_per_weight(model: torch.nn.Module) -> tuple[float, int]:
    """(bits per weight of the linears bitsandbytes quantized, how many weights that is): codes,
    block scales and, with double quantization, the scales' own scales and code table."""
    import bitsandbytes as bnb

    stored, weights = 0, 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            weights += state.shape.numel()
            stored += module.weight.nbytes + state.absmax.nbytes
            if state.nested:
                stored += state.state2.absmax.nbytes + state.state2.code.nbytes
        elif isinstance(module, bnb.nn.Linear8bitLt):
            weights += module.weight.numel()
            stored += module.weight.nbytes + module.weight.SCB.nbytes
    return (8 * stored / weights if weights else 0.0), weights
