"""Perplexity, and fidelity to the uncompressed model, under one stated protocol.

Protocol: the text is tokenized without special tokens, cut into non-overlapping
windows of ``seqlen`` tokens, the first ``windows`` of them are scored, and
perplexity is exp(mean NLL over every predicted token). With a reference model,
the same windows give KL(reference ‖ model) per token and top-1 agreement —
perplexity alone hides damage.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from . import kvcache
from .data import DataError, describe_source, load_text, tokenize


@dataclass
class EvalResult:
    protocol: str
    ppl: float
    ref_ppl: float | None = None
    kl: float | None = None  # mean KL(reference ‖ model), nats per token
    top1: float | None = None  # share of positions where both models' argmax agree

    def as_dict(self):
        return asdict(self)


def windows_of(tokenizer, source: str, seqlen: int, windows: int) -> torch.Tensor:
    ids = tokenize(tokenizer, load_text(source, "test"))
    available = len(ids) // seqlen
    if available == 0:
        raise DataError(f"{source} has {len(ids)} tokens, fewer than one window of {seqlen}")
    if windows > available:
        raise DataError(f"{source} has only {available} windows of {seqlen} tokens; lower --windows")
    return ids[: windows * seqlen].reshape(windows, seqlen)


def _head(model):
    """The output head as a function of hidden states (Gemma's final logit soft-capping included)."""
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)

    def logits(hidden):
        out = head(hidden).float()
        return torch.tanh(out / cap) * cap if cap else out

    return logits, head.weight.shape[0]


class _Score:
    """Running sums for one model: NLL, and against the reference KL and top-1 agreement."""

    def __init__(self):
        self.nll = self.kl = 0.0
        self.agree = self.count = 0


def _score_windows(data, everyone: dict, heads: dict, scores: dict, progress: bool) -> None:
    for window in tqdm(data, desc="evaluating", unit="window", disable=not progress):
        hidden = {}
        for name, m in everyone.items():
            ids = window.unsqueeze(0).to(next(m.parameters()).device)
            hidden[name] = m.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        targets = window[1:]
        chunk = max(1, (1 << 26) // max(vocab for _, vocab in heads.values()))
        for start in range(0, len(targets), chunk):  # on the models' device: a window's logits are ~400 MB
            logps = {name: torch.log_softmax(heads[name][0](h[start : start + chunk]), -1)
                     for name, h in hidden.items()}
            ref = logps.get(_REF)
            for name, logp in logps.items():
                sc = scores[name]
                t = targets[start : start + chunk, None].to(logp.device)
                sc.nll -= logp.gather(1, t).sum().item()
                sc.count += t.shape[0]
                if ref is not None and name != _REF:
                    ref = ref.to(logp.device)
                    sc.kl += (ref.exp() * (ref - logp)).sum().item()
                    sc.agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()


@torch.no_grad()
def evaluate_many(models: dict, tokenizer, source: str = "wikitext2", seqlen: int = 2048, windows: int = 40,
                  reference=None, progress: bool = True, data: torch.Tensor | None = None) -> dict[str, EvalResult]:
    """Score several models on the same windows, running the reference once per window.

    Log-probabilities are formed a chunk of positions at a time, never as a whole
    (seqlen × vocab) tensor per model.
    """
    data = windows_of(tokenizer, source, seqlen, windows) if data is None else data
    everyone = dict(models, **({_REF: reference} if reference is not None else {}))
    scores = {name: _Score() for name in everyone}
    heads = {name: _head(m) for name, m in everyone.items()}
    with contextlib.ExitStack() as stack:
        for m in everyone.values():
            stack.enter_context(kvcache.simulating(m))  # a quantized KV cache, as a decoder would see it
        _score_windows(data, everyone, heads, scores, progress)
    protocol = f"{describe_source(source, 'test')}, {windows} × {seqlen} tokens"
    ref_ppl = math.exp(scores[_REF].nll / scores[_REF].count) if reference is not None else None
    out = {}
    for name in models:
        sc = scores[name]
        if reference is None:
            out[name] = EvalResult(protocol, math.exp(sc.nll / sc.count))
        else:
            out[name] = EvalResult(protocol, math.exp(sc.nll / sc.count), ref_ppl, sc.kl / sc.count,
                                   sc.agree / sc.count)
    return out


_REF = "\0reference"


def evaluate(model, tokenizer, source: str = "wikitext2", seqlen: int = 2048, windows: int = 40,
             reference=None, progress: bool = True, data: torch.Tensor | None = None) -> EvalResult:
    """``data`` (windows × seqlen ids from ``windows_of``) may be prepared early to fail before compute."""
    return evaluate_many({"model": model}, tokenizer, source, seqlen, windows, reference, progress, data)["model"]
