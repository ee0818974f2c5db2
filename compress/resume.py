"""Resumable sweeps: each finished block's compressed state is kept beside the output, so that
``compress apply ... --resume`` after a killed run (out of memory, a preempted machine, a lost
session) reads those blocks back instead of compressing them again.

A block's state is what the passes left on it: its tensors, and on its modules every declared
state (``compress/state.py``: integers, masks, factored pairs, LoRA, input and KV schemes), each
saved and restored by its own class. It is written as one safetensors file per block (no pickle),
with the structure in the file's metadata. A weight a state rebuilds (a quantized weight equal to
its dequantized integers) is not written again: it is rebuilt, bit for bit. The global random state is
kept with each block, so the blocks after a resumed one see the generator the uninterrupted run
saw. The blocks read back are run over the calibration data again to give the next block its
inputs: the same weights and the same inputs make the same activations, so a resumed run's
export equals an uninterrupted run's byte for byte (``tests/test_resume.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import factored, kv_quant, quant, sparsity  # noqa: F401 - their kinds of state register on import
from .state import KINDS, states_of

STATE = "state.json"
META = "compress-block-state-2"  # the layout of ``block_state``; a block kept by another layout is not read


class ResumeError(RuntimeError):
    pass


def folder_for(out: Path) -> Path:
    """Where the finished blocks of a run writing ``out`` are kept (hidden, beside it)."""
    return out.parent / f".{out.name}.resume"


class BlockCheckpoints:
    """The finished blocks of one run, identified by ``key`` (recipe, model, seed, data, dtype,
    device: what makes the blocks what they are). ``resumable``: how many blocks a resumed run
    reads back instead of compressing them."""

    def __init__(self, out: Path, key: dict, resume: bool):
        self.folder, self.key, self.resumable, self.logs = folder_for(Path(out)), key, 0, {}
        state = self._state()
        if state is None:
            if resume:
                print(
                    f"[compress] --resume: no interrupted run of {out} to continue; starting from the first block",
                    file=sys.stderr,
                )
            return
        if not resume:
            self.remove()
            print(
                f"[compress] removed {self.folder} ({state['blocks']} blocks of an interrupted run; "
                "--resume would have continued from them)",
                file=sys.stderr,
            )
            return
        if state["key"] != key:
            changed = sorted(k for k in key.keys() | state["key"].keys() if key.get(k) != state["key"].get(k))
            raise ResumeError(
                f"--resume: the interrupted run in {self.folder} had another {', '.join(changed)}; "
                "rerun it as it was, or drop --resume to start over (that removes it)"
            )
        self.resumable, self.logs = state["blocks"], state.get("logs", {})
        print(f"[compress] --resume: reading {self.resumable} finished blocks back from {self.folder}", file=sys.stderr)

    def _state(self) -> dict | None:
        path = self.folder / STATE
        if not path.is_file():
            if self.folder.exists() and (not self.folder.is_dir() or any(self.folder.iterdir())):
                raise ResumeError(f"{self.folder} is in the way and is not ours (no {STATE}); move it away")
            return None
        try:
            state = json.loads(path.read_text())
            blocks, _ = int(state["blocks"]), state["key"]
        except (ValueError, KeyError, TypeError):
            raise ResumeError(f"{path} is damaged; remove {self.folder} to start over") from None
        missing = [i for i in range(blocks) if not self._block_path(i).is_file()]
        if missing:
            raise ResumeError(f"{self.folder} lacks block {missing[0]}; remove it to start over")
        return state

    def _block_path(self, i: int) -> Path:
        return self.folder / f"block-{i:05d}.safetensors"

    def save(self, i: int, block: torch.nn.Module, logs: dict) -> None:
        """Keep block ``i`` (every block before it is kept already) and the passes' training logs
        so far (``logs``: pass -> log; a pass may read its log, as blockwise seeds each block's
        training by it); a kill leaves the old state or the new."""
        self.folder.mkdir(exist_ok=True)
        path = self._block_path(i)
        partial = path.with_name(path.name + ".partial")
        tensors, meta = block_state(block)
        save_file(tensors, str(partial), metadata={META: json.dumps(meta)})
        os.replace(partial, path)
        state = self.folder / (STATE + ".partial")
        state.write_text(json.dumps({"blocks": i + 1, "key": self.key, "logs": logs}))
        os.replace(state, self.folder / STATE)

    def restore(self, i: int, block: torch.nn.Module) -> None:
        with safe_open(str(self._block_path(i)), "pt") as f:
            if META not in (f.metadata() or {}):
                raise ResumeError(f"{self.folder} was kept by another version of compress; drop --resume to start over")
            meta = json.loads(f.metadata()[META])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        restore_block_state(block, tensors, meta)

    def remove(self) -> None:
        if (self.folder / STATE).is_file():  # ours: never remove a folder we did not write
            shutil.rmtree(self.folder, ignore_errors=True)


def block_state(block: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, structure) of a compressed block: every declared state of its modules
    (``state.KINDS``), its tensors but those a state rebuilds, and the random state."""
    tensors: dict[str, torch.Tensor] = {"rng": torch.get_rng_state()}
    meta: dict = {"states": {}, "rebuilt": []}
    for name, m in block.named_modules():
        for state in states_of(m):
            saved, info = state.saved()
            meta["states"].setdefault(state.attr, {})[name] = info
            tensors |= {f"{state.attr}/{name}/{k}": t for k, t in saved.items()}
            meta["rebuilt"] += [f"{name}.{leaf}" for leaf in state.rebuilds(m)]
    for key, t in block.state_dict().items():
        if key not in meta["rebuilt"]:
            tensors[f"state/{key}"] = t
    return {k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, meta


def restore_block_state(block: torch.nn.Module, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Make ``block`` (as read from the model) the compressed block ``block_state`` described:
    structural states first (they replace modules), then the others, then the tensors."""
    unknown = set(meta["states"]) - set(KINDS)
    if unknown:
        raise ResumeError(f"a kept block has states this version does not know ({sorted(unknown)}); start over")
    for attr in sorted(meta["states"], key=lambda attr: not KINDS[attr].structural):
        for name, info in meta["states"][attr].items():
            prefix = f"{attr}/{name}/"
            saved = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
            KINDS[attr].restore(block, name, saved, info)
    state = {k.removeprefix("state/"): t for k, t in tensors.items() if k.startswith("state/")}
    result = block.load_state_dict(state, strict=False)
    if result.unexpected_keys or sorted(result.missing_keys) != sorted(meta["rebuilt"]):
        raise ResumeError(
            f"a kept block does not fit this model (unexpected {result.unexpected_keys[:3]}, "
            f"missing {sorted(set(result.missing_keys) - set(meta['rebuilt']))[:3]})"
        )
    torch.set_rng_state(tensors["rng"])
