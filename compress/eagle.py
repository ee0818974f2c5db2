"""EAGLE draft heads: one decoder layer that reads the target's own states and predicts its next one.

EAGLE (Li et al. 2024) drafts at the level of features, not tokens: the head takes the target's
final-normed state at position t and the embedding of the token at t + 1, and predicts the
target's state at t + 1; the target's own lm_head turns that into the logits of the token at
t + 2. Features are far more predictable than tokens, and the head is one layer, so a draft token
costs a few percent of a target step. The layout is EAGLE-1's, as vLLM reads it: ``fc`` (a
linear from the concatenated embedding and state, 2H -> H, no bias), then ``layers.0``, a Llama
decoder layer without its input norm, and no final norm. The head has its own standard rotary
embedding (the target's width and heads, a Llama layer whatever the target's family).

The head proposes only tokens of a reduced vocabulary (``draft_tokens``: the ones most frequent in
its training text, as EAGLE-3 and FR-Spec do): its logits are the target lm_head's rows for
those tokens, so a draft token reads ``draft_vocab × H`` of the head instead of the whole
vocabulary. A token outside it is never proposed, which costs acceptance, never correctness.

It is trained on the *compressed* target's states (the target it will draft for), on the
calibration text: a smooth-L1 regression of the next state plus the cross-entropy of the next
token's distribution through the lm_head (EAGLE's two losses; ``train_head``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kv_quant import rotate
from .state import State


@dataclass(frozen=True)
class HeadConfig:
    """The head's shape, and what it was trained for (a head drafts only for a target of this width
    and vocabulary)."""

    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @classmethod
    def for_target(cls, config, draft_vocab: int) -> HeadConfig:
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            draft_vocab=min(draft_vocab, config.vocab_size),
            eps=getattr(config, "rms_norm_eps", 1e-6),
        )

    def problem(self, config) -> str | None:
        """Why this head cannot draft for a target of ``config``, or None."""
        if config.hidden_size != self.hidden_size:
            return f"hidden size {self.hidden_size}, the target's is {config.hidden_size}"
        if config.vocab_size != self.vocab_size:
            return f"a vocabulary of {self.vocab_size}, the target's is {config.vocab_size}"
        return None

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _Layer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), _MLP(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.eps)


class HeadCache:
    """The head's keys and values, (kv_heads, length, head_dim) each; ``crop`` keeps a prefix."""

    def __init__(self):
        self.k = self.v = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        self.v = v if self.v is None else torch.cat([self.v, v], 1)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :length], self.v[:, :length]


class EagleHead(nn.Module):
    """``forward(embeds, features, positions)``: the predicted next states, (T, H) for (T, H) rows."""

    def __init__(self, config: HeadConfig, draft_tokens: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Layer(config)])
        tokens = torch.arange(config.draft_vocab) if draft_tokens is None else draft_tokens
        if tokens.shape != (config.draft_vocab,):
            raise ValueError(f"draft_tokens holds {tuple(tokens.shape)} ids; the config says {config.draft_vocab}")
        self.register_buffer("draft_tokens", tokens.long())
        half = config.head_dim // 2
        self.register_buffer(
            "inv_freq", 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float32) / half), persistent=False
        )

    def initialize(self, generator: torch.Generator) -> None:
        """The head starts by predicting "the next state is this one": ``fc`` passes the state
        through and the layer's output projections are zero, so training moves away from a
        sensible guess instead of from noise."""
        h = self.config.hidden_size
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight"):
                continue
            with torch.no_grad():
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=generator)
        with torch.no_grad():
            self.fc.weight[:, :h] *= 0.1
            self.fc.weight[:, h:] = torch.eye(h)
            self.layers[0].self_attn.o_proj.weight.zero_()
            self.layers[0].mlp.down_proj.weight.zero_()

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows are pairs (embedding of token t + 1, state at t) at ``positions`` t; with ``cache``
        they follow its rows (drafting), else they are one causal sequence (training). ``allowed``
        (rows, cached rows + rows): which rows each attends to, in place of causal order (a tree's
        nodes see their ancestors only)."""
        c, layer = self.config, self.layers[0]
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([embeds.to(dtype), features.to(dtype)], -1))
        count = x.shape[0]
        a = layer.self_attn
        q = a.q_proj(x).view(count, c.heads, c.head_dim).transpose(0, 1)
        k = a.k_proj(x).view(count, c.kv_heads, c.head_dim).transpose(0, 1)
        v = a.v_proj(x).view(count, c.kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = self.rotary(positions)
        q, k = rotate(q, cos.to(dtype), sin.to(dtype)), rotate(k, cos.to(dtype), sin.to(dtype))
        if cache is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            past = cache.length
            keys, values = cache.append(k, v)
            if allowed is None:
                allowed = (
                    torch.arange(past + count, device=x.device)[None]
                    <= past + torch.arange(count, device=x.device)[:, None]
                )
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, enable_gqa=True)
        x = x + a.o_proj(attn.transpose(0, 1).reshape(count, -1))
        h = layer.post_attention_layernorm(x)
        m = layer.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class EagleState(State, attr="eagle_head"):
    """A trained head on the model it drafts for (the ``eagle`` pass leaves it; the export writes it
    beside the model, ``formats.eagle_head``)."""

    holds_tensors = False  # it sits on the model's root, which no block's freeing touches

    def __init__(self, head: EagleHead, log: dict):
        self.head, self.log = head, log


def target_features(model, sequences) -> list[torch.Tensor]:
    """The target's final-normed states on each sequence of token ids -> (T, H) float32 each: what
    the head reads and predicts (the input of the lm_head, taken from the final norm's output)."""
    from .arch import arch_of

    out = []
    norm = model.get_submodule(arch_of(model).norm)
    handle = norm.register_forward_hook(lambda _m, _i, o: out.append(o.detach().float().cpu()[0]))
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            for ids in sequences:
                model(input_ids=ids.reshape(1, -1).to(device), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return out


def frequent_tokens(sequences, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` most frequent token ids of the sequences (ties by id), sorted by id."""
    counts = torch.bincount(torch.cat([s.reshape(-1) for s in sequences]), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.double) / (2 * vocab_size)  # ties: the lower id first
    return counts.topk(count).indices.sort().values


def head_logits(features: torch.Tensor, rows: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logits over the draft vocabulary: ``rows`` are the lm_head's rows of its tokens."""
    logits = features.to(rows.dtype) @ rows.T
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def loss(head: EagleHead, embeds, features, rows, softcap, class_weight: float) -> torch.Tensor:
    """EAGLE's loss on one sequence: (T, H) embeddings and target states. Pair t (state t, token
    t + 1) predicts state t + 1: smooth L1 against it, plus ``class_weight`` × the cross-entropy of
    the next token's distribution (the target's, over the draft vocabulary)."""
    predicted = head(embeds[1:], features[:-1], torch.arange(len(features) - 1, device=features.device))
    truth = features[1:]
    regression = F.smooth_l1_loss(predicted, truth)
    target = torch.softmax(head_logits(truth, rows, softcap), -1)
    return (
        regression
        + class_weight * -(target * torch.log_softmax(head_logits(predicted, rows, softcap), -1)).sum(-1).mean()
    )


def train_head(
    model,
    sequences,
    steps: int,
    lr: float,
    batch: int,
    draft_vocab: int,
    class_weight: float = 0.1,
    seed: int = 0,
    progress: bool = True,
) -> tuple[EagleHead, dict]:
    """A head for ``model`` trained on its own states over ``sequences`` of token ids (the rows of
    the calibration ids, and replies the model wrote)."""
    from .recovery import train

    sequences = [s.reshape(-1) for s in sequences if s.numel() > 2]
    device = next(model.parameters()).device
    features = target_features(model, sequences)
    config = HeadConfig.for_target(model.config, draft_vocab)
    head = EagleHead(config, frequent_tokens(sequences, config.vocab_size, config.draft_vocab))
    generator = torch.Generator().manual_seed(seed)
    head.initialize(generator)
    head.to(device)
    rows = model.get_output_embeddings().weight.detach().float()[head.draft_tokens]
    embeds = model.get_input_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    with torch.no_grad():
        embedded = [embeds(s.to(device)).float().cpu() for s in sequences]

    def loss_of(_step: int) -> torch.Tensor:
        chosen = torch.randint(len(sequences), (batch,), generator=generator).tolist()
        return (
            sum(loss(head, embedded[i].to(device), features[i].to(device), rows, softcap, class_weight) for i in chosen)
            / batch
        )

    log = train(_Params(head), loss_of, steps, lr, lr, "eagle head", progress=progress)
    head.eval().requires_grad_(False).cpu()
    log["tokens"] = sum(s.numel() for s in sequences)
    return head, log


class _Params:
    """The head's parameters as ``recovery.train`` takes them (one group, one learning rate)."""

    def __init__(self, head: nn.Module):
        self.head = head

    def param_groups(self, lr: float, _weight_lr: float) -> list[dict]:
        return [{"params": [p for p in self.head.parameters() if p.requires_grad], "lr": lr}]
