"""The sha256 of what every shipped recipe exports, to show that a change of the code changes no export.

Each shipped recipe runs (``apply`` without evaluation, 4 calibration samples of 64 tokens, training
passes cut to 2 steps) on a tiny random Llama and a tiny random Qwen3-MoE, both with the bundled
SmolLM2 tokenizer; with ``--smollm2``, ``rtn-w4`` and ``gptq-w4`` also run on the real SmolLM2 (16
samples). The weight files (safetensors, GGUF, an adapter's) and ``config.json`` are hashed; a
recipe that a model refuses records its one-line error instead.

Floating-point sums differ between CPUs (vector widths, library kernels), so hashes are kept per
kind of numerics: ``--write`` records this machine's under its key (a fingerprint of how it computes
a few products and factorisations, threads, torch; the machines seen with it are listed beside),
run on a tree whose exports are known to be right; a plain run compares with them and exits 1 on a
difference.
``tests/test_export_hashes.py`` runs the tiny models' check where hashes of this machine exist.

    python scripts/export_hashes.py --write [--smollm2]   # record, on a trusted tree
    python scripts/export_hashes.py [--smollm2]           # compare
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import yaml

TABLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "export_hashes.json"
SMOLLM2_RECIPES = ("rtn-w4", "gptq-w4")


def numerics() -> str:
    """sha256 of float work of the kinds the passes do (products and Gram matrices in float32,
    float64 and bfloat16, sums, softmax, Cholesky factors, triangular inverses, SVDs) on fixed
    inputs, at the tiny models' widths and SmolLM2's. Machines that compute these alike are taken
    to export alike: a CPU's name, family and flags do not tell (two AMD EPYCs reporting family 25
    and the same AVX-512 flags exported nine recipes differently, and one of them exported as a
    family 26 did)."""
    g, h = torch.Generator().manual_seed(0), hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        h.update(t.detach().float().contiguous().numpy().tobytes())

    for n in (64, 128, 576):
        x, w = torch.randn(512, n, generator=g), torch.randn(2 * n, n, generator=g)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            xd = x.to(dtype)
            gram = xd.T @ xd
            add(gram)
            add(torch.nn.functional.linear(xd, w.to(dtype)))
            add(xd.sum(0))
            add(xd.pow(2).mean(-1))
            add(torch.softmax(xd, -1))
            if dtype is not torch.bfloat16:
                factor = torch.linalg.cholesky(gram + n * torch.eye(n, dtype=dtype))
                add(factor)
                add(torch.linalg.solve_triangular(factor, torch.eye(n, dtype=dtype), upper=False))
                add(torch.linalg.svd(w.to(dtype), full_matrices=False).S)
    return h.hexdigest()


def machine_key() -> str:
    """The table's key: how this machine computes (``numerics``), with its thread count and torch."""
    return f"numerics {numerics()[:16]}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def tiny_models(folder: Path) -> dict[str, Path]:
    """A tiny random Llama and Qwen3-MoE (2 blocks, hidden 64/128, head dim 64 as the KV recipes
    need) with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from compress import models

    tokenizer = AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))
    common = dict(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    configs = {
        "tiny-llama": AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, head_dim=64, **common),
        "tiny-moe": AutoConfig.for_model(
            "qwen3_moe",
            hidden_size=128,
            intermediate_size=128,
            moe_intermediate_size=64,
            head_dim=64,
            num_experts=4,
            num_experts_per_tok=2,
            **common,
        ),
    }
    out = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval().to(torch.bfloat16)
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
        out[name] = folder / name
    return out


def quick(text: str, samples: int, seqlen: int) -> str:
    """The recipe with a short calibration and training passes cut to 2 steps."""
    data = yaml.safe_load(text)
    data["calibration"] = {**data.get("calibration", {}), "samples": samples, "seqlen": seqlen}
    for entry in data["passes"]:
        ((_, options),) = entry.items()
        if isinstance(options, dict) and "steps" in options:
            options["steps"] = 2
    return yaml.safe_dump(data, sort_keys=False)


def gguf_digest(path: Path) -> str:
    """sha256 of a GGUF file's tensors (names, types, bytes) and metadata, but ``general.name``
    (the folder the model was read from)."""
    import gguf

    reader, h = gguf.GGUFReader(path), hashlib.sha256()
    for key, field in reader.fields.items():
        if key != "general.name":
            h.update(key.encode() + b"".join(bytes(part) for part in field.parts))
    for t in reader.tensors:
        h.update(t.name.encode() + str(t.tensor_type).encode() + bytes(t.data))
    return h.hexdigest()


def hashes_of(folder: Path) -> dict[str, str]:
    """sha256 of the weight files and of config.json, the latter without ``_name_or_path`` (the
    folder the model was read from, a temporary one here); GGUF files by ``gguf_digest``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".gguf"))
    out = {
        str(p.relative_to(folder)): gguf_digest(p)
        if p.suffix == ".gguf"
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in files
    }
    config = json.loads((folder / "config.json").read_text())
    config.pop("_name_or_path", None)
    out["config.json"] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return dict(sorted(out.items()))


def run(recipe_name: str, model: Path, out: Path, samples: int, seqlen: int) -> dict[str, str] | str:
    from compress import recipe as recipes
    from compress.apply import apply

    text = quick(recipes.load(recipe_name).text, samples, seqlen)
    try:
        recipe = recipes.parse(text, recipe_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            apply(recipe, str(model), out, evaluate_after=False, keep_blocks=False)
    except Exception as e:  # a recipe this model refuses: its message is what is kept
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return hashes_of(out)


def measure(smollm2: bool, only: list[str] | None = None) -> dict[str, dict]:
    from compress import recipe as recipes

    names = [name for name, *_ in recipes.shipped() if not only or name in only]
    result: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        targets = [(m, path, names, 4, 64) for m, path in tiny_models(tmp).items()]
        if smollm2:
            targets.append(("smollm2-135m", "smollm2-135m", [n for n in SMOLLM2_RECIPES if n in names], 16, 512))
        for model_name, path, recipe_names, samples, seqlen in targets:
            for name in recipe_names:
                start = time.perf_counter()
                got = run(name, path, tmp / f"{model_name}-{name}", samples, seqlen)
                result.setdefault(model_name, {})[name] = got
                what = got if isinstance(got, str) else f"{len(got)} files"
                print(f"| {model_name} | {name} | {time.perf_counter() - start:.1f} s | {what} |", flush=True)
    return result


def compare(recorded: dict, measured: dict) -> list[str]:
    return [
        f"{model} {name}: recorded {recorded[model][name]!r}, now {got!r}"
        for model, by_recipe in measured.items()
        for name, got in by_recipe.items()
        if model in recorded and name in recorded[model] and recorded[model][name] != got
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record this machine's hashes")
    parser.add_argument("--smollm2", action="store_true", help="also rtn-w4 and gptq-w4 on SmolLM2 (minutes)")
    parser.add_argument("--recipes", nargs="*", help="only these shipped recipes")
    args = parser.parse_args()
    from compress import machine

    print(f"# export hashes: {' '.join(sys.argv)}\n# {machine.describe()}\n| model | recipe | time | result |")
    print("|---|---|---|---|", flush=True)
    measured = measure(args.smollm2, args.recipes)
    table = json.loads(TABLE.read_text()) if TABLE.is_file() else {}
    key = machine_key()
    if args.write:
        mine = table.setdefault(key, {})
        mine["machines"] = sorted({*mine.get("machines", []), machine.describe()})
        for model, by_recipe in measured.items():
            mine.setdefault(model, {}).update(by_recipe)
        TABLE.parent.mkdir(exist_ok=True)
        TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        print(f"recorded under {key}")
        return 0
    if key not in table:
        print(f"no hashes recorded for this machine ({key}); record them with --write on a trusted tree")
        return 1
    differences = compare(table[key], measured)
    print("\n".join(differences) or "every export is byte for byte as recorded")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
