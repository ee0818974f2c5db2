"""Block-wise reconstruction: after a block is compressed, train a few of its tensors so
that its output matches the dense block's (mean squared error), before the next block sees it.

The same idea as BRECQ/OmniQuant's block objective, cheap enough for a CPU: only the
quantization scales and norm weights train by default (``compress/recovery.py``), so the
integers, masks and export layout do not change. Both blocks read the same inputs (the
compressed model's activations), so the target is "what the dense block would do here".
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from ..recovery import Trainables, train
from .base import LinearPass, RecoveryOptions, recovery_problem


class BlockwiseOptions(RecoveryOptions):
    train: list[Literal["scales", "norms", "weights"]] = ["scales", "norms"]
    ignore: list[str] = ["lm_head"]


class Blockwise(LinearPass):
    name = "blockwise"
    Options = BlockwiseOptions
    needs_original = True
    compresses = False
    data_parallel = False

    def order_problem(self, before, after):
        return recovery_problem(self, before)

    def apply(self, block, data, prefix: str) -> None:
        o = self.options
        targets = _outputs(data.original, data)
        if torch.equal(_outputs(block, data, 1)[0], targets[0]):
            return  # nothing before this pass changed the block (all of it ignored)
        seed = torch.initial_seed() + int(prefix.rstrip(".").rpartition(".")[2])  # the recipe's, one per block
        trainables = Trainables(block, self.targets(block, prefix), o.train, self.dtype, seed=seed)
        if not trainables:
            warnings.warn(
                f"{self.where}: nothing to train in {prefix.rstrip('.')} ({', '.join(o.train)})", stacklevel=2
            )
            return
        generator = torch.Generator().manual_seed(seed)

        def loss_of(step: int) -> torch.Tensor:
            picks = torch.randint(len(data.inputs), (o.batch,), generator=generator).tolist()
            x = torch.cat([data.inputs[i] for i in picks])
            target = torch.cat([targets[i] for i in picks])
            out = block(x, *data.args, **data.kwargs)
            return F.mse_loss(out.float(), target.float()) / target.float().pow(2).mean()

        try:
            self.log[prefix.rstrip(".")] = train(
                trainables,
                loss_of,
                o.steps,
                o.lr,
                o.weight_lr,
                f"reconstructing {prefix.rstrip('.')}",
                optimizer=o.optimizer,
            )
        finally:
            trainables.finish()

    def summary(self) -> str:
        o = self.options
        return f"blockwise ({'+'.join(o.train)}, {o.steps} steps/block)"


@torch.no_grad()
def _outputs(block: torch.nn.Module, data, limit: int | None = None) -> list[torch.Tensor]:
    return [block(x, *data.args, **data.kwargs) for x in data.inputs[:limit]]
