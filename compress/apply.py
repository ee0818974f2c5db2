"""``compress apply``: recipe -> compressed, exported, evaluated checkpoint.

Order matters for the user's time: everything that can fail cheaply (recipe,
output folder, model shapes) fails before calibration or compression starts.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import allocate, data, distributed, export, kv_quant, machine, memory, models, resume, tasks
from .data import activation_store
from .evaluate import evaluate, windows_of
from .formats import gguf_file
from .passes import RecipeError
from .pipeline import run_passes
from .recipe import Recipe


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux reports KiB


@dataclass
class Report:
    recipe: str
    model: str
    method: str
    output: str
    calibration: str
    bits_per_weight: float | None  # quantized linears, scales and zero-points included
    sparsity: float | None  # share of exact zeros in the pruned linears, measured on the weights exported
    params_kept: float | None  # factored layers: their parameters over the dense layers'
    kv_bytes_per_token: float | None  # quantized KV cache, scales included (bf16 dense: see kv_quant)
    size_mb: float
    compress_s: float
    peak_rss_gb: float  # the whole run, evaluation included
    training: dict = field(default_factory=dict)  # recovery passes: loss of the first and last tenth of the steps
    eval: dict = field(default_factory=dict)
    allocation: dict | None = None  # ``allocate``: the scheme of each linear, its budget and predicted cost
    tasks: dict | None = None  # ``evaluation.tasks``: lm-eval scores beside the dense model's (compress.tasks)

    def as_dict(self):
        return asdict(self)


@dataclass
class _Run:
    """One ``apply``'s settings, resolved and checked before the model is read."""

    recipe: Recipe
    source: str
    out: Path
    protected: tuple[Path, ...]  # the model's and the recipe's folders: never replaced by --overwrite
    dtype: str  # the storage dtype's name
    seed: int
    overwrite: bool
    max_shard_bytes: int
    gguf: object | None  # the recipe's GGUF export, or None
    device: torch.device
    planner: allocate.Planner | None = None  # the recipe's ``allocate``, once the passes know the model
    main: bool = field(default_factory=distributed.is_main)  # rank 0 writes the export

    @property
    def torch_dtype(self) -> torch.dtype:
        return models.parse_dtype(self.dtype)

    def open_model(self):
        return models.open_streamed(self.source, self.torch_dtype)


def apply(
    recipe: Recipe,
    model_source: str | None = None,
    output: str | Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    evaluate_after: bool = True,
    eval_windows: int | None = None,
    eval_seqlen: int | None = None,
    samples: int | None = None,
    max_shard_mb: int | None = None,
    spill: str | Path | None = None,
    resume_run: bool = False,
    keep_blocks: bool = True,
    calibration_dtype: str | None = None,
    target_bpw: float | None = None,
) -> Report | None:
    """Read the model a block at a time, compress each block and write it to the export at once,
    then evaluate the export against the original, again a block at a time. ``spill``: a folder
    where calibration activations are kept in files instead of RAM. A calibrated sweep keeps
    each finished block beside the output until the export is in place (``resume``; not with
    ``keep_blocks=False``); ``resume_run`` reads them back after a killed run instead of
    compressing them again. ``dtype`` (the storage dtype) defaults to bfloat16, and to float32 for
    a recipe that exports GGUF, whose weights must be the very numbers llama.cpp computes with.
    ``calibration_dtype`` overrides the recipe's ``calibration.dtype`` (what the blocks compute in);
    ``target_bpw`` sets (or adds) the recipe's ``allocate.target_bpw``.

    Under torchrun every rank calls this: each calibrates and evaluates on its share of the
    samples and windows (``compress/distributed.py``), rank 0 alone writes the export and returns
    the report; the other ranks return None."""
    if target_bpw is not None:
        recipe = recipe.with_budget(target_bpw)
    run = _settings(recipe, model_source, output, device, dtype, seed, overwrite, max_shard_mb)
    with export.output_lock(run.out) if run.main else contextlib.nullcontext():
        return _apply(
            run, evaluate_after, eval_windows, eval_seqlen, samples, spill, resume_run, keep_blocks, calibration_dtype
        )


def _apply(
    run: _Run, evaluate_after, eval_windows, eval_seqlen, samples, spill, resume_run, keep_blocks, calibration_dtype
):
    recipe = run.recipe
    store = activation_store(spill, run.device)
    loaded = run.open_model()
    model, tokenizer = loaded.model, loaded.tokenizer
    _check_model(run, model.model)
    for p in recipe.passes:  # before anything reads a block: the allocation's costs, a whole-model load
        p.prepare(model)
    calibration_dtype = calibration_dtype or recipe.calibration.dtype
    compute = _calibration_dtype(calibration_dtype, run.device)
    ev, cal = recipe.evaluation, recipe.calibration
    seqlen, windows = eval_seqlen or ev.seqlen, eval_windows or ev.windows
    eval_data = windows_of(tokenizer, ev.ppl, seqlen, windows) if evaluate_after and ev.ppl else None
    task_settings = tasks.TaskSettings(ev.tasks, ev.task_limit, ev.num_fewshot) if evaluate_after else None
    if task_settings and task_settings.tasks:  # an unknown task, or lm-eval missing: said before any compute
        if distributed.size() > 1:
            raise distributed.DistributedError(
                "evaluation.tasks runs in one process: run without torchrun, or with --no-eval and then "
                "`compress eval DIR --tasks ...`"
            )
        tasks.resolve(task_settings.tasks)
    whole = recipe.needs_data and cal.source == data.SELF or any(p.whole_model for p in recipe.passes)
    n_samples = (samples or cal.samples) if recipe.needs_data else 0
    keep_blocks = keep_blocks and recipe.needs_data and distributed.size() == 1  # the long sweeps, one process
    if distributed.size() > 1:  # (several: each rank would need every rank's blocks to resume)
        _check_processes(recipe, n_samples, len(eval_data) if eval_data is not None else None, resume_run)
    _check_memory(run, model, n_samples, (windows if eval_data is not None else 0, seqlen), whole, spill, keep_blocks)
    checkpoints = _checkpoints(run, n_samples, calibration_dtype, keep_blocks, resume_run)
    if whole:
        model.load_all()  # data-free calibration generates with the whole model; recovery trains it

    start = time.perf_counter()
    ids, calib_what = _calibration(run, model.model, tokenizer, n_samples)
    for p in recipe.passes:  # what a pass learns of the whole model first (learned rotations)
        p.fit(model, ids, recipe.passes, run.device)
    allocation = run.planner.run(model, ids, run.device) if run.planner is not None else None
    writer = export.Export(run.out, run.overwrite, run.max_shard_bytes, run.protected) if run.main else None
    try:  # everything, the report included, goes to the writer's temporary folder; renamed at the end
        if eval_data is not None and not distributed.everyone(Path(_shared(writer)).is_dir()):
            raise distributed.DistributedError(
                f"{run.out.parent} is not on a file system every process sees, so they cannot read the export "
                "back to evaluate it; add --no-eval and run `compress eval` on the export afterwards"
            )
        _sweep(run, model, ids, writer, store, checkpoints if keep_blocks else None, compute, tokenizer)
        if not run.main:  # the other ranks' part: their share of the evaluation windows
            if eval_data is not None:
                _evaluate(run, _shared(None), tokenizer, eval_data)
            return None
        writer.add(model.model, skip=model.prefix.rstrip("."))
        report = _finish(run, writer, model.model, tokenizer, calib_what, time.perf_counter() - start, eval_data)
        report.allocation = allocation.as_dict() if allocation is not None else None
        del model, loaded
        if eval_data is not None:
            report.eval = _evaluate(run, _shared(writer.tmp), tokenizer, eval_data).as_dict()
            report.peak_rss_gb = peak_rss_gb()
        if task_settings and task_settings.tasks:
            reference = run.source if ev.kl else None
            report.tasks = tasks.evaluate_tasks(str(writer.tmp), task_settings, reference, run.torch_dtype, run.device)
            report.peak_rss_gb = peak_rss_gb()
        (writer.tmp / export.REPORT).write_text(json.dumps(report.as_dict(), indent=2))
    except BaseException:
        if writer is not None:
            writer.abort()
        _say_kept(checkpoints)
        raise
    writer.publish()
    if checkpoints is not None:
        checkpoints.remove()
    return report


def _check_model(run: _Run, model) -> None:
    """Every pass against the model's shapes (group sizes, patterns), and GGUF against its family:
    before any compute."""
    for p in run.recipe.passes:
        p.check(model)
    if run.recipe.allocate is not None:
        run.planner = allocate.Planner(run.recipe.allocate, run.recipe.passes, run.torch_dtype, model.config)
    if run.gguf is not None and (problem := gguf_file.family_problem(model.config.model_type, model.config.to_dict())):
        raise gguf_file.GGUFError(problem)


def _calibration(run: _Run, model, tokenizer, samples: int):
    """(calibration ids, what they are) for a recipe that needs data; (None, "none ...") otherwise."""
    cal = run.recipe.calibration
    if not run.recipe.needs_data:
        return None, "none (no pass needs data)"
    return data.calibration_batches(model, tokenizer, cal.source, samples, cal.seqlen, run.seed)


def _sweep(run: _Run, model, ids, writer, store, checkpoints, compute, tokenizer) -> None:
    """The block sweep, each block written to the export (rank 0) as soon as it is final."""
    cal, prefix = run.recipe.calibration, model.prefix
    run_passes(
        model,
        ids,
        run.recipe.passes,
        run.device,
        lambda: run.open_model().model.load_all(),
        on_block=(lambda i, block: writer.add(block, f"{prefix}{i}.")) if run.main else None,
        store=store,
        checkpoints=checkpoints,
        min_expert_tokens=cal.min_expert_tokens,
        route_all_experts=cal.route_all_experts,
        compute=compute,
        tokenizer=tokenizer,
    )


def _say_kept(checkpoints) -> None:
    """After a failure: where the finished blocks are, and how to continue from them."""
    if checkpoints is not None and (checkpoints.folder / resume.STATE).is_file():
        print(
            f"[compress] the blocks finished so far are kept in {checkpoints.folder}: the same command "
            "with --resume continues from them (without it, they are removed)",
            file=sys.stderr,
        )


def _settings(recipe, model_source, output, device, dtype, seed, overwrite, max_shard_mb) -> _Run:
    """The run's settings, each bad one refused in one line before the model is read; torch's
    generator seeded with the run's seed."""
    source = model_source or recipe.model
    gguf = recipe.export if recipe.export.format == "gguf" else None
    if gguf is not None and dtype is not None and models.parse_dtype(dtype) != torch.float32:
        raise export.ExportError(
            f"--dtype {dtype}: a recipe that exports GGUF computes in float32 (llama.cpp dequantizes "
            "its blocks to float32); drop --dtype"
        )
    if max_shard_mb is not None and max_shard_mb < 1:
        raise export.ExportError(f"--max-shard-mb must be at least 1; got {max_shard_mb}")
    out = Path(output or Path("out") / f"{recipe.name}-{Path(source).name}")
    inputs = [Path(p) for p in (source, recipe.source) if p is not None and Path(p).exists()]
    protected = tuple(p if p.is_dir() else p.parent for p in inputs)
    if distributed.is_main():
        export.check_output(out, overwrite, protected)
    device = models.pick_device(device)
    dtype = dtype or ("float32" if gguf is not None else "bfloat16")
    models.parse_dtype(dtype)  # an unknown --dtype fails here, before the model is read
    seed = recipe.seed if seed is None else seed
    shard_bytes = (max_shard_mb or export.MAX_SHARD_BYTES // 2**20) * 2**20
    torch.manual_seed(seed)
    return _Run(recipe, source, out, protected, dtype, seed, overwrite, shard_bytes, gguf, device)


def _check_memory(run: _Run, model, samples: int, evaluated: tuple[int, int], whole, spill, keep_blocks) -> None:
    """The memory plan, printed, and refused before compute where the machine cannot hold it.
    ``evaluated``: (evaluation windows, their length)."""
    windows, seqlen = evaluated
    need = memory.plan(
        model,
        run.recipe.passes,
        run.device,
        len(distributed.share(samples)),
        run.recipe.calibration.seqlen,
        len(distributed.share(windows)) if windows else 0,
        seqlen,
        whole,
        spill is not None,
        keep_blocks,
        min(run.recipe.allocate.samples, samples) if run.recipe.allocate is not None else 0,
    )
    need.processes = distributed.local_size() if run.device.type == "cpu" else 1
    if run.main:
        print(f"[compress] memory plan: {need.describe()}", flush=True)
    memory.check(need, run.device)
    if spill is not None:
        memory.check_disk(need, spill)


def _checkpoints(run: _Run, samples: int, calibration_dtype: str, keep_blocks: bool, resume_run: bool):
    """The finished blocks kept for ``--resume`` (None: this run keeps none)."""
    recipe = run.recipe
    if resume_run and not keep_blocks:
        why = "calibrates nothing" if not recipe.needs_data else "runs with --no-checkpoints"
        raise resume.ResumeError(
            f"--resume: {recipe.name} {why}, so it keeps no blocks to resume from; run it without --resume"
        )
    if not (recipe.needs_data and run.main):
        return None
    key = {  # what makes the blocks what they are (a plain run removes old ones)
        "recipe": recipe.text,
        "model": str(run.source),
        "seed": run.seed,
        "samples": samples,
        "dtype": run.dtype,
        "device": run.device.type,
        "calibration_dtype": calibration_dtype,
        "allocate": recipe.allocate.model_dump() if recipe.allocate is not None else None,  # --target-bpw
    }
    return resume.BlockCheckpoints(run.out, key, resume_run)


def _finish(run: _Run, writer, model, tokenizer, calib_what: str, compress_s: float, eval_data) -> Report:
    """The export completed in its temporary folder (manifest, config, tokenizer, GGUF) and its report."""
    recipe, totals = run.recipe, writer.totals
    bpw, sparsity, kept = totals.bits_per_weight(), totals.sparsity(), totals.params_kept()
    kv = kv_quant.bytes_per_token(model)
    method = " + ".join(p.summary() for p in recipe.passes)
    if recipe.allocate is not None:
        budget = recipe.allocate.target_bpw
        method += (
            f", allocated to {budget} bits per weight"
            if not isinstance(budget, str)
            else (f", allocated to the size of llama.cpp's {budget.upper()}")
        )
    manifest = {
        "recipe": recipe.name,
        "base_model": run.source,
        "method": method,
        "seed": run.seed,
        "calibration": calib_what,
        "bits_per_weight": bpw,
        "sparsity": sparsity,
        "params_kept": kept,
        "kv_bytes_per_token": kv,
        "dtype": run.dtype,
        "evaluated": eval_data is not None,
    }
    written = writer.finish(model, tokenizer, recipe.text, manifest, run.gguf)
    return Report(
        recipe.name,
        run.source,
        method,
        str(run.out),
        calib_what,
        bpw,
        sparsity,
        kept,
        kv,
        export.size_on_disk(written) / 1e6,
        compress_s,
        peak_rss_gb(),
        training={p.where: p.log for p in recipe.passes if p.log},
    )


def _evaluate(run: _Run, written: str, tokenizer, eval_data):
    """The export as written, read back and scored against the original (this rank's windows)."""
    ev = run.recipe.evaluation
    reference = run.open_model().model if ev.kl else None
    compressed = models.open_streamed(written, run.torch_dtype).model
    seqlen, windows = eval_data.shape[1], len(eval_data)
    return evaluate(
        compressed, tokenizer, ev.ppl, seqlen, windows, reference=reference, data=eval_data, device=run.device
    )


def _calibration_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The recipe's ``calibration.dtype`` (None: the device's default)."""
    if name == "auto":
        return None
    if name == "bfloat16" and device.type == "cpu" and not machine.bf16_arithmetic():
        raise RecipeError(
            "calibration dtype bfloat16: this CPU has no AVX512-BF16 or AMX, so bf16 is emulated, several "
            "times slower than float32; use auto"
        )
    return models.parse_dtype(name)


def _shared(path) -> str:
    """Rank 0's folder (the export being written), as every rank names it: a ``Path`` on rank 0,
    None on the others. The same collective on every rank, in the same order."""
    return distributed.broadcast_text(str(getattr(path, "tmp", path)) if path is not None else None)


def _check_processes(recipe: Recipe, samples: int, windows: int | None, resume_run: bool) -> None:
    """What a run of several processes cannot do, said before any compute."""
    n = distributed.size()
    trainers = [p.where for p in recipe.passes if not p.data_parallel]
    if trainers:
        raise distributed.DistributedError(
            f"{trainers[0]} trains the model, which runs in one process only: run this recipe without torchrun"
        )
    if resume_run:
        raise distributed.DistributedError("--resume: a run of several processes keeps no blocks; run without it")
    if 0 < samples < n:
        raise distributed.DistributedError(f"--samples {samples} is fewer than the {n} processes; give each one")
    if windows is not None and windows < n:
        raise distributed.DistributedError(f"--windows {windows} is fewer than the {n} processes; give each one")


def _increase(e: dict) -> str:
    """Perplexity after over before, as a relative increase, with its standard error over windows."""
    if e.get("ppl") is None or e.get("ref_ppl") is None:
        return "—"
    se = e.get("increase_se")
    return f"{e['ppl'] / e['ref_ppl'] - 1:+.1%}" + ("" if se is None else f" ± {se:.1%}")


def format_table(reports: list[Report]) -> str:
    head = [
        "method",
        "bits/w",
        "sparsity",
        "params kept",
        "size MB",
        "ppl before",
        "ppl after",
        "increase",
        "KL",
        "top-1",
        "time s",
        "peak RSS GB",
    ]
    rows = []
    for r in reports:
        e = r.eval or {}
        fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
        rows.append(
            [
                r.method,
                fmt(r.bits_per_weight, ".2f"),
                fmt(r.sparsity, ".1%"),
                fmt(r.params_kept, ".1%"),
                f"{r.size_mb:.1f}",
                fmt(e.get("ref_ppl"), ".3f"),
                fmt(e.get("ppl"), ".3f"),
                _increase(e),
                fmt(e.get("kl"), ".4f"),
                fmt(e.get("top1"), ".3f"),
                f"{r.compress_s:.1f}",
                f"{r.peak_rss_gb:.2f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])
