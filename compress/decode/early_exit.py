"""Confidence-based early exit for greedy decoding (CALM, Schuster et al. 2022). Lossy.

At each exit layer the token's confidence is measured: ``softmax`` (the top probability of
the final norm + lm_head applied to the hidden state) or ``saturation`` (cosine similarity of
the hidden state before and after the layer, which needs no lm_head). Once it reaches the
threshold the token is emitted from that layer. Later tokens still attend to every layer:
each skipped layer runs its attention on the exit state (CALM's state propagation), which
writes that layer's K/V to the cache; only its MLP is skipped (on the decode engine a skipped
layer computes only its keys and values: the attention's output is unused). ``calibrate`` picks the
threshold that keeps top-1 agreement with the full model above a target on calibration text.

Llama-style blocks (llama, qwen2/3, mistral) and Gemma-3 (rotary tables per layer type; its
sliding layers need no mask for one new token, as the cache keeps only the window).
As a lossless proposer, the same idea is early-exit drafting: ``decode.layer_subset``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..data import calibration_batches
from .loop import DecodeError, DecodeResult, device_of, sync, with_cache

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")
Measure = Literal["softmax", "saturation"]


def _check(model) -> None:
    if model.config.model_type not in SUPPORTED:
        raise DecodeError(f"early exit supports {', '.join(SUPPORTED)} blocks, not {model.config.model_type}")


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(model.model.norm(hidden)).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _rotary(inner, hidden: torch.Tensor, position: torch.Tensor) -> list:
    """Each layer's rotary (cos, sin): Gemma-3 keeps one table per layer type (local, global)."""
    if "layer_type" in inspect.signature(inner.rotary_emb.forward).parameters:
        types = inner.config.layer_types
        table = {t: inner.rotary_emb(hidden, position, t) for t in set(types)}
        return [table[t] for t in types]
    return [inner.rotary_emb(hidden, position_ids=position)] * len(inner.layers)


def _confidence(to_logits, before: torch.Tensor, after: torch.Tensor, measure: Measure) -> torch.Tensor:
    if measure == "softmax":
        return torch.softmax(to_logits(after), -1).amax(-1)
    return F.cosine_similarity(before.float(), after.float(), dim=-1)


def default_exits(count: int) -> list[int]:
    """Exit points at half and three quarters of the depth (each softmax check costs an lm_head)."""
    return sorted({count // 2 - 1, (3 * count) // 4 - 1})


@torch.no_grad()
def early_exit_greedy(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    threshold: float,
    exits: list[int],
    measure: Measure = "softmax",
    eos: set[int] = frozenset(),
    cache=None,
) -> DecodeResult:
    """Greedy decoding that leaves a token's forward at the first exit layer where it is confident.

    ``model``: a transformers model, or an ``Engine`` (our forward: a skipped layer computes
    only its keys and values). ``extra["mean_layers"]``: layers run in full per generated token,
    on average.
    """
    on_engine = hasattr(model, "crop") and hasattr(model, "exited")
    if not on_engine:
        _check(model)
    elif cache is not None:
        raise DecodeError("the engine keeps its own cache: pass no cache with an engine")
    start = time.perf_counter()
    count = model.layer_count if on_engine else len(model.model.layers)
    exits = {i for i in exits if 0 <= i < count - 1}
    if on_engine:
        model.reset()
        logits = model.forward(prompt, all_logits=False)[-1]

        def confident(i, before, after):
            return i in exits and _confidence(model.logits, before, after, measure).item() >= threshold

        def step(token):
            out = model.forward([token], exit_when=confident)[-1]
            return out, count if model.exited is None else model.exited + 1
    else:
        cache = cache if cache is not None else DynamicCache(config=model.config)
        logits = (
            model(input_ids=prompt, **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits[0, -1].float()
        )

        def step(token):
            return _transformers_step(model, cache, token, exits, threshold, measure)

    tokens, depths = [], []
    while True:
        token = int(logits.argmax())
        tokens.append(token)
        if token in eos or len(tokens) >= max_new_tokens:
            break
        logits, depth = step(token)
        depths.append(depth)
    sync(model.device)
    result = DecodeResult(tokens, len(tokens), time.perf_counter() - start)
    result.extra["mean_layers"] = sum(depths) / max(1, len(depths))
    return result


def _transformers_step(model, cache, token: int, exits: set[int], threshold: float, measure: Measure):
    """One token through transformers' layers with early exit: (logits, layers run in full)."""
    device, inner, layers = device_of(model), model.model, model.model.layers
    position = torch.tensor([[cache.get_seq_length()]], device=device)
    hidden = inner.embed_tokens(torch.tensor([[token]], device=device))
    rotary = _rotary(inner, hidden, position)
    exited = None
    for i, layer in enumerate(layers):
        kw = dict(
            attention_mask=None,
            position_ids=position,
            **with_cache(layer, cache),
            use_cache=True,
            position_embeddings=rotary[i],
        )
        if exited is not None:  # only the attention, on the exit state: the cache stays complete
            layer.self_attn(hidden_states=layer.input_layernorm(hidden), **kw)
            continue
        before, hidden = hidden, layer(hidden, **kw)
        if i in exits and _confidence(functools.partial(_logits, model), before, hidden, measure).item() >= threshold:
            exited = i
    return _logits(model, hidden)[0, -1], len(layers) if exited is None else exited + 1


@torch.no_grad()
def calibrate(model, ids: torch.Tensor, exits: list[int], measure: Measure = "softmax", target: float = 0.9) -> dict:
    """The lowest threshold whose simulated exits agree with the full model's top-1 on at least
    ``target`` of the tokens of ``ids`` (rows of calibration text), with what it saves.

    The simulation reads each layer's hidden states from one full forward, so skipped layers'
    K/V are the full model's: decoding sees slightly worse states, hence a margin in ``target``.
    """
    _check(model)
    ids = ids.to(device_of(model))
    out = model(input_ids=ids, output_hidden_states=True)
    final = out.logits.argmax(-1)
    states, count = out.hidden_states, len(model.model.layers)  # states[i + 1] leaves layer i
    exits = sorted(i for i in exits if 0 <= i < count - 1)
    to_logits = functools.partial(_logits, model)
    conf = torch.stack([_confidence(to_logits, states[i], states[i + 1], measure) for i in exits])
    agree = torch.stack([_logits(model, states[i + 1]).argmax(-1) == final for i in exits])
    best = {"threshold": float("inf"), "agreement": 1.0, "mean_layers": float(count)}
    grid = torch.linspace(0.5, 1.0, 51).tolist() if measure == "softmax" else torch.linspace(0.9, 1.0, 101).tolist()
    for t in sorted(grid, reverse=True):
        leaves = conf >= t
        first = torch.where(leaves.any(0), leaves.float().argmax(0), -1)  # index into exits, -1: no exit
        agreement = torch.where(first >= 0, agree.gather(0, first.clamp(min=0).unsqueeze(0))[0], True)
        depth = torch.where(first >= 0, torch.tensor(exits, device=first.device)[first.clamp(min=0)] + 1, count)
        if agreement.float().mean() < target:
            break
        best = {
            "threshold": t,
            "agreement": agreement.float().mean().item(),
            "mean_layers": depth.float().mean().item(),
        }
    return best


def calibrated_threshold(model, tokenizer, exits: list[int], measure: Measure, agreement: float = 0.9) -> float:
    """The threshold whose exits keep ``agreement`` top-1 agreement with the whole model on two
    wikitext calibration windows (CALM calibrates on held-out text); says what it found on stderr."""
    ids, _ = calibration_batches(model, tokenizer, "wikitext2", 2, 256, seed=0)
    found = calibrate(model, ids, exits, measure, target=agreement)
    print(
        f"[early exit: {measure} threshold {found['threshold']:.3f} at layers {exits} keeps "
        f"{found['agreement']:.1%} top-1 agreement on calibration text, {found['mean_layers']:.1f} layers per "
        "token on average]",
        file=sys.stderr,
    )
    return found["threshold"]
