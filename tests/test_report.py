import json

import pytest

from compress import report
from compress.cli import main


def _export(folder, recipe, bits, size, ppl, kl, seconds=10.0, protocol="wikitext2 test, 2 × 256 tokens"):
    folder.mkdir()
    evaluation = {} if ppl is None else {"protocol": protocol, "ppl": ppl, "ref_ppl": 20.0, "kl": kl, "top1": 0.9}
    (folder / "report.json").write_text(
        json.dumps(
            {
                "recipe": recipe,
                "method": f"{recipe} method",
                "bits_per_weight": bits,
                "size_mb": size,
                "compress_s": seconds,
                "peak_rss_gb": 1.0,
                "training": {},
                "eval": evaluation,
            }
        )
    )
    return folder


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes():
    points = [(4.0, 25.0), (3.0, 40.0), (4.0, 27.0), (8.0, 20.5), (5.0, 30.0), (2.0, 90.0)]
    assert report.pareto(points) == [5, 1, 0, 3]  # by x: 2 bits, 3, 4 (the better of two), 8


def test_report_writes_a_table_and_plots_and_touches_nothing_else(tmp_path):
    pytest.importorskip("matplotlib")
    folders = [
        _export(tmp_path / "a", "rtn-w4", 4.5, 90.0, 30.0, 0.2),
        _export(tmp_path / "b", "gptq-w4", 4.5, 90.0, 26.0, 0.1, seconds=100.0),
        _export(tmp_path / "c", "rtn-w8", 8.1, 150.0, 20.1, 0.01),
        _export(tmp_path / "d", "no-eval", 4.5, 90.0, None, None),
    ]
    out = tmp_path / "report"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    assert main(["report", *map(str, folders), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        ".compress-report.json",  # what this report wrote: a later one may replace these, and only these
        "compress_time.png",
        "kl_vs_bits.png",
        "mine.txt",
        "ppl_vs_bits.png",
        "ppl_vs_size.png",
        "report.md",
    ]
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "recipe" not in line]
    assert [row.split(" | ")[0][2:] for row in rows] == ["rtn-w4", "gptq-w4", "no-eval", "rtn-w8"]  # by bits
    assert "| 26.000 | 20.000 | 0.1000 |" in text and "![ppl_vs_bits](ppl_vs_bits.png)" in text
    assert (out / "mine.txt").read_text() == "a user's file"
    assert main(["report", *map(str, folders[:2]), "--output", str(out)]) == 0  # ours: replaced
    assert "Exports: 2." in (out / "report.md").read_text()


def test_report_replaces_only_what_a_report_wrote(tmp_path, capsys):
    a = _export(tmp_path / "a", "rtn-w4", 4.5, 90.0, 30.0, 0.2)
    out = tmp_path / "notes"
    out.mkdir()
    (out / "report.md").write_text("a user's own report")
    assert main(["report", str(a), "--output", str(out)]) == 2
    assert "report.md was not written by `compress report`" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]  # nothing written
    assert (out / "report.md").read_text() == "a user's own report"
    assert main(["report", str(a), "--output", str(out), "--overwrite"]) == 0
    assert "rtn-w4" in (out / "report.md").read_text()


def test_report_says_what_is_wrong_in_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "has no report.json" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "report.json").write_text("{not json")
    assert main(["report", str(broken)]) == 2
    assert "could not read" in capsys.readouterr().err
    a = _export(tmp_path / "a", "rtn-w4", 4.5, 90.0, 30.0, 0.2)
    b = _export(tmp_path / "b", "rtn-w8", 8.1, 150.0, 20.1, 0.01, protocol="wikitext2 test, 40 × 2048 tokens")
    (tmp_path / "file").write_text("")
    assert main(["report", str(a), "--out", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert main(["report", str(a), str(b), "--output", str(tmp_path / "r")]) == 0
    assert "different protocols" in capsys.readouterr().out


def test_labels_of_nearby_points_do_not_overlap():
    """rtn-w4 beside gptq-w4 (one size, close perplexities) once printed on top of each other."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(4.25, 25.91, "gptq-w4"), (4.25, 25.88, "rtn-w4"), (4.26, 25.7, "awq-w4"), (8.0, 20.4, "rtn-w8")]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    ax.set_yscale("log")
    texts = report.label_points(ax, points)
    from matplotlib.text import Text

    renderer = fig.canvas.get_renderer()
    for t in texts:
        t.update_positions(renderer)
    boxes = [Text.get_window_extent(t, renderer) for t in texts]
    assert sorted(t.get_text() for t in texts) == sorted(p[2] for p in points)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    plt.close(fig)


def test_mixed_precision_exports_are_marked_apart_on_the_plots(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    uniform = _export(tmp_path / "a", "best-w4", 4.25, 110.0, 23.5, 0.15)
    mixed = _export(tmp_path / "b", "mixed-3.5", 3.5, 95.0, 26.0, 0.2)
    data = json.loads((mixed / "report.json").read_text())
    (mixed / "report.json").write_text(json.dumps(data | {"allocation": {"target_bpw": 3.5}}))
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    report._plot(report.load([uniform, mixed]), "ppl_vs_bits.png", tmp_path)
    (ax,) = figures[0].axes
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"one scheme", "mixed"}


def test_task_recovery_gets_a_column_and_a_plot_where_exports_were_scored_on_tasks(tmp_path):
    pytest.importorskip("matplotlib")
    scored = [
        _export(tmp_path / r, r, bits, 90.0, ppl, 0.1) for r, bits, ppl in (("w4", 4.25, 23.5), ("w3", 3.25, 41.0))
    ]
    for folder, recovery in zip(scored, (0.98, 0.91)):
        data = json.loads((folder / "report.json").read_text())
        (folder / "report.json").write_text(json.dumps(data | {"tasks": {"mean_recovery": recovery}}))
    plain = _export(tmp_path / "plain", "rtn-w8", 8.1, 150.0, 20.1, 0.01)
    out = tmp_path / "report"
    assert main(["report", *map(str, [*scored, plain]), "--output", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| task recovery |" in text and "| 0.910 |" in text and "| 0.980 |" in text
    assert (out / "recovery_vs_bits.png").read_bytes()[:4] == b"\x89PNG"
    assert report.pareto([(3.25, -0.91), (4.25, -0.98)]) == [0, 1]  # higher recovery is better: both on the front
