"""Command line: ``compress apply | eval | recipes``.

Expected failures (bad recipe, missing model, offline hub, existing output) print
one line saying what to change and exit with status 2; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from .arch import UnknownArchitecture
from .data import DataError
from .export import MANIFEST, ExportError
from .models import DEFAULT_MODEL, ModelLoadError
from .passes import RecipeError

USER_ERRORS = (RecipeError, ModelLoadError, DataError, ExportError, UnknownArchitecture)


def _apply(args) -> None:
    from . import recipe as recipes
    from .apply import apply, format_table

    recipe = recipes.load(args.recipe)
    report = apply(recipe, args.model, args.output, args.device, args.dtype, args.seed, args.overwrite,
                   evaluate_after=not args.no_eval, eval_windows=args.windows, eval_seqlen=args.seqlen,
                   samples=args.samples)
    print()
    print(f"model: {report.model}    output: {report.output}")
    print(f"calibration: {report.calibration}")
    if report.eval:
        print(f"evaluation: {report.eval['protocol']}")
    print(format_table([report]))


def _eval(args) -> None:
    from . import models
    from .evaluate import evaluate

    dtype = models.parse_dtype(args.dtype)
    device = models.pick_device(args.device)
    loaded = models.load(args.model, dtype)
    reference = args.reference
    manifest = Path(args.model) / MANIFEST
    if reference is None and manifest.exists():
        reference = json.loads(manifest.read_text()).get("base_model")
    ref_model = (models.for_compute(models.load(reference, dtype).model, device)
                 if reference and reference != "none" else None)
    result = evaluate(models.for_compute(loaded.model, device), loaded.tokenizer, args.ppl, args.seqlen, args.windows,
                      ref_model)
    print(f"model: {args.model}    reference: {reference or 'none'}")
    print(f"protocol: {result.protocol}")
    print(f"perplexity: {result.ppl:.4f}")
    if ref_model is not None:
        print(f"reference perplexity: {result.ref_ppl:.4f}    KL: {result.kl:.5f} nats/token    "
              f"top-1 agreement: {result.top1:.4f}")


def _recipes(args) -> None:
    from .recipe import shipped

    rows = shipped()
    width = max(len(n) for n, _ in rows)
    for name, summary in rows:
        print(f"{name.ljust(width)}  {summary}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="compress", description="Compress, export and evaluate LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
        p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")

    p = sub.add_parser("apply", help="run a recipe: compress, export, evaluate")
    p.add_argument("recipe", help="a recipe file, or the name of a shipped one (see `compress recipes`)")
    p.add_argument("--model", help=f"alias (smollm2-135m, gemma3-270m), local HF folder or hub id "
                                    f"(default: the recipe's, else {DEFAULT_MODEL})")
    p.add_argument("--output", help="output folder (default: out/<recipe>-<model>)")
    p.add_argument("--seed", type=int, help="overrides the recipe's seed")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--samples", type=int, help="calibration samples (overrides the recipe)")
    p.add_argument("--windows", type=int, help="evaluation windows (overrides the recipe)")
    p.add_argument("--seqlen", type=int, help="evaluation window length (overrides the recipe)")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation")
    common(p)
    p.set_defaults(func=_apply)

    p = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of a model or exported folder")
    p.add_argument("model", help="exported folder, local HF folder or alias")
    p.add_argument("--ppl", default="wikitext2", help="wikitext2, c4, pile-val or a .txt/.jsonl file")
    p.add_argument("--windows", type=int, default=40)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--reference", help="uncompressed model to compare against (default: the export's base "
                                       "model; 'none' to skip)")
    common(p)
    p.set_defaults(func=_eval)

    p = sub.add_parser("recipes", help="list the shipped recipes")
    p.set_defaults(func=_recipes)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.simplefilter("default")
    try:
        args.func(args)
    except USER_ERRORS as e:
        print(f"compress: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("compress: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
