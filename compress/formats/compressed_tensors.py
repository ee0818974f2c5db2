"""compressed-tensors, the layout transformers and vLLM load: integer and float weights, input schemes.

Written: a quantized linear becomes ``weight_packed`` (int32, packed by compressed-tensors),
``weight_scale``, ``weight_shape`` and, when asymmetric, a packed ``weight_zero_point``
(``pack-quantized``), or its int8 weight as it is when the export has int8 inputs
(``int-quantized``, W8A8). Float grids are written in the layouts compressed-tensors' own
compressors read: FP8 as an E4M3 ``weight`` and its ``weight_scale`` (``float-quantized``), NVFP4
as two E2M1 codes per byte (``weight_packed``), FP8 ``weight_scale`` and float32
``weight_global_scale`` (``nvfp4-pack-quantized``), MXFP4 likewise with E8M0 exponents as its
``weight_scale`` (``mxfp4-pack-quantized``). config.json gets the ``quantization_config`` that
names the schemes.

Read: ``Reader`` is the one reader of those tensors. ``weight`` dequantizes a linear with
compressed-tensors' own code (what transformers computes with); ``integers`` gives the stored
integers back as a ``QuantizedWeight`` (for the decoder's integer kernels and for GGUF).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..quant import BLOCK_ROWS, ActivationScheme, QuantizedWeight, QuantScheme
from .safetensors import Checkpoint

PARTS = ("weight", "weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_shape")
INPUT_PARTS = ("input_scale", "input_global_scale")  # calibrated input scales (``input_tensors``)
# a weight format -> the export's compressed-tensors format (integers: pack-quantized, or int-quantized for W8A8)
FLOAT_FORMATS = {
    "fp8": "float-quantized",
    "fp8_block": "float-quantized",
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
}


def export_format(scheme: QuantScheme, int8_inputs: bool) -> str:
    """The compressed-tensors format that stores weights of ``scheme``."""
    if scheme.is_float:
        return FLOAT_FORMATS[scheme.format]
    return "int-quantized" if int8_inputs else "pack-quantized"


def weight_args(scheme: QuantScheme):
    """compressed-tensors' description of our weights (as its presets ``FP8_DYNAMIC``'s and
    ``FP8_BLOCK``'s weights, ``NVFP4A16``, ``MXFP4A16`` describe the float ones)."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme.format == "nvfp4":
        extra = dict(strategy="tensor_group", scale_dtype=torch.float8_e4m3fn, zp_dtype=torch.float8_e4m3fn)
    elif scheme.format == "mxfp4":
        extra = dict(strategy="group", scale_dtype=torch.uint8, zp_dtype=torch.uint8)
    elif scheme.format == "fp8_block":
        return QuantizationArgs(
            num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[BLOCK_ROWS, scheme.group_size]
        )
    else:
        extra = dict(strategy="channel" if scheme.group_size == -1 else "group")
    return QuantizationArgs(
        num_bits=scheme.bits,
        type="float" if scheme.is_float else "int",
        symmetric=scheme.symmetric,
        group_size=None if scheme.group_size == -1 else scheme.group_size,
        **extra,
    )


def _activation_args(scheme: ActivationScheme):
    """compressed-tensors' description of our inputs (as its presets ``FP8_DYNAMIC``, ``FP8``,
    ``W4AFP8``, ``NVFP4`` and ``MXFP4`` describe theirs)."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme.format == "nvfp4":  # dynamic scales per 16 under the static global scale
        extra = dict(strategy="tensor_group", group_size=16, dynamic="local", scale_dtype=torch.float8_e4m3fn)
    elif scheme.format == "mxfp4":
        extra = dict(strategy="group", group_size=32, dynamic=True, scale_dtype=torch.uint8)
    elif scheme.group_size is not None:  # FP8 per token and group of 128 (FP8_BLOCK)
        extra = dict(strategy="group", group_size=scheme.group_size, dynamic=True)
    else:
        extra = dict(strategy="token" if scheme.per_token else "tensor", dynamic=not scheme.static)
    return QuantizationArgs(
        num_bits=scheme.bits, type="int" if scheme.format == "int" else "float", symmetric=True, **extra
    )


def input_tensors(name: str, scheme: ActivationScheme, calibrated) -> dict[str, torch.Tensor]:
    """The tensor linear ``name`` stores for its inputs: FP8's static scale (``input_scale``) or
    NVFP4's global scale (``input_global_scale``), as compressed-tensors names them; else none."""
    if not scheme.calibrated:
        return {}
    return {f"{name}.input_global_scale" if scheme.format == "nvfp4" else f"{name}.input_scale": calibrated.value}


def tensors(name: str, qw: QuantizedWeight, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors that store linear ``name``'s integers in format ``fmt``: ``int-quantized`` (W8A8)
    keeps the int8 weight as it is, the layout int8 kernels read; ``pack-quantized`` packs them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    if qw.scheme.is_float:
        return _float_tensors(name, qw)
    if fmt == "int-quantized":
        out = {f"{name}.weight": qw.q, f"{name}.weight_scale": qw.scale}
        if not qw.scheme.symmetric:
            out[f"{name}.weight_zero_point"] = qw.zero_point
        return out
    out = {
        f"{name}.weight_packed": pack_to_int32(qw.q, qw.scheme.bits),
        f"{name}.weight_scale": qw.scale,
        f"{name}.weight_shape": torch.tensor(qw.q.shape),
    }
    if not qw.scheme.symmetric:
        out[f"{name}.weight_zero_point"] = pack_to_int32(qw.zero_point, qw.scheme.bits, packed_dim=0)
    return out


def _float_tensors(name: str, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    if qw.scheme.format == "fp8":
        return {f"{name}.weight": qw.q, f"{name}.weight_scale": qw.scale}
    if qw.scheme.format == "fp8_block":  # one scale per tile: the first of its rows'
        return {f"{name}.weight": qw.q, f"{name}.weight_scale": qw.scale[::BLOCK_ROWS].contiguous()}
    out = {f"{name}.weight_packed": pack_fp4_to_uint8(qw.q.float())}
    if qw.scheme.format == "nvfp4":  # scale = fp8 / global, so fp8 = scale * global (exact: it was fp8 / global)
        out[f"{name}.weight_scale"] = (qw.scale * qw.global_scale).to(torch.float8_e4m3fn)
        out[f"{name}.weight_global_scale"] = qw.global_scale.float()
    else:  # E8M0: the power of two's exponent plus 127
        out[f"{name}.weight_scale"] = (torch.log2(qw.scale).round() + 127).to(torch.uint8)
    return out


def config(
    linears: dict[str, tuple[QuantScheme, ActivationScheme | None] | None],
    fmt: str,
    fp8_kv_cache: bool = False,
    rotations: dict[str, int] | None = None,
) -> dict | None:
    """compressed-tensors config: one group per distinct scheme, every other linear ignored.
    ``linears`` maps each linear's name to its (weight, input) schemes, None when dense; with
    ``fp8_kv_cache`` the ``kv_cache_scheme`` of an FP8 cache with static per-layer scales
    (``compress/kv_fp8.py``); ``rotations`` maps the linears whose inputs are rotated online
    (``hadamard.InputRotation``) to the rotation's block, written as ``transform_config``. Either
    may be the only entry, when no linear is quantized (format ``dense``)."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    from ..kv_fp8 import SCHEME

    by_scheme: dict[tuple[QuantScheme, ActivationScheme | None], list[str]] = {}
    for name, schemes in linears.items():
        if schemes is not None:
            by_scheme.setdefault(schemes, []).append(name)
    if not by_scheme and not fp8_kv_cache and not rotations:
        return None
    single = len(by_scheme) == 1
    groups = {
        f"group_{i}": QuantizationScheme(
            targets=["Linear"] if single else names,
            weights=weight_args(scheme),
            input_activations=_activation_args(act) if act else None,
            # float groups name their layout, as llm-compressor writes them; integer exports keep theirs
            # unnamed unless they have quantized inputs besides W8A8's: compressed-tensors would guess
            # a float layout for W4AFP8 and int8 storage (W8A8's) for W4A8 / W4A4
            format=fmt if fmt in FLOAT_FORMATS.values() or (act and fmt != "int-quantized") else None,
        )
        for i, ((scheme, act), names) in enumerate(by_scheme.items())
    }
    dense = [name for name, schemes in linears.items() if schemes is None]
    config = QuantizationConfig(
        config_groups=groups,
        format=fmt if groups else "dense",
        quantization_status="compressed",
        ignore=dense if single else [],
        kv_cache_scheme=QuantizationArgs(**SCHEME) if fp8_kv_cache else None,
    )
    data = config.model_dump(exclude=["quant_method"])
    data.update(
        quant_method="compressed-tensors",
        version=compressed_tensors.__version__,
        sparsity_config={},
        transform_config=_transforms(rotations or {}),
    )
    return data


def _transforms(rotations: dict[str, int]) -> dict:
    """Online input rotations as compressed-tensors' ``hadamard`` transforms: Sylvester's matrix on
    blocks of ``head_dim`` input channels, applied before the linear (the weights hold the rest)."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    by_block: dict[int, list[str]] = {}
    for name, block in rotations.items():
        by_block.setdefault(block, []).append(name)
    groups = {
        f"online_{block}": TransformScheme(
            type="hadamard", head_dim=block, apply=[TransformArgs(targets=names, location="input")]
        )
        for block, names in by_block.items()
    }
    return TransformConfig(config_groups=groups).model_dump(mode="json") if groups else {}


def rotations_of(qconfig: dict) -> dict[str, int]:
    """``_transforms`` read back: each linear rotated online, with its block; only the layout we write."""
    out = {}
    for group in ((qconfig.get("transform_config") or {}).get("config_groups") or {}).values():
        for args in group.get("apply", []):
            if group.get("type") != "hadamard" or args.get("location") != "input" or args.get("inverse"):
                raise ValueError(
                    f"a {group.get('type')} transform at {args.get('location')}: our reader applies hadamard "
                    "rotations of linear inputs only (vLLM reads the rest)"
                )
            out.update({name: group["head_dim"] for name in args["targets"]})
    return out


class Reader:
    """How an export of this layout stores each quantized linear (from its ``quantization_config``)."""

    def __init__(self, qconfig: dict):
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig

        config = QuantizationConfig.model_validate(qconfig)
        self.format = config.format
        self.compressor = BaseCompressor.get_value_from_registry(config.format)
        self.ignore = set(config.ignore or [])
        self.groups = list(config.config_groups.values())
        # an FP8 KV cache (``kv_cache_scheme``): each attention stores ``k_scale`` and ``v_scale``
        self.fp8_kv_cache = config.kv_cache_scheme is not None
        self.rotations = rotations_of(qconfig)  # linears whose inputs are rotated online -> block

    def scheme_of(self, name: str, module: torch.nn.Module):
        """The compressed-tensors scheme of linear ``name``, None when it is stored dense."""
        return self.scheme_for(name) if isinstance(module, torch.nn.Linear) else None

    def scheme_for(self, name: str):
        if name in self.ignore:
            return None
        for scheme in self.groups:
            for target in scheme.targets:
                regex = target.startswith("re:") and re.fullmatch(target[3:], name)
                if target == "Linear" or target == name or regex:
                    return scheme
        return None

    def input_scheme(self, name: str, module: torch.nn.Module) -> ActivationScheme | None:
        """How linear ``name`` rounds its inputs (``_activation_args`` read back), or None."""
        scheme = self.scheme_of(name, module)
        act = scheme and scheme.input_activations
        if act is None:
            return None
        if act.type == "int":
            return ActivationScheme(act.num_bits, per_token=act.strategy == "token")
        fmt = {4: "nvfp4" if act.strategy == "tensor_group" else "mxfp4", 8: "fp8"}[act.num_bits]
        static = fmt == "fp8" and not act.dynamic
        return ActivationScheme(act.num_bits, act.strategy == "token", fmt, static, act.group_size)

    def input_keys(self, stored: str, checkpoint) -> list[str]:
        """The calibrated input scale linear ``stored`` keeps (``input_tensors``), as a list of at most one key."""
        return [f"{stored}.{k}" for k in INPUT_PARTS if f"{stored}.{k}" in checkpoint]

    def keys(self, stored: str, checkpoint) -> list[str]:
        return [f"{stored}.{k}" for k in PARTS if f"{stored}.{k}" in checkpoint]

    def weight(self, tensors: dict[str, torch.Tensor], scheme) -> torch.Tensor:
        """The dequantized weight from a linear's tensors (keys without its name), as transformers
        computes it."""
        return self.compressor.decompress(tensors, scheme)["weight"]

    def quantized_linears(self, checkpoint) -> list[str]:
        """The names of the linears stored as integers, as the checkpoint names them."""
        return sorted({k.rsplit(".", 1)[0] for k in checkpoint.file_of if k.endswith(".weight_scale")})

    def integers(self, checkpoint, name: str) -> QuantizedWeight:
        """The integers, scales and zero-points linear ``name`` stores, as our passes left them."""
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

        scheme = self.scheme_for(name)
        if scheme is None:
            raise ValueError(f"{name}: the export's quantization_config names no scheme for it")
        w = scheme.weights
        if w.type == "float" and w.num_bits == 8 and str(w.strategy).endswith("channel"):
            t = checkpoint.read([f"{name}.weight", f"{name}.weight_scale"])
            scale = t[f"{name}.weight_scale"]
            fp8 = QuantScheme(8, -1, True, format="fp8")
            return QuantizedWeight(fp8, t[f"{name}.weight"], scale, torch.zeros(scale.shape, dtype=torch.int8))
        if w.type != "int":
            raise ValueError(f"{name} stores {w.num_bits}-bit float values, not integers ({self.format})")
        ours = QuantScheme(w.num_bits, -1 if w.group_size is None else w.group_size, w.symmetric)
        t = {k[len(name) + 1 :]: v for k, v in checkpoint.read(self.keys(name, checkpoint)).items()}
        scale = t["weight_scale"]
        if "weight_packed" in t:
            q = unpack_from_int32(t["weight_packed"], w.num_bits, torch.Size(t["weight_shape"].tolist()))
            if not w.symmetric:
                t["weight_zero_point"] = unpack_from_int32(
                    t["weight_zero_point"], w.num_bits, scale.shape, packed_dim=0
                )
        else:
            q = t["weight"]  # int-quantized (W8A8): int8 as it is
        zero = t.get("weight_zero_point", torch.zeros(scale.shape, dtype=torch.int8))
        return QuantizedWeight(ours, q.to(torch.int8), scale, zero.to(torch.int8))


def unsimulated_by_decoder(folder: str | Path, fp8_kernel: bool = False) -> list[str]:
    """What of the export's formats the decode engine runs in 16 bits (integer inputs are rounded only
    in W8A8's kernel, FP8 weights and inputs only on the FP8 kernel, ``fp8_kernel``): float weights
    dequantized, float inputs, W4A8 / W4A4 int inputs and an FP8 KV cache unrounded."""
    config = json.loads((Path(folder) / "config.json").read_text()).get("quantization_config") or {}
    groups = (config.get("config_groups") or {}).values()
    served = fp8_kernel and groups and all(_fp8_kernel_runs(g) for g in groups)
    parts = []
    if config.get("format") in FLOAT_FORMATS.values() and not served:
        parts.append(f"{config['format']} weights run dequantized")
    inputs = [g.get("input_activations") or {} for g in groups]
    if not served and (bits := {a.get("num_bits") for a in inputs if a.get("type") == "float"}):
        parts.append(f"{'FP4' if 4 in bits else 'FP8'} inputs run unrounded")
    if config.get("format") != "int-quantized" and (
        bits := {a.get("num_bits") for a in inputs if a.get("type") == "int"}
    ):
        parts.append(f"int{min(bits)} inputs run unrounded")
    if config.get("kv_cache_scheme"):
        parts.append("the FP8 KV cache runs in 16 bits")
    return parts


def _fp8_kernel_runs(group: dict) -> bool:
    """Whether a config group is FP8 weights per channel with FP8 inputs per token or under one
    static scale: what the decoder's FP8 kernel computes as served."""
    w, a = group.get("weights") or {}, group.get("input_activations") or {}
    fp8 = all(t.get("type") == "float" and t.get("num_bits") == 8 for t in (w, a))
    per_token_or_static = a.get("strategy") == "token" or (a.get("strategy") == "tensor" and not a.get("dynamic"))
    return fp8 and w.get("strategy") == "channel" and per_token_or_static


def attach_integers(model: torch.nn.Module, folder: str | Path) -> int:
    """Attach to each linear of ``model`` (loaded from ``folder``, dequantized) the integers its export
    stores in the ``pack-quantized`` layout, or the E4M3 values of FP8 weights per channel
    (``float-quantized``), as the passes left them (the decoder's integer and FP8 kernels read them);
    returns how many linears got one."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
    if config.get("format") not in ("pack-quantized", "float-quantized"):
        return 0
    layout, checkpoint = Reader(config), Checkpoint(folder)
    names = layout.quantized_linears(checkpoint)
    if config["format"] == "float-quantized":
        names = [n for n in names if (s := layout.scheme_for(n)) and str(s.weights.strategy).endswith("channel")]
    for name in names:
        layout.integers(checkpoint, name).attach(model.get_submodule(name))
    return len(names)
