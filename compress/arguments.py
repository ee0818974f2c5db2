"""The ``compress`` command line's arguments: every option, its type and its help, and the argparse
types that refuse a bad value in one line naming the option."""

from __future__ import annotations

import argparse
import math
import sys

from .decode.methods import METHODS
from .formats import gguf_file
from .formats.gguf_file import TYPES as GGUF_TYPES
from .models import DEFAULT_MODEL


def _whole(least: int):
    """An argparse type: a whole number of at least ``least`` (0 never means "the default")."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"give {least} or more; got {n}")
        return n

    return parse


def _task_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give one or more task names, comma-separated")
    return names


def _number(low: float, high: float = math.inf, low_open: bool = False, auto: bool = False):
    """An argparse type: a number in [low, high] (``low_open``: (low, high]); ``auto`` allowed if said."""

    def parse(text: str) -> float | str:
        if auto and text == "auto":
            return text
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: write a number{' or auto' if auto else ''}") from None
        if not (low < x if low_open else low <= x) or not x <= high:  # (NaN fails both)
            span = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if high < math.inf else f"of {low:g} or more"
            raise argparse.ArgumentTypeError(f"give a number {span}; got {text}")
        return x

    return parse


def _bits(text: str) -> float | str:
    """An argparse type: a positive, finite number of bits per weight, or a GGUF k-quant file type
    (the size of llama.cpp's own file of that type)."""
    if text.lower() in gguf_file.MIX_BASE:
        return text.lower()
    try:
        bits = float(text)
    except ValueError:
        mixes = ", ".join(gguf_file.MIX_BASE)
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor a GGUF k-quant type ({mixes})") from None
    if not 0 < bits < float("inf"):
        raise argparse.ArgumentTypeError(f"give a positive number of bits per weight; got {text}")
    return bits


def _path(text: str) -> str:
    """An argparse type: a path, not an empty string (which would fall back to a default unseen)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a path, not an empty string")
    return text


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("compress")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line naming the argument and the command's --help, exit status 2."""

    def error(self, message: str):
        print(f"compress: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(commands: dict) -> argparse.ArgumentParser:
    """The command line: each subcommand calls ``commands[its name](args)``."""
    parser = _Parser(prog="compress", description="Compress, export and evaluate LLMs.")
    parser.add_argument("--version", action="version", version=f"compress {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p, dtype_default="bfloat16", dtype_help="bfloat16 (default), float16 or float32"):
        p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if present)")
        p.add_argument("--dtype", default=dtype_default, help=dtype_help)
        p.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error")

    p = sub.add_parser("apply", help="run a recipe: compress, export, evaluate")
    p.add_argument("recipe", help="a recipe file, or the name of a shipped one (see `compress recipes`)")
    p.add_argument(
        "--model",
        help=f"alias (smollm2-135m, gemma3-270m), local HF folder or hub id "
        f"(default: the recipe's, else {DEFAULT_MODEL})",
    )
    p.add_argument("--output", type=_path, help="output folder (default: out/<recipe>-<model>)")
    p.add_argument("--seed", type=_whole(0), help="overrides the recipe's seed")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.add_argument("--samples", type=_whole(1), help="calibration samples (overrides the recipe)")
    p.add_argument("--windows", type=_whole(1), help="evaluation windows (overrides the recipe)")
    p.add_argument("--seqlen", type=_whole(2), help="evaluation window length (overrides the recipe)")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation")
    p.add_argument("--max-shard-mb", type=_whole(1), help="largest safetensors shard of the export (default 2048)")
    p.add_argument(
        "--spill",
        metavar="DIR",
        help="keep calibration activations in files under DIR instead of "
        "RAM (many samples of a big model; the plan prints their size)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue a killed run of the same command: the blocks it finished (kept in .OUTPUT.resume "
        "beside the output until the export is in place) are read back, not compressed again",
    )
    p.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="do not keep finished blocks beside the output (saves that disk space; no --resume)",
    )
    p.add_argument(
        "--calibration-dtype",
        choices=["auto", "float32", "bfloat16"],
        help="what the blocks compute in while calibrating (overrides the recipe; auto: float32 on a CPU, "
        "the model's dtype on a GPU; bfloat16 about halves a sweep on a CPU with AVX512-BF16 or AMX)",
    )
    p.add_argument(
        "--target-bpw",
        type=_bits,
        metavar="BITS",
        help="give each quantized linear the scheme it can bear so that the model's bits per weight (scales "
        "included) is at most BITS, or, for a recipe that exports GGUF k-quants, the size of llama.cpp's own "
        "file of a type (e.g. q4_k_m) (sets the recipe's allocate.target_bpw; see docs/recipes.md)",
    )
    common(p, None, "bfloat16 (default; float32 for a recipe that exports GGUF), float16 or float32")
    p.set_defaults(func=commands["apply"])

    p = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of a model, an export or a GGUF file")
    p.add_argument(
        "model",
        help="exported folder, local HF folder, alias, or a .gguf file (scored by llama.cpp: the [llama] extra)",
    )
    p.add_argument("--ppl", default="wikitext2", help="wikitext2, c4, pile-val or a .txt/.jsonl file")
    p.add_argument("--windows", type=_whole(1), default=40)
    p.add_argument("--seqlen", type=_whole(2), default=2048)
    p.add_argument(
        "--reference", help="uncompressed model to compare against (default: the export's base model; 'none' to skip)"
    )
    p.add_argument(
        "--write-report",
        action="store_true",
        help="write the result into the export's report.json (an `apply --no-eval` export)",
    )
    p.add_argument(
        "--tasks",
        type=_task_list,
        help="comma-separated lm-evaluation-harness tasks instead of perplexity: lm-eval task names, the shipped "
        "offline wikitext_cloze and wikitext_lastword, or task YAML files (the [tasks] extra; docs/evaluation.md)",
    )
    p.add_argument("--limit", type=_whole(1), help="--tasks: score only the first N documents of each task")
    p.add_argument("--num-fewshot", type=_whole(0), help="--tasks: few-shot examples (default: each task's own)")
    p.add_argument(
        "--bitsandbytes",
        choices=["nf4", "nf4-double", "fp4", "int8"],
        help="score MODEL as transformers' load_in_4bit (nf4, nf4 with double quantization, fp4) or "
        "load_in_8bit (int8: LLM.int8) gives it; the reference is MODEL itself",
    )
    common(p)
    p.set_defaults(func=commands["eval"])

    p = sub.add_parser("decode", help="generate from a model or export; greedy or speculative")
    p.add_argument("model", help="exported folder, local HF folder or alias")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--method",
        choices=list(METHODS),
        help="default: prompt-lookup. All but early-exit are lossless: greedy output, or the target's "
        "sampling distribution (lookahead on CUDA: not exact)",
    )
    p.add_argument(
        "--layers",
        default="auto",
        help="self-spec: the layers that draft, e.g. 0-11 or 0-14,16,18 "
        "(default auto: searched for speed on two calibration prompts)",
    )
    p.add_argument(
        "--draft",
        help="draft model for --method draft (e.g. a compressed export of the same model), or "
        "self-w4: the target's linears rounded to 4 bits in memory, on the int4 kernel; "
        "with --method prompt-lookup it drafts where lookup finds no match",
    )
    p.add_argument(
        "--draft-head",
        metavar="FOLDER",
        help="eagle, eagle-tree, eagle-lookup: the EAGLE head (an export holding eagle/, or that folder; "
        "default: the one saved with the model, by the eagle pass)",
    )
    p.add_argument(
        "--exit-threshold",
        type=_number(0, 1, low_open=True, auto=True),
        default="auto",
        help="early-exit: confidence needed to leave early (auto: calibrated for 90%% top-1 agreement)",
    )
    p.add_argument("--exit-measure", choices=["softmax", "saturation"], default="softmax")
    p.add_argument("--window", type=_whole(1), default=3, help="lookahead: Jacobi window width W (paper: 15 on GPUs)")
    p.add_argument("--ngram", type=_whole(2), default=3, help="lookahead: n-gram size N (paper: 5)")
    p.add_argument(
        "--guesses", type=_whole(1), default=5, help="lookahead: pool candidates verified per step G (paper: 15)"
    )
    p.add_argument("--k", type=_whole(1), default=8, help="most candidates verified per target forward")
    p.add_argument(
        "--threshold", type=_number(0, 1), default=0.4, help="draft model: stop drafting below this probability"
    )
    p.add_argument(
        "--token-cost",
        type=_number(0, auto=True),
        default="auto",
        help="prompt-lookup: what one more token costs in a target forward, as a share of a one-token "
        "forward; fewer candidates are sent the dearer they are (auto: 0.05 on a CPU, 0 on a GPU or "
        "with --compile; "
        "0 sends every match in full)",
    )
    p.add_argument(
        "--datastore",
        metavar="FILE.json",
        help="prompt-lookup: also copy from the model's outputs on earlier requests kept in this file "
        "(created if missing; this output is added to it)",
    )
    p.add_argument("--max-new-tokens", type=_whole(1), default=128)
    p.add_argument("--temperature", type=_number(0, 100), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=_number(0, 1, low_open=True), default=1.0)
    p.add_argument("--seed", type=_whole(0), default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--kernel",
        choices=[
            *("auto", "dense", "fp32", "fp32-onednn", "bf16", "bf16-avx2", "int8"),
            *("int4", "int4-avx2", "int4-a16", "int4-a8", "int8g-avx2", "fp8"),
        ],
        default="auto",
        help="auto: each linear group runs on the fastest format measured here among those that hold "
        "its weights exactly (fp32, bf16, int8 for per-channel W8, int4 for W4 exports, our own "
        "bf16-avx2, int4-avx2, int4-a16 and int8g-avx2 (integers of up to 8 bits in groups: GGUF's "
        "block types) kernels on AVX2 CPUs; W8A8 exports on torch._int_mm; FP8 exports on "
        "torch._scaled_mm on a GPU); dense: fp32 "
        "matmuls; a format: used wherever it is exact; int4-a8: W4 weights on our kernel with each "
        "step's activations rounded to int8 per 64 (lossy, never chosen by auto; faster where "
        "int4 products are compute-bound); fp8: FP8 weights and inputs on torch._scaled_mm, each "
        "input rounded as vLLM rounds it (also on a CPU, where torch's FP8 product is slow)",
    )
    p.add_argument(
        "--lm-head",
        choices=["exact", "int8", "int4", "argmax"],
        default="exact",
        help="the output layer as the model holds it (default), or rounded to int8/int4 in memory for "
        "decoding (lossy: on SmolLM2 it is 21%% of the weight bytes a token reads); argmax: int8 scores "
        "with the rows that could be the largest recomputed exactly, so greedy decodes the exact "
        "head's tokens at about half its reads (CPU, our kernels; elsewhere the exact head)",
    )
    p.add_argument(
        "--cache-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the KV cache's dtype: auto (the stream's; bf16 under int4-a8) or one of these; bfloat16 "
        "under an fp32 stream halves what attention reads (lossy against fp32 greedy)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the engine's steps (one token, and verify steps of up to 8) with AOTInductor: a "
        "minute or more the first time; the compiled step is kept under $COMPRESS_CACHE/engine "
        "(about 1.4x the model's bf16 size) and later runs load it in seconds",
    )
    common(p)
    p.set_defaults(func=commands["decode"])

    p = sub.add_parser("report", help="several exports side by side: report.md and plots of quality against size")
    p.add_argument("exports", nargs="+", help="export folders written by `compress apply`")
    p.add_argument(
        "--output", type=_path, default="report", help="folder for report.md and the PNG plots (default: report)"
    )
    p.add_argument("--out", dest="output", type=_path, help=argparse.SUPPRESS)  # the name it had before 0.1
    p.add_argument("--overwrite", action="store_true", help="replace a report.md or plot that we did not write")
    p.set_defaults(func=commands["report"])

    p = sub.add_parser("export", help="write a GGUF file for llama.cpp from an export of ours")
    p.add_argument("folder", help="an export folder written by `compress apply`")
    p.add_argument("--gguf", required=True, choices=list(GGUF_TYPES), help="block type of the quantized linears")
    p.add_argument(
        "--embedding",
        choices=["dense", "q8_0"],
        default="dense",
        help="token embedding (and a dense lm_head): as exported (default) or Q8_0, as llama.cpp's quantizer does",
    )
    p.add_argument("--output", type=_path, help="the .gguf file (default: FOLDER/model-TYPE.gguf)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing .gguf file")
    p.set_defaults(func=commands["export"])

    p = sub.add_parser("recipes", help="list the shipped recipes")
    p.set_defaults(func=commands["recipes"])
    return parser
