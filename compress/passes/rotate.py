"""Rotations fused into the weights (QuaRot, Ashkboos et al. 2024): the same function, fewer outliers.

A few channels of the residual stream carry values far larger than the rest, and they set the
scale of every group they fall in. Multiplying the stream by an orthonormal matrix ``R1`` spreads
them over all channels; the model computes the same if every linear that reads the stream reads
``x R1`` (``W ← W R1``), every linear that writes it writes ``y R1`` (``W ← R1ᵀ W``), the
embedding holds ``E R1`` and the head ``H R1``. RMSNorm commutes with ``R1`` once its weight is
folded into the linears after it (``W ← W diag(w)``, the norm's weight then 1), since a rotation
keeps a vector's norm. ``values`` rotates each attention head's values by ``R2`` (``v_proj``'s
rows, ``o_proj``'s columns per head), which the attention's weighted sum carries through.

``R`` is ``compress.hadamard``'s matrix (``hadamard``), or that matrix with seeded random signs on
its rows (``random_hadamard``: ``diag(±1) H``, QuaRot's choice). Nothing is added at run time:
the export is a plain model (with its own head where the embedding was tied: the head holds
``H diag(w_final) R1``, the embedding ``E R1``).

``down: true`` adds QuaRot's one online rotation, ``R4``: ``down_proj``'s input (the product of
the gate and up projections, whose outliers no fused rotation reaches) is rotated at run time by
a Hadamard matrix on blocks of the largest power of two dividing its width
(``hadamard.InputRotation``), and ``down_proj``'s weight holds ``W R4``. It is what 4-bit
activations need; an export names it as compressed-tensors' ``hadamard`` transform (vLLM applies
it; our reader and decoder do too, transformers does not). Passes that fold scales between
``up_proj`` and ``down_proj`` (``awq``, ``smoothquant``) cannot follow it.

Every block is rotated as it is read (``StreamedModel.on_read``), so everything that reads a
block sees the rotated model: the later passes' statistics, the allocation's costs, the block
GPTAQ compares with, a resumed run. ``rotate`` is therefore the recipe's first pass, and does
nothing in the sweep itself.

Not yet: online rotations of queries and keys (before a quantized KV cache), learned rotations
(SpinQuant), Gemma-3's residual stream (each block's output passes a norm with its own weight
before it is added to the stream, so no rotation of the stream can be folded into the weights;
its values and ``down_proj``'s input rotate), mixture-of-experts blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from .. import hadamard, moe
from ..arch import arch_of, decoder_layers
from .base import LayerPass, PassOptions, RecipeError

if TYPE_CHECKING:
    from ..lazy import StreamedModel

RESIDUAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # norms before each linear group, none after
VALUES_FAMILIES = (*RESIDUAL_FAMILIES, "gemma3_text", "gemma3")
FOLDS_INTO_DOWN = ("awq", "smoothquant")  # scale up_proj's output rows and down_proj's input columns


class RotateOptions(PassOptions):
    kind: Literal["hadamard", "random_hadamard"] = "hadamard"
    residual: bool = True  # R1: the residual stream, through embedding, every block and the head
    values: bool = True  # R2: each attention head's values, between v_proj and o_proj
    down: bool = False  # R4: down_proj's input, online (a fast Walsh-Hadamard transform at run time)
    seed: int = 0  # random_hadamard's signs


class Rotate(LayerPass):
    name = "rotate"
    Options = RotateOptions
    needs_data = False

    def order_problem(self, before, after):
        if before:
            return f"rotates the model every other pass sees, so it must come first ({before[0].where} is before it)"
        if not (self.options.residual or self.options.values or self.options.down):
            return "rotates nothing: give residual: true, values: true, down: true or several"
        folds = [p for p in after if p.name in FOLDS_INTO_DOWN]
        if self.options.down and folds:
            return (
                f"down: true rotates down_proj's input online, where {folds[0].where} would fold its scales "
                "into up_proj; drop down: true or that pass"
            )
        return None

    def check(self, model: torch.nn.Module) -> None:
        config = model.config
        family = config.model_type
        families = RESIDUAL_FAMILIES if self.options.residual else VALUES_FAMILIES  # R4: as R2, inside a block
        if family not in families:
            why = (
                "each of its blocks normalizes its output with a weight of its own before adding it to the residual "
                "stream, so a rotation of the stream cannot be folded into its weights; use residual: false"
                if family in VALUES_FAMILIES
                else f"it rotates {', '.join(families)} models"
            )
            raise RecipeError(f"{self.where}: model_type {family!r} cannot be rotated here: {why}")
        if any(moe.experts_of(block) for block in decoder_layers(model)):
            raise RecipeError(f"{self.where}: mixture-of-experts blocks are not rotated yet")
        self.arch = arch_of(model)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        widths = ([("hidden size", config.hidden_size)] if self.options.residual else []) + (
            [("head dimension", self.head_dim)] if self.options.values else []
        )
        for what, n in widths:
            try:
                self._matrix(n)
            except ValueError as e:
                raise RecipeError(f"{self.where}: the {what}: {e}") from None
        if self.options.down and hadamard.block_size(config.intermediate_size) < 2:
            width = config.intermediate_size
            raise RecipeError(
                f"{self.where}: down_proj's input width {width} is odd: no Hadamard block; drop down: true"
            )

    def _matrix(self, n: int) -> torch.Tensor:
        r = hadamard.matrix(n, torch.float64)
        if self.options.kind == "random_hadamard":
            r = hadamard.random_signs(n, self.options.seed).double()[:, None] * r
        return r

    @torch.no_grad()
    def prepare(self, model: StreamedModel) -> None:
        """Rotate what is in memory (embedding, final norm, head, and every block held whole) and
        have every block read later rotated as it is read."""
        if getattr(model.model, "_compress_rotated", False):  # prepared already (apply, then the sweep)
            return
        model.model._compress_rotated = True
        self.r1 = self._matrix(model.config.hidden_size) if self.options.residual else None
        self.r2 = self._matrix(self.head_dim) if self.options.values else None
        self.r4 = hadamard.block_matrix(model.config.intermediate_size, torch.float64) if self.options.down else None
        if self.r1 is not None:
            self._rotate_ends(model.model)
        for i in sorted(model.resident):
            self.rotate_block(model.layers[i])
        model.on_read = self.rotate_block

    def _rotate_ends(self, model: torch.nn.Module) -> None:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        norm = model.get_submodule(self.arch.norm)
        head_weight = head.weight.double() * norm.weight.double()[None, :]  # the final norm folded in
        norm.weight.data.fill_(1)
        embedding.weight.data = _to(embedding.weight.double() @ self.r1, embedding.weight)
        head.weight = torch.nn.Parameter(_to(head_weight @ self.r1, head.weight), requires_grad=False)
        model.config.tie_word_embeddings = False  # the head is H diag(w) R1, the embedding E R1
        if getattr(model.config, "get_text_config", None) is not None:
            model.config.get_text_config().tie_word_embeddings = False

    def rotate_block(self, block: torch.nn.Module) -> None:
        """One block as it is read: norms folded into the linears after them, then R2 and R1."""
        with torch.no_grad():
            if self.r2 is not None:
                self._rotate_values(block)
            if self.r1 is not None:
                self._rotate_residual(block)
            if self.r4 is not None:
                down = self._down(block)
                down.weight.data = _to(down.weight.double() @ self.r4, down.weight)
                hadamard.InputRotation().attach(down)  # its hook once, however often the block is read

    def _down(self, block: torch.nn.Module) -> torch.nn.Linear:
        """The linear that reads the MLP's product: the writer of the scaling other than the values'."""
        (s,) = [
            s
            for s in self.arch.scalings
            if s.prev != "self_attn.v_proj" and isinstance(block.get_submodule(s.prev), torch.nn.Linear)
        ]
        return block.get_submodule(s.linears[0])

    def _rotate_residual(self, block: torch.nn.Module) -> None:
        for s in self.arch.scalings:
            prev = block.get_submodule(s.prev)
            if isinstance(prev, torch.nn.Linear):  # v -> o, up -> down: o and down write the stream
                writer = block.get_submodule(s.linears[0])
                writer.weight.data = _to(self.r1.T @ writer.weight.double(), writer.weight)
                if writer.bias is not None:
                    writer.bias.data = _to(writer.bias.double() @ self.r1, writer.bias)
                continue
            w = prev.weight.double()  # a norm read by ``s.linears``: fold its weight, then rotate their inputs
            prev.weight.data.fill_(1)
            for name in s.linears:
                lin = block.get_submodule(name)
                lin.weight.data = _to((lin.weight.double() * w[None, :]) @ self.r1, lin.weight)

    def _rotate_values(self, block: torch.nn.Module) -> None:
        v, o = block.get_submodule("self_attn.v_proj"), block.get_submodule("self_attn.o_proj")
        d, r2 = self.head_dim, self.r2
        rows = v.weight.double().reshape(-1, d, v.in_features)  # per key-value head: v_h ← v_h R2
        v.weight.data = _to((r2.T @ rows).reshape(v.weight.shape), v.weight)
        if v.bias is not None:
            v.bias.data = _to((v.bias.double().reshape(-1, d) @ r2).reshape(-1), v.bias)
        cols = o.weight.double().reshape(o.out_features, -1, d)  # o reads every head's values rotated
        o.weight.data = _to((cols @ r2).reshape(o.weight.shape), o.weight)

    def apply(self, block, data, prefix: str) -> None:
        """Nothing: the block was rotated as it was read (``prepare``)."""

    def summary(self) -> str:
        o = self.options
        parts = [
            p for p, on in (("residual", o.residual), ("values", o.values), ("down_proj input, online", o.down)) if on
        ]
        return f"rotate {self.options.kind.replace('_', ' ')} ({' and '.join(parts)})"


def _to(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return value.to(like.dtype)
