"""`compress` on the command line: a real run on SmolLM2, and bad input that must write nothing."""

import json
import subprocess
import sys

import pytest

from compress.decode import native


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "compress.cli", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.slow
def test_apply_exports_and_reports(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "description: test\npasses:\n  - rtn: {bits: 8, group_size: -1}\n"
        "evaluation: {ppl: wikitext2, seqlen: 256, windows: 2}\n"
    )
    out = tmp_path / "out"
    result = run("apply", str(recipe), "--output", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rtn W8 channel sym" in result.stdout and "ppl after" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["eval"]["kl"] >= 0 and 0.9 < report["eval"]["top1"] <= 1
    increase = report["eval"]["ppl"] / report["eval"]["ref_ppl"] - 1  # with its standard error over 2 windows
    assert f"{increase:+.1%} ± {report['eval']['increase_se']:.1%}" in result.stdout
    assert abs(report["bits_per_weight"] - 8) < 0.1  # per-channel: scales are ~0.03 bit
    # eval on the export compares against the base model named in its manifest
    evaluated = run("eval", str(out), "--windows", "2", "--seqlen", "256")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "reference: smollm2-135m" in evaluated.stdout
    ppl = float(evaluated.stdout.split("perplexity: ")[1].split()[0])
    assert abs(ppl - report["eval"]["ppl"]) < 1e-3 * ppl  # the reloaded export scores what we measured
    # the output exists now: a second run without --overwrite refuses before loading anything
    again = run("apply", str(recipe), "--output", str(out))
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr


@pytest.mark.slow
def test_eval_fills_in_the_report_of_an_export_made_without_evaluation(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes:\n  - rtn: {bits: 8, group_size: -1}\n")
    out = tmp_path / "out"
    assert run("apply", str(recipe), "--output", str(out), "--no-eval").returncode == 0
    assert json.loads((out / "compress_manifest.json").read_text())["evaluated"] is False
    assert json.loads((out / "report.json").read_text())["eval"] == {}
    evaluated = run("eval", str(out), "--windows", "2", "--seqlen", "128", "--write-report")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert f"perplexity: {report['eval']['ppl']:.4f}" in evaluated.stdout and report["eval"]["kl"] >= 0
    assert report["bits_per_weight"] > 8 and json.loads((out / "compress_manifest.json").read_text())["evaluated"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no partial files left
    refused = run("eval", str(tmp_path), "--write-report")
    assert refused.returncode == 2 and "not an export of ours" in refused.stderr


@pytest.mark.parametrize(
    "body,message",
    [
        ("passes:\n  - sparsify: {}\n", "unknown pass 'sparsify'"),
        ("passes:\n  - rtn: {bits: 5}\n", "passes[0].rtn.bits"),
        ("model: /nonexistent/model\npasses:\n  - rtn: {}\n", "no such folder"),
        ("model: someone/not-a-local-model\npasses:\n  - rtn: {}\n", "pass a local Hugging Face folder"),
        ("passes:\n  - rtn: {}\nevaluation: {ppl: /nonexistent/text.txt}\n", "unknown text source"),
    ],
)
def test_bad_recipe_exits_nonzero_with_one_line_and_writes_nothing(tmp_path, body, message):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(body)
    out = tmp_path / "out"
    result = run("apply", str(recipe), "--output", str(out))
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("compress: error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [recipe]


def test_recipes_lists_shipped():
    result = run("recipes")
    assert result.returncode == 0 and "rtn-w4" in result.stdout


def test_a_reader_that_stops_early_gets_no_error():
    """`compress recipes | head -1`: the closed pipe ends the listing quietly."""
    listing = subprocess.Popen(
        [sys.executable, "-m", "compress.cli", "recipes"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    listing.stdout.close()  # the reader is gone before the first line
    stderr = listing.stderr.read().decode()
    assert listing.wait() == 141 and stderr == ""


def test_version():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.startswith("compress ")


def test_decode_rejects_a_bad_number_before_loading_anything():
    result = run("decode", "smollm2-135m", "--prompt", "hi", "--token-cost", "lots")
    assert result.returncode == 2 and "--token-cost: 'lots': write a number or auto" in result.stderr
    assert "Traceback" not in result.stderr


def test_decode_refuses_our_avx2_kernels_where_they_are_off(monkeypatch):
    monkeypatch.setenv("COMPRESS_NATIVE", "0")
    result = run("decode", "smollm2-135m", "--prompt", "hi", "--kernel", "int4-avx2")
    assert result.returncode == 2 and "--kernel int4-avx2: our AVX2 kernels are not available here" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason="no AVX2/FMA CPU or no C++ compiler here")
def test_decode_rounds_the_lm_head_only_when_asked():
    args = ("decode", "smollm2-135m", "--prompt", "hi", "--method", "greedy", "--max-new-tokens", "4")
    result = run(*args, "--kernel", "int4-a8", "--lm-head", "int4")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]
    # a dense model: its block linears hold no W4 integers, so only the rounded lm_head is W4A8
    assert "lm_head: int4-a8" in result.stderr and "qkv: bf16-avx2" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason="no AVX2/FMA CPU or no C++ compiler here")
def test_decode_argmax_head_decodes_greedily_only():
    args = ("decode", "smollm2-135m", "--prompt", "hi", "--max-new-tokens", "4", "--lm-head", "argmax")
    result = run(*args, "--method", "greedy")
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]
    assert "lm_head: int8-argmax" in result.stderr
    result = run(*args, "--temperature", "0.7")
    assert result.returncode == 2 and "--lm-head argmax makes only the largest logit exact" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_decode_prompt_lookup_prints_the_greedy_output():
    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog."
    # one named kernel: ``auto`` keeps its timings per machine, but the first two processes on a
    # fresh machine may both time, and under load choose differently (fp32 against bf16 q/k/v)
    runs = {
        method: run(
            "decode",
            "smollm2-135m",
            "--prompt",
            prompt,
            "--method",
            method,
            "--max-new-tokens",
            "16",
            "--kernel",
            "bf16",
        )
        for method in ("greedy", "prompt-lookup")
    }
    for result in runs.values():
        assert result.returncode == 0, result.stderr[-2000:]
    assert runs["greedy"].stdout.strip() and runs["greedy"].stdout == runs["prompt-lookup"].stdout  # lossless
    assert "tokens per target forward" in runs["prompt-lookup"].stderr


@pytest.mark.slow
def test_decode_datastore_keeps_each_output_and_is_refused_outside_prompt_lookup(tmp_path):
    store = tmp_path / "store.json"
    result = run("decode", "smollm2-135m", "--prompt", "hi", "--method", "greedy", "--datastore", str(store))
    assert result.returncode == 2 and "--datastore is for --method prompt-lookup" in result.stderr
    assert "Traceback" not in result.stderr and not store.exists()
    args = ("decode", "smollm2-135m", "--prompt", "Name three colours.", "--max-new-tokens", "12", "--kernel", "bf16")
    first, second = run(*args, "--datastore", str(store)), run(*args, "--datastore", str(store))
    assert first.returncode == second.returncode == 0, second.stderr[-2000:]
    assert first.stdout == second.stdout == run(*args, "--method", "greedy").stdout  # lossless, store or not
    assert len(json.loads(store.read_text())["sequences"]) == 2
