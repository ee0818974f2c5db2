"""lm-evaluation-harness tasks on the model as we evaluate it (compress.tasks), offline."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import compress_with, tiny_folder

from compress import models, tasks
from compress.cli import main

pytest.importorskip("lm_eval")

CHOICE_DOCS = [
    {"context": "The cat sat on the", "choices": ["mat", "sky", "idea", "run"], "label": 0},
    {"context": "Paris is the capital of", "choices": ["Spain", "France", "blue"], "label": 1},
    {"context": "One, two, three,", "choices": ["four", "green", "table"], "label": 0},
    {"context": "The sun rises in the", "choices": ["west", "east", "cup"], "label": 1},
]
GENERATE_DOCS = [
    {"context": "The cat sat on the", "word": "mat"},
    {"context": "One, two, three,", "word": "four"},
    {"context": "Water is", "word": "wet"},
]


def _task_files(folder):
    """A multiple-choice and a generative task over local JSON, named by relative paths as a user would."""
    (folder / "choice.jsonl").write_text("".join(json.dumps(d) + "\n" for d in CHOICE_DOCS))
    (folder / "generate.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GENERATE_DOCS))
    (folder / "choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\ndataset_kwargs: {data_files: {test: choice.jsonl}}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: choices\n"
        "doc_to_target: label\nmetric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n"
    )
    (folder / "generate.yaml").write_text(
        "task: tiny_generate\ndataset_path: json\ndataset_kwargs: {data_files: {test: generate.jsonl}}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{word}}'\n"
        "generation_kwargs: {until: ['\\n', '.'], max_gen_toks: 5, do_sample: false}\n"
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}]\n"
    )
    return [str(folder / "choice.yaml"), str(folder / "generate.yaml")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2):
    folder = tmp_path_factory.mktemp("tasks")
    return tiny_folder(folder / "model", smollm2.tokenizer, weight_scale=3.0), _task_files(folder)


def _responses(lm, configs, limit):
    """Each task's per-document responses (log-likelihoods, or generated text) from lm-eval."""
    from lm_eval import simple_evaluate

    out = simple_evaluate(model=lm, tasks=configs, limit=limit, log_samples=True, bootstrap_iters=0)
    return {task: [s["resps"] for s in samples] for task, samples in out["samples"].items()}, out["results"]


def _hflm(folder):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(folder), dtype="float32", batch_size=1, device="cpu")


def _ours(folder):
    loaded = models.load(str(folder), torch.bfloat16)
    return tasks.task_model(models.for_compute(loaded.model, torch.device("cpu")), loaded.tokenizer)


def _assert_same_responses(ours, theirs):
    assert ours.keys() == theirs.keys()
    for task in ours:
        for a, b in zip(ours[task], theirs[task], strict=True):  # a document's requests, each [response]
            for [x], [y] in zip(a, b, strict=True):
                if isinstance(x, str):  # generated text: greedy, token for token
                    assert x == y
                else:  # (log-likelihood, is greedy)
                    assert abs(x[0] - y[0]) < 1e-4 and x[1] == y[1], (x, y)


def test_dense_scores_equal_lm_evals_own_model_on_a_tiny_model(tiny):
    folder, files = tiny
    configs = tasks.resolve(files)
    ours, our_results = _responses(_ours(folder), configs, None)
    theirs, their_results = _responses(_hflm(folder), configs, None)
    _assert_same_responses(ours, theirs)
    assert our_results["tiny_choice"]["acc,none"] == their_results["tiny_choice"]["acc,none"]
    assert len(ours["tiny_generate"]) == len(GENERATE_DOCS)


@pytest.mark.slow
def test_dense_scores_equal_lm_evals_own_model_on_smollm2():
    folder = models.local_folder("smollm2-135m")
    configs = tasks.resolve(["wikitext_cloze", "wikitext_lastword"])  # the shipped offline tasks
    ours, our_results = _responses(_ours(folder), configs, 3)
    theirs, their_results = _responses(_hflm(folder), configs, 3)
    _assert_same_responses(ours, theirs)
    for task, metric in (("wikitext_cloze", "acc,none"), ("wikitext_lastword", "exact_match,first-word")):
        assert our_results[task][metric] == their_results[task][metric]


def _distinct_vocabulary(model):
    """The tiny model's resized vocabulary rows are all alike, so text barely moves its outputs:
    distinct rows, so that rounding shows in the log-likelihoods."""
    torch.manual_seed(0)
    model.get_input_embeddings().weight.data.normal_(0, 1)
    model.get_output_embeddings().weight.data.normal_(0, 0.5)


def test_w8a8_task_scores_see_the_quantized_activations(tmp_path, smollm2):
    """The export's int8 activations are in the log-likelihoods: they differ from the same weights
    with activation quantization switched off (what a weight-only reading of the export gives)."""
    from compressed_tensors.quantization import disable_quantization

    from compress.export import export

    folder = tiny_folder(tmp_path / "dense", smollm2.tokenizer)
    model = models.load(str(folder), torch.float32).model
    _distinct_vocabulary(model)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    recipe = compress_with(model, "  - smoothquant: {alpha: 0.5}\n  - gptq: {bits: 8, group_size: -1}\n", ids)
    out = export(model, smollm2.tokenizer, tmp_path / "w8a8", recipe.text, {})
    configs = tasks.resolve(_task_files(tmp_path)[:1])
    quantized = _ours(out)
    weight_only = copy.deepcopy(quantized.model)
    weight_only.apply(disable_quantization)
    served, _ = _responses(quantized, configs, None)
    unrounded, _ = _responses(tasks.task_model(weight_only, quantized.tokenizer), configs, None)
    gaps = [
        abs(x[0] - y[0])
        for a, b in zip(served["tiny_choice"], unrounded["tiny_choice"], strict=True)
        for [x], [y] in zip(a, b, strict=True)
    ]
    assert max(gaps) > 4e-4, gaps  # beyond the 1e-4 our dense log-likelihoods may differ from HFLM by


def test_eval_tasks_prints_scores_beside_the_dense_models_and_fills_in_the_report(tiny, tmp_path, capsys):
    folder, files = tiny
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "passes:\n  - rtn: {bits: 4, group_size: 32}\n"
        f"evaluation: {{ppl: null, tasks: [{', '.join(files)}], task_limit: 2}}\n"
    )
    out = tmp_path / "out"
    assert main(["apply", str(recipe), "--model", str(folder), "--output", str(out)]) == 0
    scores = json.loads((out / "report.json").read_text())["tasks"]
    acc = scores["results"]["tiny_choice"]["metrics"]["acc"]
    assert scores["results"]["tiny_choice"]["samples"] == 2 and acc["dense"] is not None
    assert acc["recovery"] == pytest.approx(acc["value"] / acc["dense"]) if acc["dense"] else acc["recovery"] is None
    capsys.readouterr()
    assert main(["eval", str(out), "--tasks", ",".join(files), "--limit", "2", "--write-report"]) == 0
    printed = capsys.readouterr()
    assert "| tiny_choice | acc |" in printed.out and "| tiny_generate | exact_match |" in printed.out
    assert "dense model's scores read from" in printed.err  # apply's run kept them
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"]["results"]["tiny_generate"]["samples"] == 2 and report["tasks"]["settings"]["limit"] == 2


def test_bad_task_input_is_one_line_and_writes_nothing(tiny, tmp_path, monkeypatch):
    folder, files = tiny

    def refused(*args, match):
        result = subprocess.run(
            [sys.executable, "-m", "compress.cli", *args], capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert result.returncode == 2 and match in result.stderr, result.stderr[-1500:]
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    env = dict(os.environ)
    refused("eval", str(folder), "--tasks", "wikitext_clozee", match="did you mean wikitext_cloze")
    refused("eval", str(folder), "--tasks", "missing.yaml", match="no such file")
    refused("eval", "model.gguf", "--tasks", "wikitext_cloze", match="not a .gguf file")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("passes:\n  - rtn: {bits: 4}\nevaluation: {tasks: [no_such_task_at_all]}\n")
    refused("apply", str(recipe), "--model", str(folder), "--output", str(tmp_path / "out"), match="no such task")
    assert not (tmp_path / "out").exists()
    (tmp_path / "lm_eval").mkdir()  # an lm_eval that cannot import: as if not installed
    (tmp_path / "lm_eval" / "__init__.py").write_text("raise ImportError('not here')\n")
    env["PYTHONPATH"] = str(tmp_path)
    refused("eval", str(folder), "--tasks", files[0], match="pip install 'lm-eval")
    monkeypatch.setattr(models, "hub_reachable", lambda *a: False)  # offline: a task whose data is on the hub
    with pytest.raises(tasks.DataError, match="arc_easy: lm-eval reads allenai/ai2_arc from the hub, which is unre"):
        tasks.resolve(["arc_easy"])
    (tmp_path / "hub.yaml").write_text("task: arc_copy\ndataset_path: allenai/ai2_arc\noutput_type: multiple_choice\n")
    with pytest.raises(tasks.DataError, match="hub.yaml: lm-eval reads allenai/ai2_arc from the hub"):
        tasks.resolve([str(tmp_path / "hub.yaml")])


def test_a_quantized_kv_cache_is_in_the_task_scores(tiny):
    """Log-likelihoods read keys and values rounded as a KIVI decoder holds them (2 bits here, no
    full-precision window), and generation runs on that cache: both differ from the plain model's."""
    from compress import kv_quant

    folder, files = tiny
    configs = tasks.resolve(files)
    plain = _ours(folder)
    _distinct_vocabulary(plain.model)
    rounded = copy.deepcopy(plain.model)
    kv_quant.install(rounded, kv_quant.KVScheme(bits=2, group_size=4, residual=0))
    before, _ = _responses(plain, configs, None)
    after, _ = _responses(tasks.task_model(rounded, plain.tokenizer), configs, None)
    gaps = [abs(x[0] - y[0]) for a, b in zip(before["tiny_choice"], after["tiny_choice"]) for [x], [y] in zip(a, b)]
    assert max(gaps) > 1e-2, gaps
    assert len(after["tiny_generate"]) == len(GENERATE_DOCS)
