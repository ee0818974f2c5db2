"""Bad input of every kind gets exit status 2 and one line naming what to change, and leaves the
disk as it was: nothing created, nothing deleted (a snapshot of the test's folder before and after)."""

from __future__ import annotations

import copy
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny

from compress import machine
from compress.cli import main
from compress.export import MANIFEST

RECIPE = "passes:\n  - rtn: {bits: 4, group_size: 32}\nevaluation: {windows: 1, seqlen: 32}\n"
DATA_RECIPE = "passes:\n  - gptq: {{bits: 4, group_size: 32}}\ncalibration: {{source: {}, samples: 2, seqlen: 16}}\n"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, smollm2):
    """A tiny Llama with SmolLM2's tokenizer, and one with a vocabulary of its own (a bad draft)."""
    root = tmp_path_factory.mktemp("models")
    model = tiny("llama", hidden=64, layers=2)
    model.resize_token_embeddings(len(smollm2.tokenizer))
    model.to(torch.bfloat16).save_pretrained(root / "tiny")
    smollm2.tokenizer.save_pretrained(root / "tiny")
    other = tiny("llama", hidden=64, layers=2)  # 128 tokens
    other.save_pretrained(root / "other-vocab")
    smollm2.tokenizer.save_pretrained(root / "other-vocab")
    return root


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# Each case: (id, setup(tmp, models) -> argv). The setup writes what the case needs; the snapshot
# is taken after it. The expected words must appear in the one error line.
def _recipe(tmp, text, name="r.yaml"):
    (tmp / name).write_text(text) if isinstance(text, str) else (tmp / name).write_bytes(text)
    return str(tmp / name)


def _apply(tmp, m, *extra, recipe=RECIPE):
    return ["apply", _recipe(tmp, recipe), "--model", str(m / "tiny"), "--output", str(tmp / "out"), *extra]


def _exporty(tmp):  # an earlier export of ours
    (tmp / "out").mkdir()
    (tmp / "out" / MANIFEST).write_text("{}")


def _reported(tmp):  # an export folder with its report.json, as `compress report` reads it
    (tmp / "export").mkdir()
    (tmp / "export" / "report.json").write_text(json.dumps({"recipe": "r", "bits_per_weight": 4.5, "eval": {}}))
    return str(tmp / "export")


def _report_onto(tmp, files):
    (tmp / "notes").mkdir()
    for name in files:
        (tmp / "notes" / name).write_text("mine")
    return ["report", _reported(tmp), "--output", str(tmp / "notes")]


def _export_of(tmp, m, *extra, damage=None):
    """`compress export` of a W4 export of ours (made here, before the snapshot; ``damage``d after)."""
    w4 = RECIPE.replace("group_size: 32", "group_size: 32, symmetric: true")
    assert main(_apply(tmp, m, "--no-eval", recipe=w4)) == 0
    if damage is not None:
        damage(tmp / "out")
    return ["export", str(tmp / "out"), "--gguf", "q4_0", *extra]


def _busy(tmp):
    """Another run is writing ``out``: its lock (a live process: pytest's parent) and its resume checkpoints."""
    (tmp / ".out.lock").write_text(str(os.getppid()))
    (tmp / ".out.resume").mkdir()
    (tmp / ".out.resume" / "state.json").write_text('{"blocks": 1, "key": {}}')


def _notes(tmp):
    (tmp / "notes").mkdir()
    (tmp / "notes" / "todo.txt").write_text("mine")
    return str(tmp / "notes")


def _bad_model(tmp, m, change):
    folder = _copy_model(m / "tiny", tmp / "bad-model")
    change(folder)
    return ["apply", _recipe(tmp, RECIPE), "--model", str(folder), "--output", str(tmp / "out")]


def _truncate(folder):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:5000])


def _bad_header(folder):
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes((100).to_bytes(8, "little") + b"{not json" + data[17:])


def _auto_map(folder):
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))


def _tensors(change):
    """A model folder change made on its tensors (a dict of name -> tensor), saved back as safetensors."""
    from safetensors.torch import load_file, save_file

    def apply(folder):
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    return apply


_NO_UP_PROJ = _tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
_NARROW_UP_PROJ = _tensors(
    lambda t: t.update({"model.layers.1.mlp.up_proj.weight": t["model.layers.1.mlp.up_proj.weight"][:-1]})
)


def _bad_decode_model(tmp, m, change):
    folder = _copy_model(m / "tiny", tmp / "bad-model")
    change(folder)
    return ["decode", str(folder), "--prompt", "hello", "--max-new-tokens", "2"]


def _escaping_template(folder):
    """A chat template that reaches for Python's internals (Jinja's sandbox refuses it)."""
    (folder / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _pickle_only(folder):
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _config(**changes):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        (folder / "config.json").write_text(json.dumps(config))

    return change


def _no_tokenizer(folder):
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            f.unlink()


def _data(tmp, name, content):
    path = tmp / name
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return str(path)


def _decode(m, *extra, prompt="hello"):
    return ["decode", str(m / "tiny"), "--prompt", prompt, *extra]


CASES = {
    # recipes
    "recipe is a folder": (lambda t, m: ["apply", str(t)], "is a folder"),
    "recipe is binary": (lambda t, m: ["apply", _recipe(t, b"\xff\xfe\x00\x81" * 10)], "not a UTF-8"),
    "recipe is missing": (lambda t, m: ["apply", str(t / "nope.yaml")], "no recipe file"),
    "recipe YAML syntax": (lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {bits: 4\n")], "line"),
    "recipe is a list": (lambda t, m: ["apply", _recipe(t, "- rtn\n")], "YAML mapping"),
    "recipe is empty": (lambda t, m: ["apply", _recipe(t, "")], "YAML mapping"),
    "recipe unknown pass": (lambda t, m: ["apply", _recipe(t, "passes:\n  - nosuch: {}\n")], "nosuch"),
    "recipe bad bits": (lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {bits: 5}\n")], "bits"),
    "recipe unknown key": (lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {bitz: 4}\n")], "bitz"),
    "recipe python tag": (
        lambda t, m: ["apply", _recipe(t, "passes: !!python/object/apply:os.system ['true']\n")],
        "YAML",
    ),
    "recipe no passes": (lambda t, m: ["apply", _recipe(t, "seed: 1\n")], "passes"),
    "recipe negative samples": (lambda t, m: ["apply", _recipe(t, RECIPE + "calibration: {samples: -1}\n")], "samples"),
    "recipe negative seed": (lambda t, m: ["apply", _recipe(t, RECIPE + "seed: -1\n")], "seed"),
    "recipe seed of 2^70": (lambda t, m: ["apply", _recipe(t, RECIPE + f"seed: {2**70}\n")], "seed"),
    "recipe duplicate key": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {bits: 4, bits: 3}\n")],
        "'bits' is given twice",
    ),
    "recipe duplicate top-level key": (lambda t, m: ["apply", _recipe(t, RECIPE + "seed: 1\nseed: 2\n")], "twice"),
    "recipe gptq percdamp -1": (lambda t, m: ["apply", _recipe(t, "passes:\n  - gptq: {percdamp: -1}\n")], "percdamp"),
    "recipe gptq blocksize 0": (lambda t, m: ["apply", _recipe(t, "passes:\n  - gptq: {blocksize: 0}\n")], "blocksize"),
    "recipe awq grid 0": (lambda t, m: ["apply", _recipe(t, "passes:\n  - awq: {grid: 0}\n")], "grid"),
    "recipe awq max_shrink 1": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - awq: {max_shrink: 1}\n")],
        "max_shrink",
    ),
    "recipe ignore regex does not compile": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {ignore: ['re:(']}\n")],
        "regular expression",
    ),
    "recipe nested too deeply": (lambda t, m: ["apply", _recipe(t, "passes: " + "[" * 5000 + "]" * 5000)], "deeply"),
    "recipe larger than 1 MB": (lambda t, m: ["apply", _recipe(t, "passes: [" + " " * (2 << 20))], "MB"),
    "recipe rtn twice": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {bits: 4}\n  - rtn: {bits: 4}\n")],
        "already rounded",
    ),
    "recipe pruning after rounding": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {bits: 4}\n  - magnitude: {}\n")],
        "already rounded",
    ),
    "recipe fp8_block on widths the tiles do not fit": (
        lambda t, m: _apply(t, m, recipe="passes:\n  - rtn: {format: fp8_block}\n"),
        "fp8_block",
    ),
    "recipe nvfp4 inputs on mxfp4 weights": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - rtn: {format: mxfp4}\n  - activations: {format: nvfp4}\n")],
        "nvfp4 weights",
    ),
    "recipe two KV caches": (
        lambda t, m: ["apply", _recipe(t, "passes:\n  - kv_cache: {bits: 4}\n  - kv_fp8: {}\n")],
        "one KV cache",
    ),
    "apply --device tpu": (lambda t, m: _apply(t, m, "--device", "tpu"), "--device tpu"),
    "apply --device cuda:7": (lambda t, m: _apply(t, m, "--device", "cuda:7"), "--device cuda:7"),
    "apply unknown flag": (lambda t, m: _apply(t, m, "--bits", "4"), "--bits"),
    # outputs
    "output exists": (lambda t, m: (_exporty(t), _apply(t, m))[1], "--overwrite"),
    "overwrite a folder of notes": (
        lambda t, m: ["apply", _recipe(t, RECIPE), "--model", str(m / "tiny"), "--output", _notes(t), "--overwrite"],
        "not an export",
    ),
    "overwrite the current folder": (
        lambda t, m: ["apply", _recipe(t, RECIPE), "--model", str(m / "tiny"), "--output", ".", "--overwrite"],
        "current folder",
    ),
    "overwrite a folder above": (
        lambda t, m: ["apply", _recipe(t, RECIPE), "--model", str(m / "tiny"), "--output", "..", "--overwrite"],
        "above",
    ),
    "overwrite the home folder": (
        lambda t, m: [
            "apply",
            _recipe(t, RECIPE),
            "--model",
            str(m / "tiny"),
            "--output",
            str(Path.home()),
            "--overwrite",
        ],
        "home",
    ),
    "overwrite the model folder": (
        lambda t, m: [
            "apply",
            _recipe(t, RECIPE),
            "--model",
            str(_copy_model(m / "tiny", t / "model-copy")),
            "--output",
            str(t / "model-copy"),
            "--overwrite",
        ],
        "input of this run",
    ),
    "overwrite an export holding the model": (
        lambda t, m: (
            _copy_model(m / "tiny", t / "exp"),
            (t / "exp" / MANIFEST).write_text("{}"),
            ["apply", _recipe(t, RECIPE), "--model", str(t / "exp"), "--output", str(t / "exp"), "--overwrite"],
        )[-1],
        "input of this run",
    ),
    "overwrite the recipe's folder": (
        lambda t, m: (
            (t / "recipes").mkdir(),
            (t / "recipes" / MANIFEST).write_text("{}"),
            [
                "apply",
                _recipe(t / "recipes", RECIPE),
                "--model",
                str(m / "tiny"),
                "--output",
                str(t / "recipes"),
                "--overwrite",
            ],
        )[-1],
        "input of this run",
    ),
    "output parent is a file": (
        lambda t, m: ((t / "file").write_text("x"), _apply(t, m)[:-1] + [str(t / "file" / "out")])[1],
        "is a file",
    ),
    "output is a file": (lambda t, m: ((t / "out").write_text("x"), _apply(t, m, "--overwrite"))[1], "not an export"),
    "--spill is missing": (
        lambda t, m: _apply(t, m, "--spill", str(t / "nope"), recipe=DATA_RECIPE.format("wikitext2")),
        "--spill",
    ),
    # models
    "apply onto an --output another run is writing": (lambda t, m: (_busy(t), _apply(t, m))[1], "pid"),
    "apply --resume onto an --output another run is writing": (
        lambda t, m: (_busy(t), _apply(t, m, "--resume"))[1],
        "another compress run",
    ),
    "model folder missing": (lambda t, m: ["apply", _recipe(t, RECIPE), "--model", str(t / "nope")], "nope"),
    "model hub id offline": (lambda t, m: ["apply", _recipe(t, RECIPE), "--model", "nobody/nothing-9z"], "nobody"),
    # calibration and evaluation text
    "calibration file missing": (lambda t, m: _apply(t, m, recipe=DATA_RECIPE.format(str(t / "none.txt"))), "none.txt"),
    "calibration text not UTF-8": (
        lambda t, m: _apply(t, m, recipe=DATA_RECIPE.format(_data(t, "bin.txt", b"\xff\xfe" * 100))),
        "UTF-8",
    ),
    "calibration jsonl text not a string": (
        lambda t, m: _apply(t, m, recipe=DATA_RECIPE.format(_data(t, "d.jsonl", '{"text": 5}\n'))),
        "text",
    ),
    "calibration jsonl not JSON": (
        lambda t, m: _apply(t, m, recipe=DATA_RECIPE.format(_data(t, "e.jsonl", "not json\n"))),
        "jsonl",
    ),
    "eval model missing": (lambda t, m: ["eval", str(t / "nope")], "nope"),
    "eval --ppl missing file": (
        lambda t, m: ["eval", str(m / "tiny"), "--seqlen", "32", "--ppl", str(t / "none.txt")],
        "none.txt",
    ),
    "eval --ppl not UTF-8": (
        lambda t, m: ["eval", str(m / "tiny"), "--seqlen", "32", "--ppl", _data(t, "b.txt", b"\xff" * 50)],
        "UTF-8",
    ),
    "eval --reference missing": (lambda t, m: ["eval", str(m / "tiny"), "--reference", str(t / "ref")], "ref"),
    "eval --reference of another vocabulary": (
        lambda t, m: ["eval", str(m / "tiny"), "--reference", str(m / "other-vocab"), "--windows", "1"],
        "vocabulary",
    ),
    "eval --seqlen past the context": (lambda t, m: ["eval", str(m / "tiny"), "--seqlen", "100000"], "context"),
    "eval --write-report on a model, not an export": (lambda t, m: ["eval", str(m / "tiny"), "--write-report"], "tiny"),
    # decoding
    "decode --raw empty prompt": (lambda t, m: _decode(m, "--raw", prompt=""), "prompt"),
    "decode model missing": (lambda t, m: ["decode", str(t / "nope"), "--prompt", "hi"], "nope"),
    "decode draft missing": (lambda t, m: _decode(m, "--method", "draft", "--draft", str(t / "nope")), "nope"),
    "decode draft of another vocabulary": (
        lambda t, m: _decode(m, "--method", "draft", "--draft", str(m / "other-vocab")),
        "vocabulary",
    ),
    "decode --layers out of range": (lambda t, m: _decode(m, "--method", "self-spec", "--layers", "0-99"), "--layers"),
    "decode prompt longer than the context": (lambda t, m: _decode(m, "--raw", prompt="word " * 400), "context"),
    "decode --max-new-tokens past the context": (lambda t, m: _decode(m, "--max-new-tokens", "10000000"), "context"),
    "decode with a chat template leaving the sandbox": (
        lambda t, m: _bad_decode_model(t, m, _escaping_template),
        "chat template",
    ),
    "decode --kernel int4 on a model without 4-bit weights": (lambda t, m: _decode(m, "--kernel", "int4"), "4-bit"),
    "decode --kernel fp8 on a model without FP8 weights": (lambda t, m: _decode(m, "--kernel", "fp8"), "FP8 weights"),
    "decode --datastore is a folder": (
        lambda t, m: _decode(m, "--method", "prompt-lookup", "--datastore", str(t)),
        "--datastore",
    ),
    "decode --datastore not JSON": (
        lambda t, m: _decode(m, "--method", "prompt-lookup", "--datastore", _data(t, "store.json", "{nope")),
        "store.json",
    ),
    # GGUF export
    "export of a model that is not an export of ours": (
        lambda t, m: ["export", str(m / "tiny"), "--gguf", "q4_0"],
        "not an export of ours",
    ),
    "export --output under a file": (
        lambda t, m: _export_of(t, m, "--output", str(Path(_data(t, "f.txt", "mine")) / "m.gguf")),
        "not a folder",
    ),
    "export --output in a missing folder": (
        lambda t, m: _export_of(t, m, "--output", str(t / "nope" / "m.gguf")),
        "not a folder",
    ),
    "export --output onto a user's file": (
        lambda t, m: _export_of(t, m, "--output", _data(t, "notes.txt", "mine")),
        "choose another --output",
    ),
    "export --output onto a GGUF file without --overwrite": (
        lambda t, m: _export_of(t, m, "--output", _data(t, "m.gguf", "mine")),
        "pass --overwrite",
    ),
    "export of a truncated checkpoint": (lambda t, m: _export_of(t, m, damage=_truncate), "model.safetensors"),
    "export of a checkpoint with a garbage header": (
        lambda t, m: _export_of(t, m, damage=_bad_header),
        "model.safetensors",
    ),
    "export --gguf unknown type": (lambda t, m: _export_of(t, m, "--gguf", "iq2_xs"), "--gguf"),
    "export --embedding unknown": (lambda t, m: _export_of(t, m, "--embedding", "int4"), "--embedding"),
    # reports
    "report onto a user's report.md": (lambda t, m: _report_onto(t, ["report.md"]), "not written by"),
    "report onto a user's plot": (lambda t, m: _report_onto(t, ["ppl_vs_bits.png"]), "ppl_vs_bits.png"),
    "report of a folder without report.json": (lambda t, m: ["report", str(m / "tiny")], "report.json"),
    "report of a missing folder": (lambda t, m: ["report", str(t / "nope")], "nope"),
    "report --output is a file": (
        lambda t, m: ["report", _reported(t), "--output", _data(t, "r.txt", "mine")],
        "is a file",
    ),
    "report --output under a file": (
        lambda t, m: ["report", _reported(t), "--output", str(Path(_data(t, "r.txt", "mine")) / "r")],
        "r.txt",
    ),
    "report --output empty": (lambda t, m: ["report", _reported(t), "--output", ""], "--output"),
}

# A flag given a value out of its range (or of the wrong kind): the error names the flag.
BAD_FLAGS = {
    "apply": [
        ("--samples", "0"),
        ("--samples", "-3"),
        ("--samples", "abc"),
        ("--windows", "0"),
        ("--windows", "-1"),
        ("--seqlen", "0"),
        ("--seqlen", "1"),
        ("--max-shard-mb", "0"),
        ("--output", ""),
        ("--seed", "-1"),
        ("--dtype", "int8"),
    ],
    "eval": [("--windows", "0"), ("--windows", "-1"), ("--seqlen", "0"), ("--seqlen", "1"), ("--device", "tpu")],
    "decode": [
        ("--top-p", "0"),
        ("--top-p", "2"),
        ("--temperature", "-1"),
        ("--temperature", "inf"),
        ("--temperature", "nan"),
        ("--max-new-tokens", "-1"),
        ("--max-new-tokens", "0"),
        ("--k", "-3"),
        ("--k", "0"),
        ("--threshold", "2"),
        ("--exit-threshold", "0"),
        ("--token-cost", "-1"),
        ("--token-cost", "lots"),
        ("--window", "0"),
        ("--ngram", "1"),
        ("--guesses", "0"),
        ("--seed", "-2"),
        ("--method", "nonsense"),
        ("--kernel", "nonsense"),
        ("--lm-head", "int2"),
    ],
}
# model folders that parse but are broken: apply (streamed, a block at a time) and decode (loaded whole)
BROKEN_FOLDERS = {
    "with a truncated safetensors": (_truncate, "model.safetensors"),
    "with a bad safetensors header": (_bad_header, "model.safetensors"),
    "with auto_map": (_auto_map, "code"),
    "with pickle weights only": (_pickle_only, "pickle"),
    "without tokenizer files": (_no_tokenizer, "tokenizer"),
    "of an unknown model_type": (_config(model_type="nosuchmodel"), "nosuchmodel"),
    "with another tool's quantization_config": (
        _config(quantization_config={"quant_method": "gptq", "bits": 4}),
        "gptq",
    ),
    "without config": (lambda f: (f / "config.json").unlink(), "config.json"),
    "whose config is not JSON": (lambda f: (f / "config.json").write_text("{"), "config.json"),
    "whose config has more layers than the weights": (_config(num_hidden_layers=3), "layers.2"),
    "whose config has fewer layers than the weights": (_config(num_hidden_layers=1), "more blocks than its config"),
    "whose embeddings disagree with vocab_size": (_config(vocab_size=50000), "embed_tokens"),
    "lacking a tensor": (_NO_UP_PROJ, "up_proj"),
    "with a tensor of the wrong shape": (_NARROW_UP_PROJ, "up_proj"),
}
for _what, (_change, _words) in BROKEN_FOLDERS.items():
    CASES[f"model {_what}"] = (lambda t, m, c=_change: _bad_model(t, m, c), _words)
    CASES[f"decode a model {_what}"] = (lambda t, m, c=_change: _bad_decode_model(t, m, c), _words)
    CASES[f"eval a model {_what}"] = (
        lambda t, m, c=_change: ["eval", _bad_model(t, m, c)[3], "--seqlen", "32"],
        _words,
    )
COMMANDS = {
    "apply": _apply,
    "eval": lambda t, m, *extra: ["eval", str(m / "tiny"), *extra],
    "decode": lambda t, m, *extra: _decode(m, *extra),
}
for _command, _pairs in BAD_FLAGS.items():
    for _flag, _value in _pairs:
        CASES[f"{_command} {_flag} {_value}"] = (
            lambda t, m, c=_command, f=_flag, v=_value: COMMANDS[c](t, m, f, v),
            _flag,
        )


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_line_and_changes_nothing(case, model_folder, tmp_path, monkeypatch, capsys):
    setup, words = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = setup(work, model_folder)
    capsys.readouterr()
    before, models_before = _snapshot(tmp_path), _snapshot(model_folder)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("compress: ")]
    assert code == 2, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert words in lines[0], lines[0]
    assert _snapshot(tmp_path) == before and _snapshot(model_folder) == models_before


def test_bf16_calibration_is_refused_where_the_cpu_emulates_bf16(model_folder, tmp_path, monkeypatch, capsys):
    """bf16 calibration (the recipe's ``calibration.dtype`` or ``--calibration-dtype``) on a CPU
    without AVX512-BF16 or AMX (this one pretends): one line that says to use auto, exit 2, nothing
    written."""
    monkeypatch.setattr(machine, "bf16_arithmetic", lambda: False)
    monkeypatch.chdir(tmp_path)
    in_recipe = DATA_RECIPE.replace("seqlen: 16}}", "seqlen: 16, dtype: bfloat16}}").format("wikitext2")
    for recipe, flags in ((in_recipe, ()), (DATA_RECIPE.format("wikitext2"), ("--calibration-dtype", "bfloat16"))):
        argv = _apply(tmp_path, model_folder, *flags, recipe=recipe)
        before = _snapshot(tmp_path)
        assert main(argv) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("compress: ")]
        assert len(lines) == 1 and "bfloat16" in lines[0] and "use auto" in lines[0], lines
        assert _snapshot(tmp_path) == before


def test_there_are_sixty_cases_or_more():
    assert len(CASES) >= 60


def test_leftovers_of_a_killed_run_are_removed_and_only_those(tmp_path):
    from compress.export import Export

    dead = tmp_path / f".out.tmp-{2**22 + 12345}-abc"  # above the kernel's pid limit: no such process
    alive = tmp_path / f".out.tmp-{os.getpid()}-def"
    mine = tmp_path / ".out.tmp-notes"  # not our pattern
    for folder in (dead, alive, mine):
        folder.mkdir()
    writer = Export(tmp_path / "out")
    writer.abort()
    assert not dead.exists() and alive.exists() and mine.exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(model_folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".out.lock").write_text(str(2**22 + 12345))  # above the kernel's pid limit: no such process
    assert main(_apply(tmp_path, model_folder, "--no-eval")) == 0
    assert (tmp_path / "out" / MANIFEST).is_file() and not (tmp_path / ".out.lock").exists()


def _mutations():
    """Recipes: the shipped ones, each changed at one place (a value replaced, a key dropped or added)."""
    import yaml
    from hypothesis import strategies as st

    from compress.recipe import RECIPES_DIR

    shipped = [yaml.safe_load(p.read_text()) for p in sorted(RECIPES_DIR.glob("*.yaml"))]
    values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 300),
        st.floats(allow_nan=True),
        st.text(max_size=8),
        st.lists(st.integers(-1, 9), max_size=3),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    )

    @st.composite
    def mutated(draw):
        recipe = copy.deepcopy(draw(st.sampled_from(shipped)))
        spots, stack = [], [(recipe, ())]
        while stack:  # every mapping and list inside, with its keys
            node, path = stack.pop()
            keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else []
            for k in keys:
                spots.append((node, k))
                stack.append((node[k], path + (k,)))
        node, key = draw(st.sampled_from(spots))
        how = draw(st.sampled_from(["replace", "drop", "add"]))
        if how == "replace" or not isinstance(node, dict):
            node[key] = draw(values)
        elif how == "drop":
            del node[key]
        else:
            node[draw(st.text(min_size=1, max_size=6))] = draw(values)
        return recipe

    return mutated()


def test_mutated_recipes_give_a_clean_error_or_a_checked_plan():
    import yaml
    from hypothesis import HealthCheck, given, settings

    from compress.passes import RecipeError
    from compress.recipe import parse

    model = tiny("llama", hidden=64, layers=2)

    @settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(_mutations())
    def check(recipe):
        try:
            parsed = parse(yaml.safe_dump(recipe))
            for p in parsed.passes:
                p.check(model)
        except RecipeError as e:
            assert str(e) and "\n" not in str(e).strip(), str(e)

    check()


def test_exports_are_readable_by_others_and_name_no_code(tmp_path, smollm2):
    from compress.export import export
    from compress.state import LoRA

    model = tiny("llama", hidden=64, layers=1)
    model.config.auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    down = model.model.layers[0].mlp.down_proj
    LoRA(torch.zeros(down.out_features, 2), torch.zeros(2, down.in_features)).attach(down)  # an adapter too
    mask = os.umask(0o022)
    try:
        out = export(model, smollm2.tokenizer, tmp_path / "out", "passes: []\n", {})
    finally:
        os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out.rglob("*") if f.is_file())
    assert "auto_map" not in json.loads((out / "config.json").read_text())


@pytest.mark.slow
def test_a_damaged_cached_conversion_is_converted_again(tmp_path, monkeypatch, capsys):
    """The bundled GGUF's safetensors conversion, cut short (a full disk, a copy stopped), is rebuilt
    instead of failing every later run."""
    from compress import models

    monkeypatch.setenv("COMPRESS_CACHE", str(tmp_path))
    target = models.resolve("smollm2-135m")
    weights = target / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])
    capsys.readouterr()
    assert models.resolve("smollm2-135m") == target
    assert "is damaged; converting it again" in capsys.readouterr().out
    assert weights.read_bytes() == good
    assert models.resolve("smollm2-135m") == target and "damaged" not in capsys.readouterr().out


def _full_disk(where):
    def write(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(where / "x"))

    return write


def test_a_full_disk_is_one_line_and_leaves_nothing(model_folder, tmp_path, monkeypatch, capsys):
    """apply, export --gguf and report on a file system that fills up: exit 2, one line naming the
    folder and what to do, and the disk as it was."""
    import gguf

    from compress.formats.safetensors import ShardWriter

    monkeypatch.chdir(tmp_path)
    w4 = RECIPE.replace("group_size: 32", "group_size: 32, symmetric: true")
    assert main(_apply(tmp_path, model_folder, "--no-eval", "--output", str(tmp_path / "w4"), recipe=w4)) == 0
    commands = {
        "apply": (_apply(tmp_path, model_folder, "--no-eval"), ShardWriter, "add"),
        "export": (["export", str(tmp_path / "w4"), "--gguf", "q4_0"], gguf.GGUFWriter, "write_tensor_data"),
        "report": (["report", str(tmp_path / "w4"), "--output", str(tmp_path / "r")], Path, "write_text"),
    }
    for command, (argv, owner, method) in commands.items():
        capsys.readouterr()
        before = _snapshot(tmp_path)
        with monkeypatch.context() as m:
            m.setattr(owner, method, _full_disk(tmp_path))
            assert main(argv) == 2, command
        err = capsys.readouterr().err
        assert f"No space left on device writing in {tmp_path}" in err and "free some space" in err, (command, err)
        assert len([line for line in err.splitlines() if line.startswith("compress: ")]) == 1, err
        assert _snapshot(tmp_path) == before, command
