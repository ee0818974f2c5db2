"""llama.cpp, through llama-cpp-python (the ``[llama]`` extra), as a second runtime for GGUF files:
its logits on our evaluation windows (``evaluate.evaluate_gguf``), its quantizer and its greedy
decoding speed (``scripts/bench_gguf.py``). Any GGUF can be scored so: ours, llama.cpp's own, or
one a user downloaded.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch


class LlamaCppError(RuntimeError):
    """llama-cpp-python is missing, or a file it cannot read."""


def module():
    try:
        import llama_cpp
    except ImportError:
        raise LlamaCppError(
            'scoring a GGUF file runs llama.cpp: pip install -e ".[llama]" (it compiles llama.cpp, ~10 minutes)'
        ) from None
    return llama_cpp


@contextlib.contextmanager
def opened(path: str | Path, n_ctx: int, threads: int | None = None, all_logits: bool = False):
    """The model in ``path`` loaded by llama.cpp (closed on exit), one sequence of ``n_ctx`` tokens."""
    llama_cpp = module()
    threads = threads or os.cpu_count() or 1
    try:
        llm = llama_cpp.Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=min(n_ctx, 512),
            logits_all=all_logits,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
    except ValueError as e:  # llama-cpp-python's error for a file llama.cpp cannot load
        raise LlamaCppError(f"llama.cpp cannot load {path}: {e}") from None
    try:
        yield llm
    finally:
        llm.close()


class WindowLogits:
    """llama.cpp's logits for each window of ``data`` (windows, seqlen): ``[w]`` is a (seqlen - 1,
    vocab) float32 tensor, the positions that predict tokens 1.. of window ``w``; computed when first
    asked for and kept until another window is (one window's logits at a time in memory)."""

    def __init__(self, llm, data: torch.Tensor):
        self.llm, self.data = llm, data
        self.vocab = llm.n_vocab()
        self.last: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, w: int) -> torch.Tensor:
        if self.last is None or self.last[0] != w:
            window = self.data[w].tolist()
            self.llm.reset()
            self.llm.eval(window)
            logits = np.asarray(self.llm.scores[: len(window) - 1], dtype=np.float32)
            self.last = (w, torch.from_numpy(logits.copy()))
        return self.last[1]
