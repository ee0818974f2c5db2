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

from . import kv_quant
from .arch import arch_of
from .data import DataError, describe_source, load_text, tokenize
from .lazy import StreamedModel, streamed
from .models import cast_params, compute_dtype
from .pipeline import capture_inputs


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


@torch.no_grad()
def final_hidden(
    model: StreamedModel, data: torch.Tensor, device: torch.device, progress: bool = True, desc: str = "evaluating"
) -> list[torch.Tensor]:
    """Each window's hidden states after the final norm (positions that predict a token), computed
    block by block over all windows: one block of the model is in memory at a time."""
    dtype = compute_dtype(device, model.dtype)
    arch = arch_of(model.model)
    with kv_quant.simulating(model.model):  # a quantized KV cache, as a decoder would see it
        hidden, calls = capture_inputs(model.model, data, device, dtype)
        for i in tqdm(range(len(model)), desc=desc, unit="block", disable=not progress):
            with model.block(i) as block:
                cast_params(block, device, dtype)
                args, kwargs = calls[i]
                for n, h in enumerate(hidden):
                    out = block(h, *args, **kwargs)
                    hidden[n] = out[0] if isinstance(out, tuple) else out
    norm = model.model.get_submodule(arch.norm)
    home = next(norm.parameters()).device, next(norm.parameters()).dtype
    cast_params(norm, device, dtype)
    try:
        return [norm(h)[0, :-1] for h in hidden]
    finally:
        cast_params(norm, *home)


def _score(data: torch.Tensor, hidden: dict[str, list[torch.Tensor]], heads: dict, scores: dict) -> None:
    for w, window in enumerate(data):
        targets = window[1:]
        chunk = max(1, (1 << 26) // max(vocab for _, vocab in heads.values()))
        for start in range(0, len(targets), chunk):  # a window's logits are ~400 MB: a chunk at a time
            logps = {
                name: torch.log_softmax(heads[name][0](h[w][start : start + chunk]), -1) for name, h in hidden.items()
            }
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


@contextlib.contextmanager
def _head_for_compute(model, device: torch.device):
    """The head (and what it is tied to) on ``device`` in the compute dtype while scoring."""
    head = model.get_output_embeddings()
    p = head.weight
    home = p.device, p.dtype
    cast_params(head, device, compute_dtype(device, p.dtype))
    try:
        yield
    finally:
        cast_params(head, *home)


@torch.no_grad()
def evaluate_many(
    models: dict,
    tokenizer,
    source: str = "wikitext2",
    seqlen: int = 2048,
    windows: int = 40,
    reference=None,
    progress: bool = True,
    data: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> dict[str, EvalResult]:
    """Score several models on the same windows.

    Models are ``StreamedModel``s (read a block at a time) or whole transformers models; each
    runs block by block over all windows, so only its current block is in memory, with one
    set of hidden states per model. Log-probabilities are formed a chunk of positions at a
    time, never as a whole (seqlen × vocab) tensor. ``device``: where blocks compute (default:
    where the first model's embeddings are).
    """
    data = windows_of(tokenizer, source, seqlen, windows) if data is None else data
    everyone = {name: streamed(m) for name, m in models.items()}
    if reference is not None:
        everyone[_REF] = streamed(reference)
    if device is None:
        device = next(iter(everyone.values())).model.get_input_embeddings().weight.device
    scores = {name: _Score() for name in everyone}
    hidden = {
        name: final_hidden(m, data, device, progress, f"evaluating {'reference' if name == _REF else name}")
        for name, m in everyone.items()
    }
    heads = {name: _head(m.model) for name, m in everyone.items()}
    with contextlib.ExitStack() as stack:
        for m in everyone.values():
            stack.enter_context(_head_for_compute(m.model, device))
        _score(data, hidden, heads, scores)
    protocol = f"{describe_source(source, 'test')}, {windows} × {seqlen} tokens"
    ref_ppl = math.exp(scores[_REF].nll / scores[_REF].count) if reference is not None else None
    out = {}
    for name in models:
        sc = scores[name]
        if reference is None:
            out[name] = EvalResult(protocol, math.exp(sc.nll / sc.count))
        else:
            out[name] = EvalResult(
                protocol, math.exp(sc.nll / sc.count), ref_ppl, sc.kl / sc.count, sc.agree / sc.count
            )
    return out


_REF = "\0reference"


def evaluate(
    model,
    tokenizer,
    source: str = "wikitext2",
    seqlen: int = 2048,
    windows: int = 40,
    reference=None,
    progress: bool = True,
    data: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> EvalResult:
    """``data`` (windows × seqlen ids from ``windows_of``) may be prepared early to fail before compute."""
    return evaluate_many({"model": model}, tokenizer, source, seqlen, windows, reference, progress, data, device)[
        "model"
    ]
