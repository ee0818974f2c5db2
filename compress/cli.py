"""Command line: ``compress apply | eval | decode | report | export | recipes``.

``apply`` and ``eval`` also run as several processes: ``torchrun --nproc-per-node N -m compress apply ...``.

Expected failures (bad recipe, missing model, offline hub, existing output) print
one line saying what to change and exit with status 2; nothing is written.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

from . import distributed
from .arch import UnknownArchitecture
from .arguments import build_parser
from .data import DataError
from .decode import DecodeError
from .export import DISK_ERRORS, MANIFEST, ExportError
from .formats.gguf_file import GGUFError
from .formats.safetensors import CheckpointError
from .llama_cpp import LlamaCppError
from .memory import MemoryPlanError
from .models import ModelLoadError
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
    LlamaCppError,
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
        target_bpw=args.target_bpw,
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
    if report.eval and report.eval.get("increase_se") is not None:
        print("±: one standard error over the windows, paired with the original's (docs/evaluation.md)")


def _export(args) -> None:
    from .formats import gguf_file

    folder = Path(args.folder)
    if not (folder / MANIFEST).is_file():
        raise ExportError(f"{folder} is not an export of ours (no {MANIFEST}); run `compress apply` first")
    out = Path(args.output) if args.output else folder / gguf_file.file_name(args.gguf)
    if out.exists() and not (args.overwrite and out.is_file() and out.suffix == ".gguf"):
        why = "pass --overwrite" if out.is_file() and out.suffix == ".gguf" else "choose another --output"
        raise ExportError(f"{out} exists; {why}")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise ExportError(f"{parent} is not a folder; choose another --output")
    if not os.access(parent, os.W_OK):
        raise ExportError(f"{parent} is not writable; choose another --output")
    written = gguf_file.write(folder, args.gguf, out, args.embedding)
    print(f"wrote {written} ({written.stat().st_size / 1e6:.1f} MB)")


def _eval_gguf(args) -> None:
    """``compress eval FILE.gguf``: llama.cpp's logits on our windows, against the reference."""
    from . import models
    from .evaluate import evaluate_gguf

    path = Path(args.model)
    if not path.is_file():
        raise DataError(f"{path} is not a file; give the path of a .gguf file")
    if args.bitsandbytes or args.write_report:
        raise ExportError("--bitsandbytes and --write-report take a model folder, not a GGUF file")
    reference = args.reference
    if reference is None and (path.parent / MANIFEST).is_file():  # a GGUF inside one of our exports
        reference = json.loads((path.parent / MANIFEST).read_text()).get("base_model")
    if not reference or reference == "none":
        raise DataError(f"{path.name}: give --reference MODEL, the dense model whose tokenizer cuts the windows")
    ref = models.open_streamed(reference, models.parse_dtype(args.dtype))
    result = evaluate_gguf(path, ref.tokenizer, args.ppl, args.seqlen, args.windows, ref.model)
    print(f"model: {path}    reference: {reference}")
    _print_result(result)


def _print_result(result, bits_line: str | None = None) -> None:
    print(f"protocol: {result.protocol}")
    if bits_line:
        print(bits_line)
    print(f"perplexity: {result.ppl:.4f}" + (f" ± {result.ppl_se:.4f}" if result.ppl_se is not None else ""))
    if result.ref_ppl is not None:
        print(
            f"reference perplexity: {result.ref_ppl:.4f}    KL: {result.kl:.5f} nats/token    "
            f"top-1 agreement: {result.top1:.4f}"
        )
        if result.increase_se is not None:
            print(f"increase: {result.ppl / result.ref_ppl - 1:+.2%} ± {result.increase_se:.2%} (paired over windows)")
    if result.ppl_se is not None:
        print("±: one standard error over the windows (docs/evaluation.md)")


def _eval(args) -> None:
    from . import bnb, export, models
    from .evaluate import evaluate

    if args.tasks:  # an unknown task, lm-eval missing, a wrong pairing: said before any model is read
        _check_tasks(args)
    if args.model.endswith(".gguf"):
        return _eval_gguf(args)
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
    ref_model = None
    if reference and reference != "none":
        ref = models.open_streamed(reference, dtype)
        _refuse_another_vocabulary(f"--reference {reference}", ref, args.model, loaded)
        ref_model = ref.model
    if args.tasks:
        return _eval_tasks(args, dtype, device, reference)
    context = getattr(loaded.model.config, "max_position_embeddings", None)
    if context and args.seqlen and args.seqlen > context:
        raise DataError(f"--seqlen {args.seqlen} is past {args.model}'s context of {context} tokens; give at most that")
    result = evaluate(loaded.model, loaded.tokenizer, args.ppl, args.seqlen, args.windows, ref_model, device=device)
    if not distributed.is_main():  # torchrun: every rank scored its windows; rank 0 reports
        return
    print(f"model: {args.model}    reference: {reference or 'none'}")
    bits_line = None
    if args.bitsandbytes:
        bits_line = f"bitsandbytes {args.bitsandbytes}: {bits:.3f} bits per weight over {count:,} linear weights"
    _print_result(result, bits_line)
    if args.write_report:
        print(f"report: {export.add_evaluation(Path(args.model), result.as_dict())}")


def _check_tasks(args) -> None:
    from . import tasks

    if args.model.endswith(".gguf") or args.bitsandbytes:
        raise DataError("--tasks scores a model folder or an export of ours: not a .gguf file, not with --bitsandbytes")
    if distributed.size() > 1:
        raise distributed.DistributedError("--tasks runs in one process: run it without torchrun")
    tasks.resolve(args.tasks)


def _eval_tasks(args, dtype, device, reference) -> None:
    """``compress eval MODEL --tasks ...``: lm-evaluation-harness on the model as we evaluate it."""
    from . import export, tasks

    settings = tasks.TaskSettings(args.tasks, args.limit, args.num_fewshot)
    scores = tasks.evaluate_tasks(args.model, settings, reference, dtype, device)
    print(f"model: {args.model}    reference: {reference or 'none'}    lm-eval {scores['settings']['lm_eval']}")
    print(tasks.table(scores))
    if args.write_report:
        print(f"report: {export.add_evaluation(Path(args.model), scores, key='tasks')}")


def _decode(args) -> None:
    from . import decode, kv_quant, models
    from .data import tokenizer_fingerprint
    from .decode import choice
    from .decode.datastore import Datastore
    from .decode.engine import Engine
    from .decode.methods import METHODS, Settings
    from .formats.compressed_tensors import unsimulated_by_decoder
    from .formats.gguf_integers import attach_export_integers

    device = _decode_device(args)
    loaded = models.load(args.model, models.parse_dtype(args.dtype))
    model, tokenizer = models.for_compute(loaded.model, device), loaded.tokenizer
    prompt = _prompt_ids(args, tokenizer).to(device)
    if Path(args.model).is_dir():
        attach_export_integers(model, args.model)  # for the integer and FP8 kernels
        fp8_kernel = args.kernel == "fp8" or (args.kernel == "auto" and choice.fp8_tensor_cores(device))
        if parts := unsimulated_by_decoder(args.model, fp8_kernel):
            why = "this engine does not round them; `compress eval` scores them as served"
            print(f"[decode: {', '.join(parts)}: {why}]", file=sys.stderr)
    _refuse_what_does_not_fit(args, model, prompt)
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
    method = METHODS[args.method]
    settings = Settings(
        eos=eos,
        sampling=sampling,
        k=args.k,
        threshold=args.threshold,
        token_cost=None if args.token_cost == "auto" else args.token_cost,
        layers=args.layers,
        window=args.window,
        ngram=args.ngram,
        guesses=args.guesses,
        exit_threshold=args.exit_threshold,
        exit_measure=args.exit_measure,
        model=model,
        tokenizer=tokenizer,
        checkpoint=args.model,
    )
    if problem := method.problem(sampling.greedy, cache is not None, bool(args.draft), bool(args.datastore)):
        raise decode.DecodeError(problem)
    if args.datastore:
        settings.store = Datastore.load(args.datastore, tokenizer_fingerprint(tokenizer))
    if method.head:
        settings.head = _draft_head(args, model)
    elif args.draft_head:
        raise decode.DecodeError(f"--draft-head is for --method eagle, eagle-tree or eagle-lookup, not {args.method}")
    # every method runs on the engine (KIVI caches too); a lossy lm_head for the target only
    target = engine(model, lm_head=None if args.lm_head == "exact" else args.lm_head)
    settings.draft = _draft(args, model, tokenizer, device, engine, sampling)
    result = method.run(target, prompt, args.max_new_tokens, settings)
    if "mean_layers" in result.extra:
        print(f"[early exit: {result.extra['mean_layers']:.1f} layers per token]", file=sys.stderr)
    if settings.store is not None:
        settings.store.add(result.tokens)
        settings.store.save(args.datastore)
    print(tokenizer.decode(result.tokens, skip_special_tokens=True))
    _print_speed(args, result, target, device)


def _refuse_what_does_not_fit(args, model, prompt) -> None:
    """Before any compute: a generation past the model's context, a 4-bit or FP8 kernel with no such weights."""
    from . import decode
    from .decode import kernels
    from .quant import quantized_of

    context = getattr(model.config, "max_position_embeddings", None)
    if context and prompt.shape[1] + args.max_new_tokens > context:
        room = context - prompt.shape[1]
        raise decode.DecodeError(
            f"the prompt's {prompt.shape[1]} tokens and --max-new-tokens {args.max_new_tokens} do not fit the "
            f"model's context of {context} tokens; "
            + (f"ask for at most {room} new tokens" if room > 0 else "shorten the prompt")
        )
    w4 = any((qw := quantized_of(m)) is not None and qw.scheme.bits == 4 for m in model.modules())
    if args.kernel.startswith("int4") and not w4 and args.lm_head != "int4" and args.draft != "self-w4":
        raise decode.DecodeError(
            f"--kernel {args.kernel} runs 4-bit weights, and {args.model} has none (a W4 export of ours has); "
            "drop --kernel, or use --draft self-w4 or --lm-head int4 to round some in memory"
        )
    if args.kernel == "fp8" and not any(kernels.fp8_operands(m) for m in model.modules()):
        raise decode.DecodeError(
            f"--kernel fp8 runs FP8 weights with FP8 inputs, and {args.model} has none (an export of "
            "the fp8-dynamic or fp8 recipe has); drop --kernel"
        )


def _decode_device(args):
    """The device, once the options that do not fit together or this machine are refused."""
    from . import decode, models
    from .decode import choice, native
    from .decode.methods import DEFAULT

    args.method = args.method or DEFAULT
    device = models.pick_device(args.device)
    if args.kernel == "int4" and not choice.int4_kernel_available(device):
        raise decode.DecodeError(
            f"--kernel int4: this torch build has no int4 kernel for {device.type} "
            "(on a GPU it needs compute capability 8.0 or newer); use --kernel auto"
        )
    if args.kernel == "fp8" and device.type != "cpu" and not choice.fp8_tensor_cores(device):
        raise decode.DecodeError(
            "--kernel fp8: this GPU has no FP8 tensor cores with row-wise scales (compute capability "
            "9.0 or newer: Hopper, Blackwell); use --kernel auto, or --device cpu"
        )
    if args.kernel in native.FORMATS and (device.type != "cpu" or not native.available()):
        raise decode.DecodeError(
            f"--kernel {args.kernel}: our AVX2 kernels are not available here (they need an "
            "x86 CPU with AVX2 and FMA, a C++ compiler, and COMPRESS_NATIVE unset); "
            "use --kernel auto"
        )
    if device.type == "cuda" and args.method in ("lookahead", "eagle-tree"):  # docs/results.md, the CUDA section
        print(
            f"[decode: on CUDA, {args.method}'s tree steps run without CUDA graphs and round unlike them: slower "
            "there, and its output can differ from greedy's at near-ties]",
            file=sys.stderr,
        )
    return device


def _prompt_ids(args, tokenizer):
    """``--prompt`` as token ids: in the model's chat template unless ``--raw`` (or it has none)."""
    from . import decode

    if args.raw or tokenizer.chat_template is None:
        prompt = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    else:
        from jinja2 import TemplateError

        try:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}],
                add_generation_prompt=True,
                return_tensors="pt",
                return_dict=True,
            )["input_ids"]
        except TemplateError as e:  # a broken template, or one the sandbox stopped
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise decode.DecodeError(f"the model's chat template failed ({why}); fix it, or pass --raw") from None
    if prompt.numel() == 0:
        raise decode.DecodeError("the prompt is empty: give --prompt some text")
    return prompt


def _refuse_another_vocabulary(what: str, other, name: str, loaded) -> None:
    """A draft or a reference must read and write the same token ids as the model."""
    from .data import tokenizer_fingerprint

    if tokenizer_fingerprint(other.tokenizer) != tokenizer_fingerprint(loaded.tokenizer):
        raise DecodeError(f"{what} has another tokenizer than {name}; it must share the model's vocabulary")
    if other.model.config.vocab_size != loaded.model.config.vocab_size:
        raise DecodeError(
            f"{what} has a vocabulary of {other.model.config.vocab_size} tokens, {name} of "
            f"{loaded.model.config.vocab_size}; it must share the model's vocabulary"
        )


def _draft_head(args, model):
    """The EAGLE head for ``--method eagle``: ``--draft-head``, else the one exported with the model."""
    from . import decode
    from .formats import eagle_head

    path = args.draft_head or args.model
    if args.draft_head is None and eagle_head.find(path) is None:
        raise decode.DecodeError(
            f"{args.model} has no EAGLE head beside it: decode an export of a recipe with the eagle pass "
            "(compress apply eagle-head), or give --draft-head FOLDER"
        )
    try:
        return eagle_head.load_matching(path, model.config)
    except eagle_head.HeadFormatError as e:
        raise decode.DecodeError(str(e)) from None


def _draft(args, model, tokenizer, device, engine, sampling):
    """``--draft``: the target rounded to 4 bits in memory (``self-w4``), another model sharing its
    vocabulary, or None."""
    from . import decode, models
    from .formats.gguf_integers import attach_export_integers

    if args.draft == "self-w4":
        return decode.DraftModel(engine(model, quantize="w4", kivi=False), args.threshold, sampling)
    if not args.draft:
        return None
    other = models.load(args.draft, models.parse_dtype(args.dtype))
    _refuse_another_vocabulary(f"--draft {args.draft}", other, args.model, models.Loaded(model, tokenizer))
    draft_model = models.for_compute(other.model, device)
    if Path(args.draft).is_dir():
        attach_export_integers(draft_model, args.draft)
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


def _report(args) -> None:
    from .report import write

    files, note = write(args.exports, args.output, args.overwrite)
    for path in files:
        print(path)
    if note:
        print(f"note: {note}")


def _recipes(args) -> None:
    from .recipe import shipped

    rows = [("recipe", "stores", "what it does"), *shipped()]
    name_width, stores_width = (max(len(row[i]) for row in rows) for i in (0, 1))
    for name, stored, summary in rows:
        print(f"{name.ljust(name_width)}  {stored.ljust(stores_width)}  {summary}")


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like an error: a half-written export is removed


def main(argv: list[str] | None = None) -> int:
    commands = {"apply": _apply, "eval": _eval, "decode": _decode, "export": _export, "report": _report}
    args = build_parser(commands | {"recipes": _recipes}).parse_args(argv)
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
    except BrokenPipeError:  # the reader went away (`compress recipes | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush is quiet too
        return 141
    except Exception as e:  # noqa: BLE001 - a bug of ours or a dependency's: one line, the traceback on request
        if getattr(args, "debug", False):
            raise
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:  # the machine's refusal, not a bug
            where = Path(e.filename).parent if e.filename else Path("the output")
            if ".tmp-" in where.name:  # our hidden temporary export, removed by now: the folder it was in
                where = where.parent
            print(f"compress: error: {e.strerror} writing in {where}; {DISK_ERRORS[e.errno]}", file=sys.stderr)
            return 2
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
