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
import sys
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import bnb, factored, gguf_export, kv_quant, moe
from .quant import ActivationScheme, QuantizedWeight, QuantScheme, input_quant_of, quantized_of
from .sparsity import prune_mask_of

MAX_SHARD_BYTES = 2 * 1024**3
MANIFEST = "compress_manifest.json"
REPORT = "report.json"


class ExportError(RuntimeError):
    pass


def _ct_args(scheme: QuantScheme):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=scheme.bits,
        type="int",
        symmetric=scheme.symmetric,
        strategy="channel" if scheme.group_size == -1 else "group",
        group_size=None if scheme.group_size == -1 else scheme.group_size,
    )


def _activation_args(scheme: ActivationScheme):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(
        num_bits=scheme.bits,
        type="int",
        symmetric=True,
        dynamic=True,
        strategy="token" if scheme.per_token else "tensor",
    )


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


def quantization_config(
    linears: dict[str, tuple[QuantScheme, ActivationScheme | None] | None], fmt: str
) -> dict | None:
    """compressed-tensors config: one group per distinct scheme, every other linear ignored.
    ``linears`` maps each linear's name to its (weight, input) schemes, None when dense."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    by_scheme: dict[tuple[QuantScheme, ActivationScheme | None], list[str]] = {}
    for name, schemes in linears.items():
        if schemes is not None:
            by_scheme.setdefault(schemes, []).append(name)
    if not by_scheme:
        return None
    single = len(by_scheme) == 1
    groups = {
        f"group_{i}": QuantizationScheme(
            targets=["Linear"] if single else names,
            weights=_ct_args(scheme),
            input_activations=_activation_args(act) if act else None,
        )
        for i, ((scheme, act), names) in enumerate(by_scheme.items())
    }
    dense = [name for name, schemes in linears.items() if schemes is None]
    config = QuantizationConfig(
        config_groups=groups, format=fmt, quantization_status="compressed", ignore=dense if single else []
    )
    data = config.model_dump(exclude=["quant_method"])
    data.update(
        quant_method="compressed-tensors",
        version=compressed_tensors.__version__,
        sparsity_config={},
        transform_config={},
    )
    return data


# safetensors orders a file's tensors by dtype (this rank, descending), then by name
_ST_DTYPES = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.int16: ("I16", 9),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.int32: ("I32", 13),
    torch.float32: ("F32", 15),
    torch.float64: ("F64", 17),
    torch.int64: ("I64", 18),
}


class ShardWriter:
    """safetensors shards written one tensor at a time, so an export never holds more than one
    tensor: each tensor's bytes go to a scratch file as it arrives; a full shard is then laid out
    exactly as ``safetensors.torch.save_file`` lays it out (the tests compare the bytes)."""

    def __init__(self, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
        self.folder, self.max_bytes = folder, max_shard_bytes
        self.done: list[tuple[Path, list[str]]] = []  # finished shards and their keys
        self._open_shard()

    def _open_shard(self) -> None:
        self.data_path = self.folder / f".shard-{len(self.done)}.data"
        self.data = open(self.data_path, "wb")
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
        self.size = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _ST_DTYPES:
            raise ExportError(f"{key}: cannot store dtype {tensor.dtype} in safetensors here")
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self.entries and self.size + nbytes > self.max_bytes:
            self._finish_shard()
            self._open_shard()
        self.data.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.entries.append((key, t.dtype, tuple(t.shape), self.size, nbytes))
        self.size += nbytes

    def _finish_shard(self) -> None:
        self.data.close()
        order = sorted(self.entries, key=lambda e: (-_ST_DTYPES[e[1]][1], e[0]))
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, dtype, shape, _, nbytes in order:
            header[key] = {
                "dtype": _ST_DTYPES[dtype][0],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path = self.folder / f".shard-{len(self.done)}.safetensors"
        with open(path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for _, _, _, start, nbytes in order:
                data.seek(start)
                while nbytes:
                    chunk = data.read(min(nbytes, 1 << 24))
                    out.write(chunk)
                    nbytes -= len(chunk)
        self.data_path.unlink()
        self.done.append((path, [e[0] for e in self.entries]))

    def close(self) -> list[str]:
        """Name the shards as transformers does (one: model.safetensors; more: an index)."""
        self._finish_shard()
        if len(self.done) == 1:
            os.replace(self.done[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        names, index = [], {}
        for i, (path, keys) in enumerate(self.done):
            name = f"model-{i + 1:05d}-of-{len(self.done):05d}.safetensors"
            os.replace(path, self.folder / name)
            names.append(name)
            index.update({k: name for k in keys})
        (self.folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(index.items()))}, indent=2)
        )
        return names


ADAPTER = "adapter"


def _write_adapter(loras: dict[str, tuple[torch.Tensor, torch.Tensor]], folder: Path) -> None:
    """Low-rank corrections kept on linears (``linear.lora = (B, A)``) as a PEFT LoRA adapter with
    scale 1 (lora_alpha = r): ``PeftModel.from_pretrained(base, folder / "adapter")`` applies it."""
    if not loras:
        return
    from peft import LoraConfig

    ranks = {name: B.shape[1] for name, (B, _) in loras.items()}
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
    for name, (B, A) in loras.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = A
        tensors[f"base_model.model.{name}.lora_B.weight"] = B
    weights = folder / ADAPTER / "adapter_model.safetensors"
    save_file(tensors, weights, metadata={"format": "pt"})
    weights.chmod(0o666 & ~_umask())  # safetensors writes it private (0600); readable as its neighbours


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


def check_output(out: Path, overwrite: bool, protected: tuple[Path, ...] = ()) -> None:
    """Fail before any compute when the output cannot be written, or would replace what is not ours.

    ``--overwrite`` replaces only an earlier export (a folder holding our manifest), never the
    current folder, a folder above it, the home folder or one of ``protected`` (the model's and
    the recipe's folders). The nearest existing parent must be a writable folder."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ExportError(f"output {out} exists; pass --overwrite or choose another --output")
        where = out.resolve()
        cwd, home = Path.cwd().resolve(), Path.home().resolve()
        if where == cwd or where in cwd.parents or where == home or out.is_symlink():
            what = "a link" if out.is_symlink() else "the current folder, a folder above it or the home folder"
            raise ExportError(
                f"--output {out} is {what}; --overwrite replaces only an earlier export: choose another --output"
            )
        for folder in protected:
            folder = Path(folder).resolve()
            if where == folder or where in folder.parents:
                raise ExportError(
                    f"--output {out} is or contains {folder}, an input of this run; choose another --output"
                )
        if not out.is_dir() or not (out / MANIFEST).is_file():
            raise ExportError(
                f"--output {out} is not an export of compress (no {MANIFEST} in it); "
                "--overwrite replaces only an earlier export: choose another --output"
            )
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"--output {out}: {parent} is a file, not a folder; choose another --output")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"--output {out}: {parent} is not writable; choose another --output")


@dataclass
class Totals:
    """What the report says about the weights, summed as blocks are written (they are freed after)."""

    weight_bits: float = 0.0  # quantized linears: bits including scales and zero-points
    quantized: int = 0  # their weights
    zeros: int = 0  # pruned linears: exact zeros
    pruned: int = 0  # their weights
    factored: int = 0  # factored layers: parameters of the pairs
    replaced: int = 0  # parameters of the dense layers they replaced

    def bits_per_weight(self) -> float | None:
        return self.weight_bits / self.quantized if self.quantized else None

    def sparsity(self) -> float | None:
        return self.zeros / self.pruned if self.pruned else None

    def params_kept(self) -> float | None:
        return self.factored / self.replaced if self.replaced else None


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders that runs writing ``out`` left when they were killed: ours by
    their name (``.<name>.tmp-<pid>-…``, ``.<name>.old-<pid>-…``), and only when that process is gone."""
    removed = []
    for folder in sorted(out.parent.glob(f".{out.name}.*-*-*")) if out.parent.is_dir() else []:
        kind, _, rest = folder.name[len(out.name) + 2 :].partition("-")
        pid = rest.partition("-")[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or not folder.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that run is still going
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # another user's process
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


class Export:
    """An export being written: opened before compression, given each block as soon as it is
    final (``add``), completed by ``finish`` (still in a temporary folder beside the target,
    where the caller adds the report) and ``publish`` (renamed into place); ``abort`` removes it."""

    def __init__(
        self,
        out: str | Path,
        overwrite: bool = False,
        max_shard_bytes: int = MAX_SHARD_BYTES,
        protected: tuple[Path, ...] = (),
    ):
        self.out, self.overwrite = Path(out), overwrite
        check_output(self.out, overwrite, protected)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for folder in remove_leftovers(self.out):
            print(f"[compress] removed {folder}, left by an interrupted run", file=sys.stderr)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-{os.getpid()}-", dir=self.out.parent))
        self.tmp.chmod(0o777 & ~_umask())  # as a plain mkdir would (mkdtemp makes it private)
        self.shards = ShardWriter(self.tmp, max_shard_bytes)
        self.linears: dict[str, tuple[QuantScheme, ActivationScheme | None] | None] = {}
        self.loras: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rounded_4bit: dict[str, str] = {}  # linears in bitsandbytes' 4-bit layout -> nf4 / fp4
        self.format: str | None = None  # pack-quantized, or int-quantized once a linear has int8 inputs
        self.totals = Totals()

    def _tensors_of(
        self, module: torch.nn.Module, name: str, linear: torch.nn.Module, qw: QuantizedWeight
    ) -> dict[str, torch.Tensor]:
        """The format is the whole export's, decided by the first module with quantized linears
        (every block goes through the same passes): ``int-quantized`` when any of its linears has
        int8 inputs (W8A8), and then every quantized linear is stored as int8, as before streaming."""
        if self.format is None:
            w8a8 = any(input_quant_of(m) is not None for m in module.modules())
            self.format = "int-quantized" if w8a8 else "pack-quantized"
        act = input_quant_of(linear)
        if act is not None and qw.scheme.bits != 8:
            raise ExportError(
                f"{name} has int8 activations but {qw.scheme.describe()} weights; "
                "W8A8 needs 8-bit weights on the same linears"
            )
        if act is not None and self.format != "int-quantized":
            raise ExportError(
                f"{name} has int8 activations but the linears of an earlier block do not; "
                "W8A8 needs them in every block"
            )
        return _int8_tensors(name, qw) if self.format == "int-quantized" else _packed_tensors(name, qw)

    def add(self, module: torch.nn.Module, prefix: str = "", skip: str | None = None) -> None:
        """Write ``module``'s tensors under ``prefix`` (quantized linears packed, tied tensors once),
        leaving out the submodule ``skip`` (the decoder blocks, written one by one)."""
        name_of = {
            m: f"{prefix}{n}"
            for n, m in module.named_modules()
            if skip is None or not (n == skip or n.startswith(skip + "."))
        }
        quantized, rounded = {}, {}
        for m, name in name_of.items():
            if isinstance(m, torch.nn.Linear) and (r := bnb.rounded_4bit_of(m)) is not None:
                rounded[name] = r
                self.rounded_4bit[name] = r[1].quant_type
                self.totals.weight_bits += bnb.stored_bits(r)
                self.totals.quantized += m.weight.numel()
            elif isinstance(m, torch.nn.Linear):
                qw = quantized_of(m)
                self.linears[name] = None if qw is None else (qw.scheme, input_quant_of(m))
                if qw is None and input_quant_of(m) is not None:
                    raise ExportError(
                        f"{name} has int8 activations but dense weights; W8A8 needs 8-bit weights on the same linears"
                    )
                if qw is not None:
                    quantized[name] = (m, qw)
                    n = qw.q.numel()
                    self.totals.weight_bits += qw.scheme.bits_per_weight(qw.q.shape[1], 8 * qw.scale.element_size()) * n
                    self.totals.quantized += n
            if prune_mask_of(m) is not None:
                self.totals.zeros += (m.weight == 0).sum().item()
                self.totals.pruned += m.weight.numel()
            if isinstance(m, factored.Factored):
                self.totals.factored += m[0].weight.numel() + m[1].weight.numel()
                self.totals.replaced += m[0].in_features * m[1].out_features
            if getattr(m, "lora", None) is not None:
                self.loras[name] = tuple(t.detach().cpu().contiguous() for t in m.lora)
        seen = set()
        renames = moe.checkpoint_renames(module, prefix)  # tensors named as the family's checkpoints name them
        for router in moe.routers(module, prefix):  # dense, and listed so that vLLM leaves it so
            self.linears[moe.renamed(router, renames)] = None
        for key, tensor in module.state_dict(prefix=prefix).items():
            owner, _, leaf = key.rpartition(".")
            if skip is not None and key.startswith(f"{prefix}{skip}."):
                continue
            if owner in quantized and leaf == "weight":  # a quantized linear's bias is written as it is
                for k, t in self._tensors_of(module, owner, *quantized[owner]).items():
                    self.shards.add(moe.renamed(k, renames), t)
                continue
            if owner in rounded and leaf == "weight":
                for k, t in bnb.export_tensors(owner, rounded[owner]).items():
                    self.shards.add(k, t)
                continue
            if tensor.data_ptr() in seen:  # tied lm_head / embeddings
                continue
            seen.add(tensor.data_ptr())
            self.shards.add(moe.renamed(key, renames), tensor)

    def _bitsandbytes_config(self, compressed_tensors: dict | None, dtype: torch.dtype) -> dict:
        """transformers' config for 4-bit bitsandbytes weights; one checkpoint holds one layout."""
        if compressed_tensors is not None:
            raise ExportError("an export holds bitsandbytes 4-bit or integer (compressed-tensors) weights, not both")
        (quant_type, *others) = set(self.rounded_4bit.values())
        if others:
            raise ExportError(f"an export holds one bitsandbytes 4-bit type; found {quant_type} and {others[0]}")
        return bnb.export_config(quant_type, dtype, [name for name, s in self.linears.items() if s is None])

    def finish(self, model: torch.nn.Module, tokenizer, recipe_text: str, manifest: dict, gguf=None) -> Path:
        """Config, tokenizer, recipe, the GGUF file when the recipe's ``export`` (``gguf``) asks for
        one, and manifest (sha256 per file) beside the shards, in the temporary folder, which is
        returned: ``publish`` puts it in place."""
        try:
            self.shards.close()
            _write_adapter(self.loras, self.tmp)
            config = model.config.to_dict()
            config.pop("auto_map", None)  # code references: an export runs no code from a repository
            config.pop("quantization_config", None)
            qconfig = quantization_config(self.linears, self.format or "pack-quantized")
            if self.rounded_4bit:
                qconfig = self._bitsandbytes_config(qconfig, model.dtype)
            if qconfig is not None:
                config["quantization_config"] = qconfig
            config.pop(factored.CONFIG_KEY, None)
            if ranks := factored.factored_ranks(model):
                config[factored.CONFIG_KEY] = ranks  # our loader (and docs/formats.md's recipe) rebuild these layers
            config.pop(kv_quant.CONFIG_KEY, None)
            if (kv := kv_quant.scheme_of(model)) is not None:
                config[kv_quant.CONFIG_KEY] = kv_quant.config_entry(kv)  # our evaluator and decoder read it
            (self.tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(self.tmp)
            tokenizer.save_pretrained(self.tmp)
            (self.tmp / "recipe.yaml").write_text(recipe_text)
            if gguf is not None:
                gguf_export.write(self.tmp, gguf.type, self.tmp / gguf_export.file_name(gguf.type), gguf.embedding)
            files = {str(p.relative_to(self.tmp)): _sha256(p) for p in sorted(self.tmp.rglob("*")) if p.is_file()}
            manifest = {**manifest, "versions": _versions(), "files": files}
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        except BaseException:
            self.abort()
            raise
        return self.tmp

    def publish(self) -> Path:
        """Rename the finished folder into place (replacing an earlier export under --overwrite)."""
        try:
            if self.out.exists():
                check_output(self.out, self.overwrite)
                trash = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-{os.getpid()}-", dir=self.out.parent))
                os.replace(self.out, trash / self.out.name)
                os.replace(self.tmp, self.out)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(self.tmp, self.out)
        finally:
            self.abort()
        return self.out

    def abort(self) -> None:
        if not self.shards.data.closed:
            self.shards.data.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def export(
    model,
    tokenizer,
    out: str | Path,
    recipe_text: str,
    manifest: dict,
    overwrite: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """A whole in-memory model through ``Export``: its blocks, then the rest."""
    from .arch import arch_of, decoder_layers

    writer = Export(out, overwrite, max_shard_bytes)
    try:
        layers = arch_of(model).layers
        for i, block in enumerate(decoder_layers(model)):
            writer.add(block, f"{layers}.{i}.")
        writer.add(model, skip=layers)
    except BaseException:
        writer.abort()
        raise
    writer.finish(model, tokenizer, recipe_text, manifest)
    return writer.publish()


def add_evaluation(folder: Path, evaluation: dict) -> Path:
    """Fill in the evaluation of an export written with ``--no-eval`` (``compress eval DIR
    --write-report``): ``report.json``'s ``eval`` and the manifest's ``evaluated``, each file
    replaced whole (written beside, then renamed)."""
    report_path, manifest_path = folder / REPORT, folder / MANIFEST
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    manifest = json.loads(manifest_path.read_text())
    for path, content in (
        (report_path, {**report, "eval": evaluation}),
        (manifest_path, {**manifest, "evaluated": True}),
    ):
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(content, indent=2))
        os.replace(partial, path)
    return report_path


def size_on_disk(folder: Path) -> int:
    """Bytes of weights: the checkpoint's safetensors and an adapter's, if any."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors"))
