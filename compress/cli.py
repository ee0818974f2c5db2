"""Command line: ``compress apply | eval | decode | report | export | recipes``.

``apply`` and ``eval`` also run as several processes: ``torchrun --nproc-per-node N -m compress apply ...``.

Expected failures (bad recipe, missing model, offline hub, existing output) print
one line saying what to change and exit with status 2; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from . import distributed
from .arch import UnknownArchitecture
from .data import DataError
from .decode import DecodeError
from .export import MANIFEST, ExportError
from .formats.gguf_file import TYPES as GGUF_TYPES
from .formats.gguf_file import GGUFError
from .formats.safetensors import CheckpointError
from .memory import MemoryPlanError
from .models import DEFAULT_MODEL, ModelLoadError
from .passes import RecipeError
from .report import ReportError
from .resume import ResumeError

USER_ERRORS = (
    RecipeError,
    GGUFError,
    ModelLoadError,
    DataError,
    ExportError,
    UnknownArchitecture,
    DecodeError,
    CheckpointError,
    MemoryPlanError,
    ResumeError,
    ReportError,
    distributed.DistributedError,
)


def _apply(args) -> None:
    from . import recipe as recipes
    from .apply import apply, format_table

    recipe = recipes.load(args.recipe)
    report = apply(
        recipe,
        args.model,
        args.output,
        args.device,
        args.dtype,
        args.seed,
        args.overwrite,
        evaluate_after=not args.no_eval,
        eval_windows=args.windows,
        eval_seqlen=args.seqlen,
        samples=args.samples,
        max_shard_mb=args.max_shard_mb,
        spill=args.spill,
        resume_run=args.resume,
        keep_blocks=not args.no_checkpoints,
        calibration_dtype=args.calibration_dtype,
    )
    if report is None:  # a rank other than 0 of a torchrun run: rank 0 reports
        return
    print()
    print(f"model: {report.model}    output: {report.output}")
    print(f"calibration: {report.calibration}")
    for where, log in report.training.items():  # blockwise logs per block, the others once
        logs = list(log.values()) if all(isinstance(v, dict) for v in log.values()) else [log]
        first, last = (sum(entry[k] for entry in logs) / len(logs) for k in ("loss_first", "loss_last"))
        per = f" per block, mean over {len(logs)} blocks" if len(logs) > 1 else ""
        print(f"{where}: training loss {first:.4g} -> {last:.4g} ({logs[0]['steps']} steps{per})")
    if report.eval:
        print(f"evaluation: {report.eval['protocol']}")
    print(format_table([report]))


def _export(args) -> None:
    from .formats import gguf_file

    folder = Path(args.folder)
    if not (folder / MANIFEST).is_file():
        raise ExportError(f"{folder} is not an export of ours (no {MANIFEST}); run `compress apply` first")
    out = Path(args.output) if args.output else folder / gguf_file.file_name(args.gguf)
    if out.exists() and not (args.overwrite and out.is_file() and out.suffix == ".gguf"):
        why = "pass --overwrite" if out.is_file() and out.suffix == ".gguf" else "choose another --output"
        raise ExportError(f"{out} exists; {why}")
    if not os.access(out.absolute().parent, os.W_OK):
        raise ExportError(f"{out.absolute().parent} is not writable; choose another --output")
    written = gguf_file.write(folder, args.gguf, out, args.embedding)
    print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB)")


def _eval(args) -> None:
    from . import bnb, export, models
    from .evaluate import evaluate

    dtype = models.parse_dtype(args.dtype)
    device = models.pick_device(args.device)
    manifest = Path(args.model) / MANIFEST
    if args.write_report and not manifest.is_file():
        raise ExportError(
            f"--write-report: {args.model} is not an export of ours (no {MANIFEST}); "
            "it fills in the report of an `apply --no-eval` export"
        )
    if args.write_report and not os.access(args.model, os.W_OK):
        raise ExportError(f"--write-report: {args.model} is not writable")
    reference = args.reference
    if args.bitsandbytes:  # the model as load_in_4bit / load_in_8bit gives it, against itself unrounded
        if args.write_report:
            raise ExportError("--write-report fills in an export's report; --bitsandbytes writes no export")
        loaded = bnb.load(args.model, args.bitsandbytes, device, dtype)
        bits, count = bnb.bits_per_weight(loaded.model.model)  # before a forward moves LLM.int8's scales
        reference = args.model if reference is None else reference
    else:
        loaded = models.open_streamed(args.model, dtype)  # a block at a time: no model is held whole
    if reference is None and manifest.exists():
        reference = json.loads(manifest.read_text()).get("base_model")
    ref_model = models.open_streamed(reference, dtype).model if reference and reference != "none" else None
    result = evaluate(loaded.model, loaded.tokenizer, args.ppl, args.seqlen, args.windows, ref_model, device=device)
    if not distributed.is_main():  # torchrun: every rank scored its windows; rank 0 reports
        return
    print(f"model: {args.model}    reference: {reference or 'none'}")
    print(f"protocol: {result.protocol}")
    if args.bitsandbytes:
        print(f"bitsandbytes {args.bitsandbytes}: {bits:.3f} bits per weight over {count:,} linear weights")
    print(f"perplexity: {result.ppl:.4f}")
    if ref_model is not None:
        print(
            f"reference perplexity: {result.ref_ppl:.4f}    KL: {result.kl:.5f} nats/token    "
            f"top-1 agreement: {result.top1:.4f}"
        )
    if args.write_report:
        print(f"report: {export.add_evaluation(Path(args.model), result.as_dict())}")


def _decode(args) -> None:
    from . import decode, kv_quant, models
    from .data import tokenizer_fingerprint
    from .decode import kernels
    from .decode.datastore import Datastore
    from .decode.engine import Engine

    device = _decode_device(args)
    loaded = models.load(args.model, models.parse_dtype(args.dtype))
    model, tokenizer = models.for_compute(loaded.model, device), loaded.tokenizer
    prompt = _prompt_ids(args, tokenizer).to(device)
    if Path(args.model).is_dir():
        kernels.attach_from_export(model, args.model)  # the export's integers, for the int4/int8 kernels
    eos = model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else eos or [])
    sampling = decode.Sampling(args.temperature, args.top_p, args.seed)
    cache = kv_quant.new_cache(model)
    room = prompt.shape[1] + args.max_new_tokens + args.k + 1

    def engine(m, **kw):
        cache_dtype = None if args.cache_dtype == "auto" else models.parse_dtype(args.cache_dtype)
        built = Engine(m, kernel=args.kernel, max_len=room, compile=args.compile, cache_dtype=cache_dtype, **kw)
        print(
            f"[decode engine: {built.describe()}; stream {str(built.dtype).removeprefix('torch.')}; "
            f"{built.weight_bytes() / 1e6:.0f} MB of weights per token]",
            file=sys.stderr,
        )
        return built

    if args.lm_head == "int8" and device.type != "cpu":
        raise decode.DecodeError("--lm-head int8 runs on the CPU only; use --lm-head int4 on a GPU")
    if args.lm_head == "argmax" and not sampling.greedy:
        raise decode.DecodeError(
            "--lm-head argmax makes only the largest logit exact, so it decodes greedily; drop --temperature "
            "or use --lm-head exact to sample"
        )
    # every method runs on the engine (KIVI caches too); a lossy lm_head for the target only
    target = engine(model, lm_head=None if args.lm_head == "exact" else args.lm_head)
    if args.method == "greedy":
        if not sampling.greedy:
            raise decode.DecodeError("--method greedy takes no --temperature; use prompt-lookup or draft to sample")
        result = decode.greedy(target, prompt, args.max_new_tokens, eos)
    elif args.method == "early-exit":
        if not sampling.greedy or cache is not None:
            raise decode.DecodeError("--method early-exit is greedy with a full-precision cache; drop --temperature")
        result = _early_exit(args, model, target, tokenizer, prompt, eos)
    elif args.method == "lookahead":
        from .decode.lookahead import lookahead

        result = lookahead(target, prompt, args.max_new_tokens, args.window, args.ngram, args.guesses, eos, sampling)
    else:
        draft = _draft(args, model, tokenizer, device, engine, sampling)
        if args.method == "draft":
            if draft is None:
                raise decode.DecodeError("--method draft needs --draft MODEL (same tokenizer) or --draft self-w4")
            proposer = draft
        elif args.method == "self-spec":
            proposer = decode.DraftModel(
                decode.layer_subset(target, _draft_layers(args, target, tokenizer, device)), args.threshold, sampling
            )
        else:
            cost = decode.default_token_cost(target) if args.token_cost == "auto" else args.token_cost
            store = Datastore.load(args.datastore, tokenizer_fingerprint(tokenizer)) if args.datastore else None
            proposer = decode.PromptLookup(token_cost=cost, store=store)
            proposer = decode.LookupThenDraft(proposer, draft) if draft else proposer
        result = decode.speculate(target, prompt, args.max_new_tokens, proposer, args.k, sampling, eos)
        if args.datastore:
            store.add(result.tokens)
            store.save(args.datastore)
    print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    _print_speed(args, result, target, device)


def _decode_device(args):
    """The device, once the options that do not fit together or this machine are refused."""
    from . import decode, models
    from .decode import kernels, native

    if args.datastore and args.method not in (None, "prompt-lookup"):
        raise decode.DecodeError(f"--datastore is for --method prompt-lookup, not {args.method}")
    if args.draft and args.method not in (None, "draft", "prompt-lookup"):
        raise decode.DecodeError(f"--draft is for --method draft or prompt-lookup, not {args.method}")
    device = models.pick_device(args.device)
    if args.kernel == "int4" and not kernels.int4_kernel_available(device):
        raise decode.DecodeError(
            f"--kernel int4: this torch build has no int4 kernel for {device.type} "
            "(on a GPU it needs compute capability 8.0 or newer); use --kernel auto"
        )
    if args.kernel in native.FORMATS and (device.type != "cpu" or not native.available()):
        raise decode.DecodeError(
            f"--kernel {args.kernel}: our AVX2 kernels are not available here (they need an "
            "x86 CPU with AVX2 and FMA, a C++ compiler, and COMPRESS_NATIVE unset); "
            "use --kernel auto"
        )
    args.method = args.method or "prompt-lookup"
    if device.type == "cuda" and args.method == "lookahead":  # docs/results.md, the CUDA section
        print(
            "[decode: on CUDA, lookahead's tree steps run without CUDA graphs and round unlike them: slower than "
            "--method greedy there, and its output can differ from greedy's at near-ties]",
            file=sys.stderr,
        )
    return device


def _prompt_ids(args, tokenizer):
    """``--prompt`` as token ids: in the model's chat template unless ``--raw`` (or it has none)."""
    from . import decode

    if args.raw or tokenizer.chat_template is None:
        prompt = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
    if prompt.numel() == 0:
        raise decode.DecodeError("the prompt is empty: give --prompt some text")
    return prompt


def _draft(args, model, tokenizer, device, engine, sampling):
    """``--draft``: the target rounded to 4 bits in memory (``self-w4``), another model sharing its
    vocabulary, or None."""
    from . import decode, models
    from .data import tokenizer_fingerprint
    from .decode import kernels

    if args.draft == "self-w4":
        return decode.DraftModel(engine(model, quantize="w4", kivi=False), args.threshold, sampling)
    if not args.draft:
        return None
    other = models.load(args.draft, models.parse_dtype(args.dtype))
    if tokenizer_fingerprint(other.tokenizer) != tokenizer_fingerprint(tokenizer):
        raise decode.DecodeError(
            f"--draft {args.draft} has another tokenizer than {args.model}; a draft must share the target's vocabulary"
        )
    if other.model.config.vocab_size != model.config.vocab_size:
        raise decode.DecodeError(
            f"--draft {args.draft} has a vocabulary of {other.model.config.vocab_size} "
            f"tokens, {args.model} of {model.config.vocab_size}; a draft must share "
            "the target's vocabulary"
        )
    draft_model = models.for_compute(other.model, device)
    if Path(args.draft).is_dir():
        kernels.attach_from_export(draft_model, args.draft)
    return decode.DraftModel(engine(draft_model, kivi=False), args.threshold, sampling)


def _print_speed(args, result, target, device) -> None:
    compiling = target.compile_seconds  # paid once, inside the first step
    how = "compiling" if compiling and target.compiled.built else "loading the compiled step"
    where = "engine" + (f", compiled ({how} took {compiling:.0f} s, not counted)" if compiling else "")
    seconds = max(result.seconds - compiling, 1e-9)
    print(
        f"\n[{args.method}: {len(result.tokens)} tokens in {seconds:.2f} s, "
        f"{len(result.tokens) / seconds:.1f} tokens/s, {result.tokens_per_forward:.2f} tokens per "
        f"target forward, on {device}, {where}]",
        file=sys.stderr,
    )


def _draft_layers(args, model, tokenizer, device) -> list[int]:
    """``--layers`` as given, or (``auto``) the subset saved with the checkpoint, else searched on
    two wikitext calibration prompts and saved next to the checkpoint's weights for next time."""
    from . import decode
    from .data import calibration_batches

    count = decode.layer_count(model)
    if args.layers != "auto":
        return decode.parse_layers(args.layers, count)
    if (keep := decode.saved_layers(args.model, count)) is not None:
        print(f"[self-spec: drafting with layers {_ranges(keep)}, saved with {args.model}]", file=sys.stderr)
        return keep
    ids, _ = calibration_batches(model, tokenizer, "wikitext2", 2, 64, seed=0)
    keep, trials = decode.search_layers(
        model, [row.unsqueeze(0).to(device) for row in ids], k=args.k, threshold=args.threshold
    )
    for t in trials:
        print(
            f"[self-spec search: {len(t['layers'])}/{count} layers {_ranges(t['layers'])}: "
            f"{t['tokens_per_s']:.1f} tokens/s, {t['tokens_per_forward']:.2f} tokens per forward]",
            file=sys.stderr,
        )
    saved = decode.save_layers(args.model, keep, trials)
    where = f"saved in {saved}" if saved else f"pass --layers {_ranges(keep)} to skip the search"
    print(f"[self-spec: drafting with layers {_ranges(keep)}; {where}]", file=sys.stderr)
    return keep


def _early_exit(args, model, target, tokenizer, prompt, eos):
    """Lossy: the threshold is calibrated (``auto``) on ``model`` for 90% top-1 agreement on
    calibration text; ``target`` (the engine over its weights) decodes, eager (exits are per token)."""
    from .arch import decoder_layers
    from .data import calibration_batches
    from .decode import early_exit

    exits = early_exit.default_exits(len(decoder_layers(model)))
    threshold = args.exit_threshold
    if threshold == "auto":
        ids, _ = calibration_batches(model, tokenizer, "wikitext2", 2, 256, seed=0)
        found = early_exit.calibrate(model, ids, exits, args.exit_measure, target=0.9)
        threshold = found["threshold"]
        print(
            f"[early exit: {args.exit_measure} threshold {threshold:.3f} at layers {exits} keeps "
            f"{found['agreement']:.1%} top-1 agreement on calibration text, {found['mean_layers']:.1f} layers per "
            "token on average]",
            file=sys.stderr,
        )
    result = early_exit.early_exit_greedy(target, prompt, args.max_new_tokens, threshold, exits, args.exit_measure, eos)
    print(f"[early exit: {result.extra['mean_layers']:.1f} layers per token]", file=sys.stderr)
    return result


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


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line naming the argument and the command's --help, exit status 2."""

    def error(self, message: str):
        print(f"compress: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    parts, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a > start else str(a))
            start = b
    return ",".join(parts)


def _report(args) -> None:
    from .report import write

    files, note = write(args.exports, args.out)
    for path in files:
        print(path)
    if note:
        print(f"note: {note}")


def _recipes(args) -> None:
    from .recipe import shipped

    rows = shipped()
    width = max(len(n) for n, _ in rows)
    for name, summary in rows:
        print(f"{name.ljust(width)}  {summary}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="compress", description="Compress, export and evaluate LLMs.")
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
    p.add_argument("--output", help="output folder (default: out/<recipe>-<model>)")
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
    common(p, None, "bfloat16 (default; float32 for a recipe that exports GGUF), float16 or float32")
    p.set_defaults(func=_apply)

    p = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of a model or exported folder")
    p.add_argument("model", help="exported folder, local HF folder or alias")
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
        "--bitsandbytes",
        choices=["nf4", "nf4-double", "fp4", "int8"],
        help="score MODEL as transformers' load_in_4bit (nf4, nf4 with double quantization, fp4) or "
        "load_in_8bit (int8: LLM.int8) gives it; the reference is MODEL itself",
    )
    common(p)
    p.set_defaults(func=_eval)

    p = sub.add_parser("decode", help="generate from a model or export; greedy or speculative")
    p.add_argument("model", help="exported folder, local HF folder or alias")
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--method",
        choices=["greedy", "prompt-lookup", "draft", "self-spec", "lookahead", "early-exit"],
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
    p.add_argument("--temperature", type=_number(0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=_number(0, 1, low_open=True), default=1.0)
    p.add_argument("--seed", type=_whole(0), default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--kernel",
        choices=[
            *("auto", "dense", "fp32", "fp32-onednn", "bf16", "bf16-avx2", "int8"),
            *("int4", "int4-avx2", "int4-a16", "int4-a8"),
        ],
        default="auto",
        help="auto: each linear group runs on the fastest format measured here among those that hold "
        "its weights exactly (fp32, bf16, int8 for per-channel W8, int4 for W4 exports, our own "
        "bf16-avx2, int4-avx2 and int4-a16 kernels on AVX2 CPUs; W8A8 exports on torch._int_mm); dense: fp32 "
        "matmuls; a format: used wherever it is exact; int4-a8: W4 weights on our kernel with each "
        "step's activations rounded to int8 per 64 (lossy, never chosen by auto; faster where "
        "int4 products are compute-bound)",
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
    p.set_defaults(func=_decode)

    p = sub.add_parser("report", help="several exports side by side: report.md and plots of quality against size")
    p.add_argument("exports", nargs="+", help="export folders written by `compress apply`")
    p.add_argument("--out", default="report", help="folder for report.md and the PNG plots (default: report)")
    p.set_defaults(func=_report)

    p = sub.add_parser("export", help="write a GGUF file for llama.cpp from an export of ours")
    p.add_argument("folder", help="an export folder written by `compress apply`")
    p.add_argument("--gguf", required=True, choices=list(GGUF_TYPES), help="block type of the quantized linears")
    p.add_argument(
        "--embedding",
        choices=["dense", "q8_0"],
        default="dense",
        help="token embedding (and a dense lm_head): as exported (default) or Q8_0, as llama.cpp's quantizer does",
    )
    p.add_argument("--output", help="the .gguf file (default: FOLDER/model-TYPE.gguf)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing .gguf file")
    p.set_defaults(func=_export)

    p = sub.add_parser("recipes", help="list the shipped recipes")
    p.set_defaults(func=_recipes)
    return parser


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like an error: a half-written export is removed


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.simplefilter("default")
    if threading.current_thread() is threading.main_thread():  # only the main thread may set a handler
        signal.signal(signal.SIGTERM, _terminated)  # torchrun stops the other ranks with SIGTERM when one fails
    try:
        if args.func in (_apply, _eval) and distributed.launched():
            args.device = distributed.start(args.device)
        args.func(args)
    except USER_ERRORS as e:
        who = f" (rank {distributed.rank()} of {distributed.size()})" if distributed.size() > 1 else ""
        print(f"compress: error{who}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("compress: interrupted; no output was written", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug of ours or a dependency's: one line, the traceback on request
        if getattr(args, "debug", False):
            raise
        first = (str(e).splitlines() or [""])[0][:300]
        print(
            f"compress: error: unexpected {type(e).__name__}: {first} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        distributed.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
