"""Our GGUF exports against llama.cpp's own quantizer, all measured through llama.cpp.

Rows: the dense model as an F16 GGUF (written by ``compress.formats.gguf_file``); llama.cpp's own
Q4_0 and Q4_1 of that file (``llama_model_quantize``, round to nearest, with the token
embedding as Q8_0 like our exports' ``embedding: q8_0``); then every GGUF in the export folders
given. Columns: perplexity on our windows protocol computed from llama.cpp's logits (the same
token windows as ``compress eval``), its increase over the dense file, file size, and tokens/s of
greedy decoding (128 new tokens after a 32-token prompt) on 1 thread and on every core. One row
is printed as soon as it is measured. Needs ``pip install -e ".[llama]"`` (compiles llama.cpp).

    python scripts/bench_gguf.py out/gptq-w4-gguf out/awq-w4-gguf [--windows 40] [--work DIR]

llama.cpp's importance-matrix quantization is not measured: llama-cpp-python exposes no way to
compute an importance matrix or to pass one to ``llama_model_quantize``.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from compress import machine, models
from compress.evaluate import windows_of
from compress.formats import gguf_file


def llama_cpp_or_exit():
    try:
        import llama_cpp
    except ImportError:
        sys.exit('bench_gguf: needs llama-cpp-python: pip install -e ".[llama]" (it compiles llama.cpp)')
    return llama_cpp


def quantize(llama_cpp, source: Path, out: Path, ftype: int) -> Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.token_embedding_type = llama_cpp.GGML_TYPE_Q8_0
    params.nthread = os.cpu_count() or 1
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {source}")
    return out


def perplexity(llama_cpp, path: Path, windows: np.ndarray, threads: int) -> float:
    """exp(mean NLL of tokens 1..n-1 of each window given the ones before), from llama.cpp's logits."""
    seqlen = windows.shape[1]
    llm = llama_cpp.Llama(
        str(path), n_ctx=seqlen, n_batch=seqlen, n_ubatch=512, logits_all=True, n_threads=threads, verbose=False
    )
    nll, count = 0.0, 0
    try:
        for window in windows:
            llm.reset()
            llm.eval(window.tolist())
            logits = np.asarray(llm.scores[: seqlen - 1], dtype=np.float64)
            logits -= logits.max(-1, keepdims=True)
            logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            nll -= logp[np.arange(seqlen - 1), window[1:]].sum()
            count += seqlen - 1
    finally:
        llm.close()
    return math.exp(nll / count)


def decode_speed(llama_cpp, path: Path, prompt: list[int], new_tokens: int, threads: int) -> float:
    """Greedy tokens/s after the prompt (the first token, which pays for the prompt, not counted)."""
    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + new_tokens + 8, n_threads=threads, verbose=False)
    try:
        made, start = 0, None
        for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
            made += 1
            if made == 1:
                start = time.perf_counter()
            if made == new_tokens + 1:
                break
        return new_tokens / (time.perf_counter() - start)
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exports", nargs="*", help="export folders holding a model-*.gguf")
    parser.add_argument("--model", default="smollm2-135m", help="the dense model the exports came from")
    parser.add_argument("--windows", type=int, default=40, help="evaluation windows")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per decode-speed run")
    parser.add_argument("--work", help="folder for the dense and llama.cpp-quantized files (default: temporary)")
    args = parser.parse_args()
    llama_cpp = llama_cpp_or_exit()
    cores = os.cpu_count() or 1

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}; llama-cpp-python {llama_cpp.__version__}")
    dense_folder = models.resolve(args.model)
    tokenizer = models.load(args.model).tokenizer
    windows = windows_of(tokenizer, "wikitext2", args.seqlen, args.windows).numpy()
    prompt = windows[0, :32].tolist()
    print(f"protocol: wikitext2 test, {args.windows} × {args.seqlen} tokens; decode {args.tokens} tokens greedy")
    print()
    print(
        f"| file | type | perplexity | increase over dense | size MB | tokens/s 1 thread | tokens/s {cores} threads |"
    )
    print("|---|---|---|---|---|---|---|")

    work = Path(args.work or tempfile.mkdtemp(prefix="bench-gguf-"))
    work.mkdir(parents=True, exist_ok=True)
    dense = work / "dense-f16.gguf"
    if not dense.exists():
        gguf_file.write(dense_folder, None, dense)
    rows = [("dense (ours, F16)", dense)]
    rows += [(f"llama.cpp's own {t.upper()}", work / f"llama-cpp-{t}.gguf") for t in ("q4_0", "q4_1")]
    for folder in args.exports:
        rows += [(f"ours: {Path(folder).name}", p) for p in sorted(Path(folder).glob("model-*.gguf"))]
    dense_ppl = None
    for name, path in rows:
        if name.startswith("llama.cpp") and not path.exists():
            ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0 if "q4_0" in path.name else llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1
            quantize(llama_cpp, dense, path, ftype)
        kind = path.stem.rsplit("-", 1)[-1].upper()
        ppl = perplexity(llama_cpp, path, windows, cores)
        dense_ppl = dense_ppl or ppl
        increase = f"+{ppl - dense_ppl:.3f}" if path != dense else "—"
        speeds = [decode_speed(llama_cpp, path, prompt, args.tokens, n) for n in (1, cores)]
        size = path.stat().st_size / 1e6
        print(
            f"| {name} | {kind} | {ppl:.3f} | {increase} | {size:.1f} | {speeds[0]:.1f} | {speeds[1]:.1f} |", flush=True
        )


if __name__ == "__main__":
    main()
