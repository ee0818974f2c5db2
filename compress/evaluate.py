"""Perplexity, and fidelity to the uncompressed model, under one stated protocol.

Protocol: the text is tokenized without special tokens, cut into non-overlapping
windows of ``seqlen`` tokens, the first ``windows`` of them are scored, and
perplexity is exp(mean NLL over every predicted token). With a reference model,
the same windows give KL(reference ‖ model) per token and top-1 agreement —
perplexity alone hides damage.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

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


def _log_probs(model, ids: torch.Tensor):
    """Yield float32 log-probabilities for chunks of positions, never the whole (L, vocab) at once."""
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    chunk = max(1, (1 << 26) // head.weight.shape[0])
    for start in range(0, hidden.shape[0] - 1, chunk):
        logits = head(hidden[start : min(start + chunk, hidden.shape[0] - 1)]).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        yield start, torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def evaluate(model, tokenizer, source: str = "wikitext2", seqlen: int = 2048, windows: int = 40,
             reference=None, progress: bool = True, data: torch.Tensor | None = None) -> EvalResult:
    """``data`` (windows × seqlen ids from ``windows_of``) may be prepared early to fail before compute."""
    data = windows_of(tokenizer, source, seqlen, windows) if data is None else data
    device = next(model.parameters()).device
    nll, ref_nll, kl, agree, count = 0.0, 0.0, 0.0, 0, 0
    for window in tqdm(data, desc="evaluating", unit="window", disable=not progress):
        ids = window.unsqueeze(0).to(device)
        targets = window[1:].to(device)
        ref_chunks = _log_probs(reference, ids) if reference is not None else None
        for start, logp in _log_probs(model, ids):
            t = targets[start : start + logp.shape[0]]
            nll -= logp.gather(1, t[:, None]).sum().item()
            if ref_chunks is not None:
                _, ref_logp = next(ref_chunks)
                ref_nll -= ref_logp.gather(1, t[:, None]).sum().item()
                kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
                agree += (ref_logp.argmax(-1) == logp.argmax(-1)).sum().item()
            count += logp.shape[0]
    protocol = f"{describe_source(source, 'test')}, {windows} × {seqlen} tokens"
    if reference is None:
        return EvalResult(protocol, math.exp(nll / count))
    return EvalResult(protocol, math.exp(nll / count), math.exp(ref_nll / count), kl / count, agree / count)
