"""LoRC (Yao et al. 2023, ZeroQuant-V2): a rank-r correction of the quantization error.

After a quantization pass, ``E = W − Q(W)`` is approximated by ``B·A`` (``compress/factored.py``):
plain SVD as in the paper, or whitened by ``XᵀX`` (``method: svdllm``) so the rank is spent
where the layer's inputs are. The correction is exactly a LoRA adapter with scale 1 on the
quantized base, so it exports as a PEFT adapter next to the checkpoint (vLLM serves LoRA on
quantized bases); in memory it is folded into the weight for evaluation.
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import Field

from .. import distributed
from ..factored import factors, whitened_svd
from ..hessian import Hessian, dampened_cholesky
from ..quant import quantized_of
from ..state import LoRA
from .base import LinearOptions, LinearPass


class LoRCOptions(LinearOptions):
    rank: int = Field(16, gt=0)
    method: Literal["svd", "svdllm"] = "svd"
    percdamp: float = Field(0.01, ge=0)


class LoRC(LinearPass):
    name = "lorc"
    leaves = frozenset({"lora"})
    Options = LoRCOptions
    uses_hessian = True
    holds_block_statistics = True
    needs_original = True

    def __init__(self, options, where):
        super().__init__(options, where)
        self.needs_data = options.method == "svdllm"

    corrects_rounding = True

    def order_problem(self, before, after):
        """It corrects a quantization pass before it and is folded into the weights: nothing may follow."""
        if not any(q.weight_bits for q in before):
            return "LoRC corrects quantization error; put a quantization pass before it"
        if after:
            return "LoRC must be the last pass (its correction is not a quantized weight)"
        return None

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = {n: lin for n, lin in self.targets(block, prefix).items() if quantized_of(lin) is not None}
        stats = data.observe(self.target_groups(targets), Hessian) if self.needs_data else {}
        for name, lin in targets.items():
            error = data.original.get_submodule(name).weight.float() - lin.weight.float()
            S = dampened_cholesky(stats[name].H, o.percdamp, prefix + name) if self.needs_data else None
            if self.needs_data and S is None:
                warnings.warn(f"{prefix}{name}: XᵀX could not be factorised; plain SVD of the error", stacklevel=2)
            B, A = factors(*whitened_svd(error, S), min(o.rank, *error.shape), S)
            B, A = B.to(self.dtype), A.to(self.dtype)  # as the adapter is exported
            lin.weight.data = (lin.weight.float() + B.float() @ A.float()).to(self.dtype).to(lin.weight.dtype)
            LoRA(B, A).attach(lin)
            distributed.same_as_main([lin.weight, B, A])  # every rank computed it; rank 0's is kept

    def summary(self) -> str:
        return f"lorc r{self.options.rank} ({self.options.method})"
