"""safetensors, the only weight files we read or write: ``Checkpoint`` reads a checkpoint's tensors
by name (one file, or shards listed by an index), ``ShardWriter`` writes an export's shards one
tensor at a time, laid out byte for byte as ``safetensors.torch.save_file`` lays them out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

MAX_SHARD_BYTES = 2 * 1024**3


class ExportError(RuntimeError):
    """An export that cannot be written as asked; the message says what to change."""


class CheckpointError(RuntimeError):
    pass


class Checkpoint:
    """The tensors of a safetensors checkpoint (one file, or shards listed by an index), by name.

    Files are opened for each read and closed after it: a memory map kept open would count
    every page ever read in the process's resident memory."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.file_of = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{folder} has no *.safetensors file (only safetensors checkpoints are read)")
            self.file_of = {}
            for f in files:
                with self._open(f) as st:
                    self.file_of.update({k: f for k in st.keys()})

    def _open(self, path: Path):
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(
                f"{path} is not a readable safetensors file ({e}); re-download or re-export it"
            ) from None

    def shapes(self) -> dict[str, list[int]]:
        """Every tensor's shape, read from the headers alone."""
        out = {}
        for path in sorted(set(self.file_of.values())):
            with self._open(path) as st:
                out.update({k: st.get_slice(k).get_shape() for k in st.keys()})
        return out

    def fingerprint(self) -> str:
        """Path, size and modification time of every file and of ``config.json``: what a cache of
        something computed from these weights keys on (a rewritten file changes its entry)."""
        parts = []
        for f in sorted({*self.file_of.values(), self.folder / "config.json"}):
            if f.exists():
                st = f.stat()
                parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};")
        return "".join(parts)

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def read(self, keys) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.file_of[k], []).append(k)
        out = {}
        for path, names in by_file.items():
            with self._open(path) as st:
                for k in names:
                    out[k] = st.get_tensor(k).clone()  # our own memory, not a view of the file's map
        return out


# safetensors orders a file's tensors by dtype (this rank, descending), then by name
_ST_DTYPES = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.float8_e4m3fn: ("F8_E4M3", 7),
    torch.int16: ("I16", 9),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.int32: ("I32", 13),
    torch.float32: ("F32", 15),
    torch.float64: ("F64", 17),
    torch.int64: ("I64", 18),
}


class ShardWriter:
    """safetensors shards written one tensor at a time, so an export never holds more than one
    tensor: each tensor's bytes go to a scratch file as it arrives; a full shard is then laid out
    exactly as ``safetensors.torch.save_file`` lays it out (the tests compare the bytes)."""

    def __init__(self, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
        self.folder, self.max_bytes = folder, max_shard_bytes
        self.done: list[tuple[Path, list[str]]] = []  # finished shards and their keys
        self._open_shard()

    def _open_shard(self) -> None:
        self.data_path = self.folder / f".shard-{len(self.done)}.data"
        self.data = open(self.data_path, "wb")
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
        self.size = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in _ST_DTYPES:
            raise ExportError(f"{key}: cannot store dtype {tensor.dtype} in safetensors here")
        t = tensor.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        if self.entries and self.size + nbytes > self.max_bytes:
            self._finish_shard()
            self._open_shard()
        self.data.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.entries.append((key, t.dtype, tuple(t.shape), self.size, nbytes))
        self.size += nbytes

    def _finish_shard(self) -> None:
        self.data.close()
        order = sorted(self.entries, key=lambda e: (-_ST_DTYPES[e[1]][1], e[0]))
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, dtype, shape, _, nbytes in order:
            header[key] = {
                "dtype": _ST_DTYPES[dtype][0],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path = self.folder / f".shard-{len(self.done)}.safetensors"
        with open(path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(len(text).to_bytes(8, "little"))
            out.write(text)
            for _, _, _, start, nbytes in order:
                data.seek(start)
                while nbytes:
                    chunk = data.read(min(nbytes, 1 << 24))
                    out.write(chunk)
                    nbytes -= len(chunk)
        self.data_path.unlink()
        self.done.append((path, [e[0] for e in self.entries]))

    def close(self) -> list[str]:
        """Name the shards as transformers does (one: model.safetensors; more: an index)."""
        self._finish_shard()
        if len(self.done) == 1:
            os.replace(self.done[0][0], self.folder / "model.safetensors")
            return ["model.safetensors"]
        names, index = [], {}
        for i, (path, keys) in enumerate(self.done):
            name = f"model-{i + 1:05d}-of-{len(self.done):05d}.safetensors"
            os.replace(path, self.folder / name)
            names.append(name)
            index.update({k: name for k in keys})
        (self.folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(index.items()))}, indent=2)
        )
        return names


def umask() -> int:
    """The process's file-creation mask (files we write are readable as their neighbours are)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
