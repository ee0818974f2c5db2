"""Write a deployable checkpoint from the states the passes left (``compress/state.py``).

Each block goes to the shards as soon as it is final; each state is written by the format that
stores it (``compress/formats/``): integers and input schemes in the compressed-tensors layout,
bitsandbytes' 4-bit codes in transformers' ``load_in_4bit`` layout, LoRA corrections as a PEFT
adapter, a GGUF file when the recipe asks for one. Everything is written to a temporary folder
next to the target and renamed at the end, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
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

from . import factored, hadamard, kv_quant, moe
from .eagle import EagleState
from .formats import bitsandbytes, compressed_tensors, eagle_head, gguf_file, peft_adapter
from .formats.safetensors import MAX_SHARD_BYTES, ExportError, ShardWriter, umask
from .kv_fp8 import KVScale
from .quant import ActivationScheme, InputScale, QuantizedWeight, QuantScheme, input_quant_of, quantized_of
from .sparsity import prune_mask_of
from .state import LoRA, states_of

MANIFEST = "compress_manifest.json"
REPORT = "report.json"


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


def remove_leftovers(out: Path) -> list[Path]:
    """Remove the temporary folders that runs writing ``out`` left when they were killed: ours by
    their name (``.<name>.tmp-<pid>-…``, ``.<name>.old-<pid>-…``), and only when that process is gone."""
    removed = []
    for folder in sorted(out.parent.glob(f".{out.name}.*-*-*")) if out.parent.is_dir() else []:
        kind, _, rest = folder.name[len(out.name) + 2 :].partition("-")
        pid = rest.partition("-")[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or not folder.is_dir():
            continue
        if _running(int(pid)):
            continue  # that run is still going (or another user's)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


# a write the machine refused, not the input nor our code: one line saying what to change (cli.main)
DISK_ERRORS = {
    errno.ENOSPC: "free some space or choose another --output",
    errno.EDQUOT: "free some of your quota or choose another --output",
    errno.EROFS: "choose an --output on a writable file system",
}


@contextlib.contextmanager
def output_lock(out: Path):
    """This process owns ``out`` and the folders beside it (its temporary export, its resume
    checkpoints) while it runs: a second run onto the same ``--output`` is refused instead of
    removing the first one's checkpoints. A lock left by a killed process is taken over."""
    lock = out.absolute().parent / f".{out.name}.lock"
    made = [p for p in [lock.parent, *lock.parent.parents] if not p.exists()]  # removed again if left empty
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            holder = lock.read_text().strip() if lock.is_file() else ""
            if holder.isdigit() and _running(int(holder)):
                raise ExportError(
                    f"another compress run (pid {holder}) is writing {out}; wait for it, or choose another --output"
                ) from None
            lock.unlink(missing_ok=True)  # its process is gone
    else:
        raise ExportError(f"could not take {lock} (another run starting at the same moment?); try again")
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        for folder in made:  # innermost first
            try:
                folder.rmdir()
            except OSError:
                break  # holds the export now (or something else): kept


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process


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
        self.tmp.chmod(0o777 & ~umask())  # as a plain mkdir would (mkdtemp makes it private)
        self.shards = ShardWriter(self.tmp, max_shard_bytes)
        self.linears: dict[str, tuple[QuantScheme, ActivationScheme | None] | None] = {}
        self.loras: dict[str, LoRA] = {}
        self.rounded_4bit: dict[str, str] = {}  # linears in bitsandbytes' 4-bit layout -> nf4 / fp4
        # compressed-tensors' format, from the first quantized linear: pack-quantized, int-quantized
        # (W8A8), or a float one
        self.format: str | None = None
        self.fp8_kv_cache = False  # attentions with FP8 KV-cache scales: the config names the kv_cache_scheme
        self.rotations: dict[str, int] = {}  # linears whose inputs are rotated online -> the rotation's block
        self.totals = Totals()
        # linears that only GGUF can hold (k-quants): dense in the folder, their integers kept for the
        # GGUF file in a scratch folder (``gguf_file.CODES``) until it is written
        self.gguf_codes: ShardWriter | None = None
        self.gguf_types: dict[str, str] = {}

    def _tensors_of(
        self, module: torch.nn.Module, name: str, linear: torch.nn.Module, qw: QuantizedWeight
    ) -> dict[str, torch.Tensor]:
        """The format is the whole export's, decided by the first module with quantized linears
        (every block goes through the same passes): ``int-quantized`` when any of its linears has
        int8 inputs (W8A8), and then every quantized linear is stored as int8, as before streaming."""
        if self.format is None:
            int_inputs = any((act := input_quant_of(m)) is not None and act.format == "int" for m in module.modules())
            self.format = compressed_tensors.export_format(qw.scheme, int_inputs and qw.scheme.bits == 8)
        if compressed_tensors.export_format(qw.scheme, self.format == "int-quantized") != self.format:
            raise ExportError(
                f"{name} is {qw.scheme.describe()} but an earlier linear is stored as {self.format}; "
                "an export holds one weight format"
            )
        act = input_quant_of(linear)
        if act is not None and (act.format != "int" or qw.scheme.bits < 8):
            int4 = qw.scheme.format == "int" and qw.scheme.bits <= 4 and qw.scheme.symmetric
            w4afp8 = act.format == "fp8" and int4 and qw.scheme.bits == 4
            if act.format == "int" and not int4:
                raise ExportError(
                    f"{name} has int{act.bits} activations but {qw.scheme.describe()} weights; "
                    "integer activations need symmetric int weights of at most 4 bits, or int8 (W8A8)"
                )
            if act.format not in ("int", qw.scheme.format.removesuffix("_block")) and not w4afp8:
                raise ExportError(
                    f"{name} has {act.format} activations but {qw.scheme.describe()} weights; "
                    f"{act.format} activations need {act.format} weights (or, for fp8, symmetric int4)"
                )
            return compressed_tensors.tensors(name, qw, self.format) | compressed_tensors.input_tensors(
                name, act, InputScale.of(linear)
            )
        if act is not None and self.format != "int-quantized":
            raise ExportError(
                f"{name} has int8 activations but the linears of an earlier block do not; "
                "W8A8 needs them in every block"
            )
        return compressed_tensors.tensors(name, qw, self.format)

    def add(self, module: torch.nn.Module, prefix: str = "", skip: str | None = None) -> None:
        """Write ``module``'s tensors under ``prefix`` (quantized linears packed, tied tensors once),
        leaving out the submodule ``skip`` (the decoder blocks, written one by one)."""
        name_of = {
            m: f"{prefix}{n}"
            for n, m in module.named_modules()
            if skip is None or not (n == skip or n.startswith(skip + "."))
        }
        quantized, rounded, states, kv_scales, gguf_only = {}, {}, {}, {}, {}
        for m, name in name_of.items():
            states[name] = states_of(m)
            for state in states[name]:
                if (stored := state.stored_bits(m)) is not None:
                    self.totals.weight_bits += stored[0]
                    self.totals.quantized += stored[1]
            if isinstance(m, torch.nn.Linear) and (r := bitsandbytes.Rounded4bit.of(m)) is not None:
                rounded[name] = r
                self.rounded_4bit[name] = r.quant_state.quant_type
            elif isinstance(m, torch.nn.Linear):
                qw = quantized_of(m)
                self.linears[name] = None if qw is None else (qw.scheme, input_quant_of(m))
                if qw is None and input_quant_of(m) is not None:
                    raise ExportError(
                        f"{name} has quantized activations but dense weights; give its weights the same "
                        "quantization (the same ignore list)"
                    )
                if qw is not None and gguf_file.only_in_gguf(qw.scheme):
                    gguf_only[name] = qw
                    self.linears[name] = None  # dense here: compressed-tensors has no layout for it
                elif qw is not None:
                    quantized[name] = (m, qw)
            if prune_mask_of(m) is not None:
                self.totals.zeros += (m.weight == 0).sum().item()
                self.totals.pruned += m.weight.numel()
            if isinstance(m, factored.Factored):
                self.totals.factored += m[0].weight.numel() + m[1].weight.numel()
                self.totals.replaced += m[0].in_features * m[1].out_features
            if (lora := LoRA.of(m)) is not None:
                self.loras[name] = lora
            if (kv := KVScale.of(m)) is not None:
                kv_scales[name] = kv
            if hadamard.InputRotation.of(m) is not None:
                self.rotations[name] = hadamard.block_size(m.in_features)
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
                for k, t in rounded[owner].tensors(owner).items():
                    self.shards.add(k, t)
                continue
            if owner in gguf_only and leaf == "weight":
                self._keep_codes(moe.renamed(owner, renames), gguf_only[owner])
            if tensor.data_ptr() in seen:  # tied lm_head / embeddings
                continue
            seen.add(tensor.data_ptr())
            for state in states.get(owner, ()):
                tensor = state.exported(leaf, tensor)
            self.shards.add(moe.renamed(key, renames), tensor)
        for name, kv in kv_scales.items():
            self.fp8_kv_cache = True
            for k, t in kv.tensors(name).items():
                self.shards.add(moe.renamed(k, renames), t)

    def _keep_codes(self, name: str, qw) -> None:
        if self.gguf_codes is None:
            (self.tmp / gguf_file.CODES).mkdir()
            self.gguf_codes = ShardWriter(self.tmp / gguf_file.CODES)
        for key, t in gguf_file.codes_of(name, qw).items():
            self.gguf_codes.add(key, t)
        self.gguf_types[name] = gguf_file.type_of(qw.scheme)

    def _bitsandbytes_config(self, compressed_tensors: dict | None, dtype: torch.dtype) -> dict:
        """transformers' config for 4-bit bitsandbytes weights; one checkpoint holds one layout."""
        if compressed_tensors is not None:
            raise ExportError("an export holds bitsandbytes 4-bit or integer (compressed-tensors) weights, not both")
        (quant_type, *others) = set(self.rounded_4bit.values())
        if others:
            raise ExportError(f"an export holds one bitsandbytes 4-bit type; found {quant_type} and {others[0]}")
        return bitsandbytes.config(quant_type, dtype, [name for name, s in self.linears.items() if s is None])

    def finish(self, model: torch.nn.Module, tokenizer, recipe_text: str, manifest: dict, gguf=None) -> Path:
        """Config, tokenizer, recipe, the GGUF file when the recipe's ``export`` (``gguf``) asks for
        one, and manifest (sha256 per file) beside the shards, in the temporary folder, which is
        returned: ``publish`` puts it in place."""
        try:
            self.shards.close()
            peft_adapter.write(self.loras, self.tmp)
            if (head := EagleState.of(model)) is not None:
                eagle_head.write(head.head, self.tmp, head.log)
            config = model.config.to_dict()
            config.pop("auto_map", None)  # code references: an export runs no code from a repository
            config.pop("quantization_config", None)
            qconfig = compressed_tensors.config(
                self.linears, self.format or "pack-quantized", self.fp8_kv_cache, self.rotations
            )
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
            if self.gguf_codes is not None:
                self.gguf_codes.close()
                if gguf is None:
                    raise ExportError(f"{next(iter(self.gguf_types))} holds GGUF-only integers: export format: gguf")
            if gguf is not None:
                out = self.tmp / gguf_file.file_name(gguf.type)
                gguf_file.write(self.tmp, gguf.type, out, gguf.embedding, self.gguf_types)
            shutil.rmtree(self.tmp / gguf_file.CODES, ignore_errors=True)
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
        for writer in (self.shards, self.gguf_codes):
            if writer is not None and not writer.data.closed:
                writer.data.close()
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


def add_evaluation(folder: Path, evaluation: dict, key: str = "eval") -> Path:
    """Fill in the evaluation of an export (``compress eval DIR --write-report``): ``report.json``'s
    ``eval`` (or ``tasks``, the task scores) and the manifest's ``evaluated``, each file replaced
    whole (written beside, then renamed)."""
    report_path, manifest_path = folder / REPORT, folder / MANIFEST
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    manifest = json.loads(manifest_path.read_text())
    written = [(report_path, {**report, key: evaluation})]
    if key == "eval":  # the manifest says whether perplexity was scored
        written.append((manifest_path, {**manifest, "evaluated": True}))
    for path, content in written:
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(content, indent=2))
        os.replace(partial, path)
    return report_path


def size_on_disk(folder: Path) -> int:
    """Bytes of weights: the checkpoint's safetensors and an adapter's, if any; for an export with a
    GGUF file, that file's (what llama.cpp loads; a k-quant export keeps its linears dense beside it).
    An EAGLE draft head beside the model is not the model's size (its training log says its own)."""
    if ggufs := sorted(Path(folder).glob("*.gguf")):
        return ggufs[0].stat().st_size
    files = Path(folder).rglob("*.safetensors")
    return sum(p.stat().st_size for p in files if p.relative_to(folder).parts[0] != eagle_head.FOLDER)
