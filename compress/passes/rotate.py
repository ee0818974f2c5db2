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
its rows (``random_hadamard``: ``diag(±1) H``, QuaRot's choice), or rotations trained from that
start against the rounding the later passes do (``learned``: SpinQuant, in
``compress.learned_rotation``; ``fit`` trains them on the calibration samples before the sweep,
with an ``R2`` per layer). Nothing is added at run time: the export is a plain model (with its
own head where the embedding was tied: the head holds ``H diag(w_final) R1``, the embedding ``E R1``).

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

QuaRot's online rotation of queries and keys (``R3``, before a quantized KV cache) belongs to the
cache: ``kv_cache: {rotate_keys: true}`` rounds each head's keys in a Hadamard basis. Not yet:
Gemma-3's residual stream (each block's output passes a norm with its own weight before it is added
to the stream, so no rotation of the stream can be folded into the weights; its values and
``down_proj``'s input rotate), mixture-of-experts blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, model_validator

from .. import hadamard, moe
from ..arch import arch_of, decoder_layers
from .base import LayerPass, PassOptions, RecipeError

if TYPE_CHECKING:
    from ..lazy import StreamedModel

RESIDUAL_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # norms before each linear group, none after
VALUES_FAMILIES = (*RESIDUAL_FAMILIES, "gemma3_text", "gemma3")
FOLDS_INTO_DOWN = ("awq", "smoothquant")  # scale up_proj's output rows and down_proj's input columns


class RotateOptions(PassOptions):
    kind: Literal["hadamard", "random_hadamard", "learned"] = "hadamard"
    residual: bool = True  # R1: the residual stream, through embedding, every block and the head
    values: bool = True  # R2: each attention head's values, between v_proj and o_proj
    down: bool = False  # R4: down_proj's input, online (a fast Walsh-Hadamard transform at run time)
    seed: int = 0  # random_hadamard's signs, and learned's start and sample order
    steps: int | None = Field(None, gt=0)  # learned: optimizer steps, one calibration sample each (default 100)
    lr: float | None = Field(None, gt=0)  # learned: the Cayley step's largest size (default 0.2), decaying to 0

    @model_validator(mode="after")
    def _learning(self):
        if self.kind != "learned" and (self.steps is not None or self.lr is not None):
            raise ValueError("steps and lr are options of kind: learned")
        return self


class Rotate(LayerPass):
    name = "rotate"
    Options = RotateOptions

    def __init__(self, options: RotateOptions, where: str):
        super().__init__(options, where)
        self.learned = options.kind == "learned"
        self.needs_data = self.learned  # trained on the calibration samples
        self.data_parallel = not self.learned  # one process trains
        self.whole_model = self.learned  # trained through every block at once
        self.r1 = self.r2 = self.r4 = None
        self.fitted = not self.learned
        self._index: dict[int, int] = {}

    def order_problem(self, before, after):
        if before:
            return f"rotates the model every other pass sees, so it must come first ({before[0].where} is before it)"
        if not (self.options.residual or self.options.values or self.options.down):
            return "rotates nothing: give residual: true, values: true, down: true or several"
        if self.learned and not any(p.rounding is not None and hasattr(p, "scheme_for") for p in after):
            return "kind: learned trains against the weight quantizer after it; put a quantization pass after it"
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
        if self.options.kind != "hadamard":  # random_hadamard, and where learned rotations start
            r = hadamard.random_signs(n, self.options.seed).double()[:, None] * r
        return r

    def _matrices(self, config) -> None:
        """The rotations, once: every model this pass prepares (the student, a teacher) gets the same."""
        if self.r1 is None and self.r2 is None and self.r4 is None:
            self.r1 = self._matrix(config.hidden_size) if self.options.residual else None
            self.r2 = self._matrix(self.head_dim) if self.options.values else None
            self.r4 = hadamard.block_matrix(config.intermediate_size, torch.float64) if self.options.down else None

    def prepare(self, model: StreamedModel) -> None:
        """Rotate what is in memory (embedding, final norm, head, and every block held whole) and
        have every block read later rotated as it is read. Learned rotations wait for ``fit``."""
        if self.fitted:
            self._install(model)

    def fit(self, model: StreamedModel, ids: torch.Tensor, passes: list[LayerPass], device: torch.device) -> None:
        """``learned``: train the rotations on the calibration samples against the quantizers of the
        passes after this one (``compress.learned_rotation``), then rotate the model with them."""
        if self.fitted:
            return
        from ..learned_rotation import learn

        self._matrices(model.config)
        r2 = None if self.r2 is None else [self.r2.clone() for _ in range(len(model))]  # one per layer
        o = self.options
        self.r1, self.r2, self.learning = learn(
            model.load_all(),
            ids,
            self,
            passes[passes.index(self) + 1 :],
            self.r1,
            r2,
            device,
            steps=o.steps or 100,
            lr=o.lr or 0.2,
            seed=o.seed,
        )
        self.fitted = True
        self._install(model)

    @torch.no_grad()
    def _install(self, model: StreamedModel) -> None:
        if getattr(model.model, "_compress_rotated", False):  # prepared already (apply, then the sweep)
            return
        model.model._compress_rotated = True
        self._matrices(model.config)
        self._index.update({id(block): i for i, block in enumerate(model.layers)})  # learned R2: one per layer
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
        """One block as it is read: norms folded into the linears after them, then R2, R1 and R4."""
        r2 = self.r2 if not isinstance(self.r2, list) else self.r2[self._index[id(block)]]
        with torch.no_grad():
            for name, value in rotated_parameters(block, self.arch, self.head_dim, self.r1, r2, self.r4).items():
                param = block.get_parameter(name)
                param.data = value.to(param.dtype)
            if self.r4 is not None:
                hadamard.InputRotation().attach(down_of(block, self.arch))  # its hook once, however often read

    def apply(self, block, data, prefix: str) -> None:
        """Nothing: the block was rotated as it was read (``prepare``)."""
        if not self.fitted:
            raise RuntimeError(f"{self.where}: learned rotations are trained by fit() before the sweep")
        self.log.update(getattr(self, "learning", {}))  # the sweep starts every pass's log afresh

    def summary(self) -> str:
        o = self.options
        parts = [
            p for p, on in (("residual", o.residual), ("values", o.values), ("down_proj input, online", o.down)) if on
        ]
        return f"rotate {self.options.kind.replace('_', ' ')} ({' and '.join(parts)})"


def down_of(block: torch.nn.Module, arch) -> torch.nn.Linear:
    """The linear that reads the MLP's product: the writer of the scaling other than the values'."""
    (s,) = [
        s
        for s in arch.scalings
        if s.prev != "self_attn.v_proj" and isinstance(block.get_submodule(s.prev), torch.nn.Linear)
    ]
    return block.get_submodule(s.linears[0])


def rotated_parameters(block: torch.nn.Module, arch, head_dim: int, r1, r2, r4) -> dict[str, torch.Tensor]:
    """The parameters of ``block`` that the rotations change, by name, as new tensors in the rotations'
    dtype (differentiable in them: ``learned`` trains through this): R2 on each head's values
    (``v_proj``'s rows, ``o_proj``'s columns per head), then each norm folded into the linears
    that read it and R1 on the stream (readers ``W R1``, writers ``R1ᵀ W``), then ``W R4`` for
    ``down_proj``. A rotation that is None is left out."""
    dtype = next(r for r in (r1, r2, r4) if r is not None).dtype
    out: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        return out[name] if name in out else block.get_parameter(name).to(dtype)

    def has(name: str) -> bool:
        return getattr(block.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1], None) is not None

    if r2 is not None:
        v, o = "self_attn.v_proj", "self_attn.o_proj"
        w = get(f"{v}.weight")
        out[f"{v}.weight"] = (r2.T @ w.reshape(-1, head_dim, w.shape[1])).reshape(w.shape)  # v_h ← v_h R2
        if has(f"{v}.bias"):
            out[f"{v}.bias"] = (get(f"{v}.bias").reshape(-1, head_dim) @ r2).reshape(-1)
        w = get(f"{o}.weight")  # o reads every head's values rotated
        out[f"{o}.weight"] = (w.reshape(w.shape[0], -1, head_dim) @ r2).reshape(w.shape)
    if r1 is not None:
        for s in arch.scalings:
            if isinstance(block.get_submodule(s.prev), torch.nn.Linear):  # v -> o, up -> down: o and down write
                writer = s.linears[0]
                out[f"{writer}.weight"] = r1.T @ get(f"{writer}.weight")
                if has(f"{writer}.bias"):
                    out[f"{writer}.bias"] = get(f"{writer}.bias") @ r1
                continue
            norm = get(f"{s.prev}.weight")  # a norm read by ``s.linears``: fold its weight, rotate their inputs
            out[f"{s.prev}.weight"] = torch.ones_like(norm)
            for name in s.linears:
                out[f"{name}.weight"] = (get(f"{name}.weight") * norm[None, :]) @ r1
    if r4 is not None:
        down = next(n for n, m in block.named_modules() if m is down_of(block, arch))
        out[f"{down}.weight"] = get(f"{down}.weight") @ r4
    return out


def _to(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return value.to(like.dtype)
