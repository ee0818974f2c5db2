"""Several processes on one model, launched by ``torchrun`` (torch.distributed).

Each rank calibrates on its own contiguous share of the samples; statistics are summed (or
maxed) across ranks before a pass reads them; the work a pass can split is split by output
rows (rows of a GPTQ/SparseGPT N:M sweep or of AWQ's clip search never interact) or by grid
points (AWQ's scale search), and every rank gathers the pieces, so all ranks continue with the
same block. Rank 0 alone writes the export. The reasons for rows rather than one owner rank
per module are in docs/design.md, "Many processes".

A single-process run never initialises torch.distributed: every function here is then the
identity (``size() == 1``), so the single-process path has no collective at all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


class DistributedError(RuntimeError):
    """A multi-process run that cannot work as asked; the message says what to change."""


def launched() -> bool:
    """Started by torchrun (or another launcher that sets ``WORLD_SIZE``) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def start(device: str | None) -> str | None:
    """Join the process group; returns the device this rank computes on (``cuda:LOCAL_RANK`` for
    ``auto``/``cuda`` on a GPU machine, else ``device`` as given). nccl on CUDA, gloo on the CPU."""
    if not launched() or dist.is_initialized():
        return device
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed; run one process (without torchrun)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and (device in (None, "auto") or device.startswith("cuda"))
    if cuda:
        if local >= torch.cuda.device_count():
            raise DistributedError(
                f"local rank {local} has no GPU ({torch.cuda.device_count()} here): "
                "lower --nproc-per-node to the number of GPUs"
            )
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=int(os.environ.get("COMPRESS_DIST_TIMEOUT_MIN", "60"))))
    return device


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_size() -> int:
    """Processes of this run on this machine (they share its RAM)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def shares(n: int) -> list[range]:
    """``range(n)`` cut into ``size()`` contiguous pieces, the first ones longer by one where it
    does not divide: rank r's samples, windows or rows. Contiguous, so that concatenating the
    pieces in rank order gives the single-process order."""
    base, extra = divmod(n, size())
    starts = [r * base + min(r, extra) for r in range(size() + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(size())]


def share(n: int) -> range:
    return shares(n)[rank()]


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t  # gloo moves no bool tensors


def sum_(*tensors: torch.Tensor) -> None:
    """Each tensor becomes its sum over all ranks (in place)."""
    for t in tensors if size() > 1 else ():
        dist.all_reduce(t, dist.ReduceOp.SUM)


def max_(*tensors: torch.Tensor) -> None:
    for t in tensors if size() > 1 else ():
        dist.all_reduce(t, dist.ReduceOp.MAX)


def _device() -> torch.device:
    """Where small tensors of our own go to be reduced: nccl moves CUDA tensors only."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def total(*numbers: float) -> list[float]:
    """Each number summed over all ranks (float64, so token counts stay exact)."""
    if size() == 1:
        return list(numbers)
    t = torch.tensor(numbers, dtype=torch.float64, device=_device())
    sum_(t)
    return t.tolist()


def everyone(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    return total(float(not flag))[0] == 0


def broadcast_(t: torch.Tensor, src: int = 0) -> None:
    if size() > 1:
        dist.broadcast(_wire(t), src)


def same_as_main(tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite these tensors with rank 0's (in place): after work every rank did alike, so that a
    difference between machines cannot make the ranks' blocks drift apart."""
    for t in tensors if size() > 1 else ():
        broadcast_(t.data if isinstance(t, torch.nn.Parameter) else t, 0)


def broadcast_text(text: str | None, src: int = 0) -> str:
    """``src``'s string on every rank."""
    if size() == 1:
        return text
    device = _device()
    data = torch.tensor(list((text or "").encode()) if rank() == src else [], dtype=torch.uint8, device=device)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    broadcast_(length, src)
    if rank() != src:
        data = torch.empty(int(length), dtype=torch.uint8, device=device)
    broadcast_(data, src)
    return bytes(data.tolist()).decode()


def by_rows(compute: Callable[[range], Sequence[torch.Tensor]], rows: int, split: bool = True) -> list[torch.Tensor]:
    """``compute(rows)`` returns tensors whose first dimension is those rows; each rank computes
    its share of ``range(rows)`` and every rank gets the whole tensors, as if one process had
    computed ``compute(range(rows))`` (exact where rows do not interact). Not ``split`` (rows
    interact), or fewer rows than ranks: every rank computes them all, and rank 0's are kept."""
    if size() == 1 or rows < size() or not split:
        whole = list(compute(range(rows)))
        same_as_main(whole)
        return whole
    parts = shares(rows)
    mine = list(compute(parts[rank()]))
    out = []
    for piece in mine:
        full = torch.empty((rows, *piece.shape[1:]), dtype=piece.dtype, device=piece.device)
        full[parts[rank()].start : parts[rank()].stop] = piece
        for r, part in enumerate(parts):  # a row slice of a contiguous tensor is contiguous
            broadcast_(full[part.start : part.stop], r)
        out.append(full)
    return out


def pick(items: int, loss: Callable[[int], float]) -> list[float]:
    """``loss(i)`` for ``i`` in ``range(items)``, each computed on one rank (round robin), returned
    to every rank in item order: a grid search split across ranks."""
    if size() == 1:
        return [loss(i) for i in range(items)]
    values = torch.zeros(items, dtype=torch.float64, device=_device())
    for i in range(rank(), items, size()):
        values[i] = loss(i)
    sum_(values)
    return values.tolist()
