"""Our GGUF exports against llama.cpp's own quantizer, all measured through llama.cpp.

Rows: the dense model as an F16 GGUF (written by ``compress.formats.gguf_file``); llama.cpp's own
quantization of that file at each ``--types`` (``llama_model_quantize``: its per-tensor mixes and
fallbacks, round to nearest, the token embedding as Q8_0 like our exports' ``embedding: q8_0``);
then every GGUF in the export folders given. Columns: perplexity on our windows protocol from
llama.cpp's logits (``compress eval FILE.gguf``: the same token windows), its increase over the
dense model's (computed by transformers, paired over windows, ± one standard error), KL and top-1
agreement against it, file size, bits per weight of the file (all tensors), tokens/s of llama.cpp's
greedy decoding (128 new tokens after the same short prompt) on 1 thread and on every core, and
for our exports our own engine's greedy on the same export folder, same prompt, 1 thread (on the
integers of the export's GGUF file, ``formats.gguf_integers``; compiled, with the lm_head whose
largest logit is exact, ``lm_head="argmax"``: greedy's tokens). One row is printed as
soon as it is measured. Needs ``pip install -e ".[llama]"`` (compiles llama.cpp).

    python scripts/bench_gguf.py out/gptq-q4_k_m out/best-q4_k_m [--types q4_k_m q3_k_m] [--windows 40] [--work DIR]

llama.cpp's importance-matrix quantization is not measured: llama-cpp-python exposes no way to
compute an importance matrix or to pass one to ``llama_model_quantize``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from compress import llama_cpp, machine, models
from compress.evaluate import evaluate_gguf
from compress.formats import gguf_file

TYPES = ["q4_0", "q4_1", "q2_k", "q3_k_m", "q4_k_s", "q4_k_m", "q5_k_m", "q6_k"]


def quantize(lib, source: Path, out: Path, gguf_type: str) -> Path:
    params = lib.llama_model_quantize_default_params()
    params.ftype = gguf_file.FILE_TYPES[gguf_type]
    params.token_embedding_type = lib.GGML_TYPE_Q8_0
    params.nthread = os.cpu_count() or 1
    partial = out.with_name(f".{out.name}.partial")
    if lib.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    os.replace(partial, out)
    return out


def bits_per_weight(path: Path) -> float:
    import gguf

    weights = sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
    return path.stat().st_size * 8 / weights


def decode_speed(path: Path, prompt: list[int], new_tokens: int, threads: int) -> float:
    """Greedy tokens/s after the prompt (the first token, which pays for the prompt, not counted)."""
    with llama_cpp.opened(path, len(prompt) + new_tokens + 8, threads) as llm:
        made, start = 0, None
        for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            made += 1
            if made == 1:
                start = time.perf_counter()
            if made == new_tokens + 1:
                break
        return new_tokens / (time.perf_counter() - start)


def engine_speed(folder: Path, prompt: list[int], new_tokens: int) -> float:
    """Our engine's greedy tokens/s on one thread after the prompt, on the export in ``folder``."""
    import torch

    from compress.decode import greedy
    from compress.decode.engine import Engine
    from compress.formats.gguf_integers import attach_export_integers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = models.load(str(folder), torch.float32).model.eval()
        attach_export_integers(model, folder)  # for our integer kernels
        engine = Engine(model, max_len=len(prompt) + new_tokens + 8, lm_head="argmax", compile=True)
        ids = torch.tensor([prompt])
        greedy(engine, ids, 4)  # the first call chooses kernels
        result = greedy(engine, ids, new_tokens)
        return len(result.tokens) / (result.seconds - result.prompt_seconds)
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="*", help="export folders holding a model-*.gguf")
    parser.add_argument("--model", default="smollm2-135m", help="the dense model the exports came from")
    parser.add_argument("--types", nargs="*", default=TYPES, help="llama.cpp's own quantizations to measure")
    parser.add_argument("--windows", type=int, default=40, help="evaluation windows")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per decode-speed run")
    parser.add_argument("--work", help="folder for the dense and llama.cpp-quantized files (default: temporary)")
    args = parser.parse_args()
    try:
        lib = llama_cpp.module()
    except llama_cpp.LlamaCppError as e:
        sys.exit(f"bench_gguf: {e}")
    cores = os.cpu_count() or 1

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}; llama-cpp-python {lib.__version__}")
    dense_folder = models.resolve(args.model)
    reference = models.open_streamed(args.model, models.parse_dtype("bfloat16"))
    prompt = reference.tokenizer("The history of the city begins", add_special_tokens=False).input_ids[:32]
    print(f"protocol: wikitext2 test, {args.windows} × {args.seqlen} tokens; decode {args.tokens} tokens greedy")
    print()
    head = "| file | type | perplexity | increase over dense | KL | top-1 | size MB | bits/weight | tokens/s 1 thread |"
    print(f"{head} tokens/s {cores} threads | our engine, tokens/s 1 thread |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    dense = work / "dense-f16.gguf"
    if not dense.exists():
        gguf_file.write(dense_folder, None, dense)
    rows = [("dense (ours, F16)", dense)]
    rows += [(f"llama.cpp's own {t.upper()}", work / f"llama-cpp-{t}.gguf") for t in args.types]
    for folder in args.exports:
        rows += [(f"ours: {Path(folder).name}", p) for p in sorted(Path(folder).glob("model-*.gguf"))]
    for name, path in rows:
        if name.startswith("llama.cpp") and not path.exists():
            quantize(lib, dense, path, path.stem.removeprefix("llama-cpp-"))
        kind = path.stem.rsplit("-", 1)[-1].upper()
        r = evaluate_gguf(path, reference.tokenizer, "wikitext2", args.seqlen, args.windows, reference.model)
        increase = f"{r.ppl / r.ref_ppl - 1:+.2%}" + (f" ± {r.increase_se:.2%}" if r.increase_se is not None else "")
        speeds = [decode_speed(path, prompt, args.tokens, n) for n in (1, cores)]
        engine = f"{engine_speed(path.parent, prompt, args.tokens):.1f}" if name.startswith("ours") else ""
        size = path.stat().st_size / 1e6
        print(
            f"| {name} | {kind} | {r.ppl:.3f} | {increase} | {r.kl:.4f} | {r.top1:.3f} | {size:.1f} | "
            f"{bits_per_weight(path):.2f} | {speeds[0]:.1f} | {speeds[1]:.1f} | {engine} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
