"""``compress report DIR...``: the ``report.json`` of several exports side by side, as one markdown
table and, with matplotlib installed (``pip install -e ".[plot]"``), plots of quality against
size: perplexity against bits per weight and against size on disk (the Pareto front marked),
KL against bits per weight, task recovery against bits per weight (exports scored with ``--tasks``)
and compression time per export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .export import DISK_ERRORS, REPORT


class ReportError(ValueError):
    """A folder without a readable report, or an output that cannot be written."""


MANIFEST = ".compress-report.json"  # the files an earlier report wrote into its folder: only these are replaced
TIMES_PLOT = "compress_time.png"


PLOTS = {  # file -> (x key, y key, x label, y label, log y); lower y is better but for recovery
    "ppl_vs_bits.png": ("bits_per_weight", "ppl", "bits per weight", "perplexity", True),
    "ppl_vs_size.png": ("size_mb", "ppl", "size on disk (MB)", "perplexity", True),
    "kl_vs_bits.png": ("bits_per_weight", "kl", "bits per weight", "KL(original || compressed), nats per token", True),
    "recovery_vs_bits.png": ("bits_per_weight", "task_recovery", "bits per weight", "task recovery (÷ dense)", False),
}
HIGHER_IS_BETTER = {"task_recovery"}


def load(folders: list[str | Path]) -> list[dict]:
    """One flat record per export: its report's sizes and timings, with its evaluation merged in."""
    if not folders:
        raise ReportError("give at least one export folder")
    records = []
    for folder in map(Path, folders):
        path = folder / REPORT
        try:
            report = json.loads(path.read_text())
        except FileNotFoundError:
            raise ReportError(f"{folder} has no {REPORT}: give folders written by `compress apply`") from None
        except (OSError, ValueError) as e:
            raise ReportError(
                f"could not read {path} ({type(e).__name__}): re-run the export or leave it out"
            ) from None
        record = {k: v for k, v in report.items() if k not in ("eval", "training", "tasks")}
        recovery = (report.get("tasks") or {}).get("mean_recovery")  # compress.tasks: model ÷ dense, mean over tasks
        records.append(record | (report.get("eval") or {}) | {"folder": str(folder), "task_recovery": recovery})
    return sorted(records, key=lambda r: (r.get("bits_per_weight") or 99, r.get("size_mb") or 0))


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indexes of the points no other point beats on both coordinates (lower is better), by x."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(records: list[dict]) -> str:
    head = [
        "recipe",
        "method",
        "bits/weight",
        "size MB",
        "perplexity",
        "original's",
        "KL",
        "top-1",
        "compress s",
        "peak RSS GB",
    ]
    tasks = any(r.get("task_recovery") is not None for r in records)
    head += ["task recovery"] if tasks else []
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [
            r.get("recipe"),
            r.get("method"),
            _cell(r.get("bits_per_weight"), 2),
            _cell(r.get("size_mb"), 1),
            _cell(r.get("ppl")),
            _cell(r.get("ref_ppl")),
            _cell(r.get("kl"), 4),
            _cell(r.get("top1")),
            _cell(r.get("compress_s"), 0),
            _cell(r.get("peak_rss_gb"), 2),
        ] + ([_cell(r.get("task_recovery"))] if tasks else [])
        rows.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(rows)


def _write_text(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)  # a full disk leaves no half-written file


def _plot(records: list[dict], file: str, out: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, y_key, x_label, y_label, log_y = PLOTS[file]
    shown = [r for r in records if r.get(x_key) is not None and r.get(y_key) is not None]
    points = [(r[x_key], r[y_key], r.get("recipe") or Path(r["folder"]).name) for r in shown]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    mixed = [bool(r.get("allocation")) for r in shown]  # each linear its own scheme (``allocate``)
    for kind, marker, color, label in ((False, "o", "tab:blue", "one scheme"), (True, "D", "tab:green", "mixed")):
        these = [p for p, m in zip(points, mixed) if m == kind]
        if these:
            label = label if any(mixed) else None  # a legend entry only where both kinds are shown
            ax.scatter([p[0] for p in these], [p[1] for p in these], color=color, marker=marker, zorder=3, label=label)
    if log_y:
        ax.set_yscale("log")
    sign = -1 if y_key in HIGHER_IS_BETTER else 1
    front = [points[i] for i in pareto([(p[0], sign * p[1]) for p in points])]
    ax.step([p[0] for p in front], [p[1] for p in front], where="post", color="tab:orange", label="Pareto front")
    references = {r["ref_ppl"] for r in records if y_key == "ppl" and r.get("ref_ppl") is not None}
    if len(references) == 1:
        ax.axhline(references.pop(), color="grey", linestyle="--", linewidth=1, label="original")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    label_points(ax, points)
    return _save(fig, out / file)


def label_points(ax, points: list[tuple[float, float, str]]) -> list:
    """Each point's label beside it, moved a line down at a time (with a thin line back to its point)
    until it overlaps no label placed before it: recipes of one size and close scores would
    otherwise print on top of each other. Returns the labels."""
    from matplotlib.text import Text

    renderer = ax.figure.canvas.get_renderer()
    placed, texts = [], []
    for x, y, label in sorted(points, key=lambda p: (-p[1], p[0])):
        for line in range(len(points) + 1):
            text = ax.annotate(
                label,
                (x, y),
                textcoords="offset points",
                xytext=(5, 3 - 9 * line),
                fontsize=7,
                arrowprops={"arrowstyle": "-", "color": "grey", "linewidth": 0.5} if line else None,
            )
            text.update_positions(renderer)  # where it will be drawn
            box = Text.get_window_extent(text, renderer)  # the words alone, not the line to the point
            if line == len(points) or not any(box.overlaps(other) for other in placed):
                break
            text.remove()
        placed.append(box)
        texts.append(text)
    return texts


def _plot_times(records: list[dict], out: Path) -> Path | None:
    import matplotlib.pyplot as plt

    timed = [(r.get("recipe") or Path(r["folder"]).name, r["compress_s"]) for r in records if r.get("compress_s")]
    if not timed:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 0.3 * len(timed) + 1.2), dpi=100)
    ax.barh([t[0] for t in timed], [t[1] for t in timed], color="tab:blue")
    ax.set_xlabel("compression time (s)")
    ax.invert_yaxis()
    return _save(fig, out / TIMES_PLOT)


def _save(fig, path: Path) -> Path:
    """Written beside, then renamed: a killed run leaves no half-written plot."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    partial = path.with_name(f".{path.stem}.{os.getpid()}.partial.png")  # savefig picks the format by suffix
    try:
        fig.savefig(partial)
        os.replace(partial, path)
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
    return path


def _ours(out: Path) -> set[str]:
    """The files earlier reports wrote into ``out`` (their manifest)."""
    try:
        return set(json.loads((out / MANIFEST).read_text()).get("files", []))
    except (OSError, ValueError, AttributeError):
        return set()


def _refuse_to_replace_what_others_wrote(out: Path) -> None:
    """As ``apply --overwrite``: a file of ours is replaced only if a report of ours wrote it."""
    ours = _ours(out)
    theirs = [n for n in ["report.md", *PLOTS, TIMES_PLOT] if (out / n).exists() and n not in ours]
    if theirs:
        raise ReportError(
            f"{out / theirs[0]} was not written by `compress report`: choose another --output, "
            "or pass --overwrite to replace it"
        )


def write(folders: list[str | Path], out: str | Path, overwrite: bool = False) -> tuple[list[Path], str]:
    """Writes ``report.md`` (and the plots, when matplotlib is installed) into ``out``; returns the
    files written and a note (empty, or why some are missing). Only these files are replaced in
    ``out``, and only if an earlier report wrote them (or ``overwrite``): nothing else is touched."""
    records = load(folders)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out} is a file: give a folder for the report")
    if out.is_dir() and not overwrite:
        _refuse_to_replace_what_others_wrote(out)
    protocols = sorted({r["protocol"] for r in records if r.get("protocol")})
    note = ""
    if len(protocols) > 1:
        note = "the exports were evaluated under different protocols: compare perplexities within one only"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        matplotlib = None
        note = "; ".join(filter(None, [note, 'no plots: matplotlib is not installed (pip install -e ".[plot]")']))
    created = not out.exists()
    try:
        return _write_all(records, out, protocols, matplotlib is not None, note)
    except OSError as e:  # a full disk, a folder under a file, no permission: the input's fault, not ours
        if created:
            shutil.rmtree(out, ignore_errors=True)  # the folder this run made, and only that
        if e.errno in DISK_ERRORS:
            raise  # said as for every command
        raise ReportError(f"could not write the report into {out}: {e.strerror or e}") from None


def _write_all(records: list[dict], out: Path, protocols: list[str], plots: bool, note: str):
    out.mkdir(parents=True, exist_ok=True)
    # claimed before they are written, so that a run stopped halfway leaves files a later one may replace
    # (with what earlier reports wrote there: a run without matplotlib leaves their plots in place)
    files = {"report.md", *(list(PLOTS) + [TIMES_PLOT] if plots else [])} | _ours(out)
    _write_text(out / MANIFEST, json.dumps({"files": sorted(files)}))
    written = []
    if plots:
        written += [p for p in [_plot(records, file, out) for file in PLOTS] + [_plot_times(records, out)] if p]
    lines = [
        "# Compression report",
        "",
        f"Exports: {len(records)}. Evaluation: {'; '.join(protocols) or 'none'}.",
        "",
        table(records),
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in written] + ([""] if written else [])
    if note:
        lines += [f"Note: {note}.", ""]
    _write_text(out / "report.md", "\n".join(lines))
    return [out / "report.md", *written], note
