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

The QLoRA pass's ``base: nf4`` rounds the weights with the same bitsandbytes call and exports
them as transformers serializes a ``load_in_4bit`` model: ``compress/formats/bitsandbytes.py``.
"""

from __future__ import annotations

import json

import torch

from . import lazy, models
from .formats.bitsandbytes import quiet

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
    quiet()
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
