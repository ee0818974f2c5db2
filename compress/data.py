"""Text for calibration and evaluation, and the calibration batches built from it.

Named sets (``wikitext2``, ``c4``, ``pile-val``) come from a local copy when one is
found (``$COMPRESS_DATA``, else the repository's ``calibration/`` folder, which ships
wikitext-2) and from the hub through ``datasets`` otherwise. A ``.txt`` or ``.jsonl`` path is read
as is. ``self`` generates calibration text with the model itself (data-free).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .models import cache_dir

NAMED = ("wikitext2", "c4", "pile-val")
SHIPPED = Path(__file__).resolve().parent.parent / "calibration"  # in the repository (an editable install)
SELF = "self"


class DataError(ValueError):
    pass


def _local_wikitext(split: str) -> Path | None:
    name = {"test": "wiki.test.raw", "validation": "wiki.valid.tokens"}[split]
    roots = [os.environ.get("COMPRESS_DATA"), SHIPPED]
    for root in filter(None, roots):
        path = Path(root) / "wikitext-2" / name
        if path.exists():
            return path
    return None


def _hub_text(name: str, split: str) -> str:
    try:
        from datasets import load_dataset

        if name == "wikitext2":
            rows = load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
            return "\n\n".join(rows)
        if name == "c4":
            ds = load_dataset(
                "allenai/c4", data_files={"validation": "en/c4-validation.00000-of-00008.json.gz"}, split="validation"
            )
            return "\n\n".join(ds["text"][:3000])
        ds = load_dataset("mit-han-lab/pile-val-backup", split="validation")
        return "\n\n".join(ds["text"][:3000])
    except Exception as e:  # datasets raises many types when offline
        raise DataError(
            f"could not get {name!r} from the hub ({type(e).__name__}); offline? "
            "point the recipe or --ppl at a local .txt/.jsonl file instead"
        ) from None


def _read_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror})") from None
    if path.suffix != ".jsonl":
        return text
    texts = []
    for i, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                entry = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                entry = None
            if not isinstance(entry, str):
                raise DataError(f"{path}:{i + 1}: each jsonl line must be an object whose 'text' is a string")
            texts.append(entry)
    return "\n\n".join(texts)


def load_text(source: str, split: str = "test") -> str:
    """The raw text of a named set's split, or of a local file."""
    if source in NAMED:
        if source == "wikitext2":
            local = _local_wikitext(split)
            if local is not None:
                return local.read_text(encoding="utf-8")
        return _hub_text(source, split)
    path = Path(source).expanduser()
    if path.suffix in (".txt", ".raw", ".tokens", ".jsonl") and path.exists():
        return _read_file(path)
    raise DataError(f"unknown text source {source!r}: use one of {', '.join(NAMED)}, or an existing .txt/.jsonl file")


def describe_source(source: str, split: str) -> str:
    local = _local_wikitext(split) if source == "wikitext2" else None
    if local is not None:
        return f"wikitext2 {split} ({'shipped in calibration/' if local.is_relative_to(SHIPPED) else local})"
    return f"{source} {split}" if source in NAMED else source


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of the whole text, without BOS/EOS (the stated eval protocol)."""
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def tokenizer_fingerprint(tokenizer) -> str:
    """Tells tokenizers apart: what is cached or stored as token ids is only valid for one."""
    probe = tokenizer("The quick brown fox, 1234 ü 日本", add_special_tokens=False)["input_ids"]
    return f"{len(tokenizer)}-{probe}"


def calibration_batches(
    model, tokenizer, source: str, samples: int, seqlen: int, seed: int
) -> tuple[torch.Tensor, str]:
    """``samples`` × ``seqlen`` token ids, deterministic for ``seed``, cached on disk.

    Random windows of the tokenized text (GPTQ's protocol), or text the model
    samples itself when ``source`` is ``self``. Returns ids and a description.
    """
    key = hashlib.sha256(
        json.dumps(
            [
                source,
                samples,
                seqlen,
                seed,
                tokenizer_fingerprint(tokenizer),
                getattr(model.config, "_name_or_path", ""),
            ]
        ).encode()
    ).hexdigest()[:16]
    cached = cache_dir() / "calibration" / f"{key}.safetensors"
    what = f"{samples} × {seqlen} tokens from " + (
        "the model itself (data-free)" if source == SELF else describe_source(source, "validation")
    )
    if cached.exists():
        return load_file(cached)["ids"], what
    if source == SELF:
        ids = _self_generated(model, tokenizer, samples, seqlen, seed)
    else:
        ids = tokenize(tokenizer, load_text(source, "validation"))
        if len(ids) <= seqlen:
            raise DataError(f"calibration text {source!r} has {len(ids)} tokens, fewer than seqlen {seqlen}")
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(ids) - seqlen, (samples,), generator=g)
        ids = torch.stack([ids[s : s + seqlen] for s in starts.tolist()])
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    save_file({"ids": ids.contiguous()}, tmp)
    os.replace(tmp, cached)
    return ids, what


@torch.no_grad()
def _self_generated(model, tokenizer, samples: int, seqlen: int, seed: int, batch: int = 16) -> torch.Tensor:
    """Data-free calibration (LLM-QAT): sample sequences from the model, starting at a random token."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    out = []
    for start in tqdm(range(0, samples, batch), desc="generating calibration text", unit="batch"):
        n = min(batch, samples - start)
        first = torch.randint(0, len(tokenizer), (n, 1), generator=g)
        torch.manual_seed(seed + start)
        ids = model.generate(
            first.to(device),
            do_sample=True,
            top_k=50,
            max_new_tokens=seqlen - 1,
            min_new_tokens=seqlen - 1,
            pad_token_id=tokenizer.eos_token_id,
        )
        out.append(ids[:, :seqlen].cpu())
    return torch.cat(out)


CHAT_PROMPTS = SHIPPED / "chat-prompts.txt"


@torch.no_grad()
def chat_replies(model, tokenizer, count: int, max_new_tokens: int, batch: int = 16) -> list[torch.Tensor]:
    """The model's own greedy replies to the first ``count`` shipped chat requests
    (``calibration/chat-prompts.txt``), each the whole conversation as token ids (the chat template,
    the request, the reply): what a draft head sees when it drafts for a chat model."""
    from tqdm import tqdm

    asks = [line for line in CHAT_PROMPTS.read_text().splitlines() if line.strip()][:count]
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("chat replies need a tokenizer with a chat template; this one has none")
    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    try:
        for start in tqdm(range(0, len(asks), batch), desc="generating chat replies", unit="batch"):
            chats = [[{"role": "user", "content": ask}] for ask in asks[start : start + batch]]
            enc = tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True
            )
            context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
            ids = model.generate(
                **{k: v.to(device) for k, v in enc.items()},
                do_sample=False,
                max_new_tokens=max(1, min(max_new_tokens, context - enc["input_ids"].shape[1])),
                pad_token_id=pad,
            ).cpu()
            stops = torch.tensor(sorted({pad, tokenizer.eos_token_id} - {None}))
            for row, mask in zip(ids, enc["attention_mask"]):
                asked = int(mask.sum())
                row = row[len(mask) - asked :]  # the left padding off
                ends = torch.isin(row[asked:], stops).nonzero()
                out.append(row[: asked + int(ends[0]) + 1] if len(ends) else row)  # up to its end of turn
    finally:
        tokenizer.padding_side = side
    return out


class SpilledList:
    """A list of tensors kept in files under ``root`` instead of in RAM (``apply --spill``): the
    calibration activations of many samples of a big model. Each tensor is written once and read
    back memory-mapped, so its pages are file pages the OS can drop and read again, not memory
    the process must hold; ``device`` is where items are handed out. The files go with the list."""

    def __init__(self, root: Path, device: torch.device):
        self.folder = Path(tempfile.mkdtemp(prefix="activations-", dir=root))
        weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.device, self.entries, self.written = device, [], 0

    def _write(self, t: torch.Tensor) -> tuple:
        t = t.detach().to("cpu").contiguous()
        path = self.folder / f"{self.written}.bin"
        self.written += 1
        t.reshape(-1).view(torch.uint8).numpy().tofile(path)
        return path, t.shape, t.dtype

    def append(self, t: torch.Tensor) -> None:
        self.entries.append(self._write(t))

    def __setitem__(self, i: int, t: torch.Tensor) -> None:
        old, self.entries[i] = self.entries[i], self._write(t)
        old[0].unlink()  # a mapping still open keeps its pages until it is dropped

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        path, shape, dtype = self.entries[i]
        size = shape.numel() * dtype.itemsize
        return (
            torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
            .view(dtype)
            .view(shape)
            .to(self.device)
        )

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def activation_store(spill: str | Path | None, device: torch.device) -> Callable[[], list]:
    """What holds calibration activations: a list in RAM, or a ``SpilledList`` under ``spill``."""
    if spill is None:
        return list
    root = Path(spill)
    if not root.is_dir():
        raise DataError(f"--spill {spill}: not a folder; give an existing folder with room for the activations")
    return lambda: SpilledList(root, device)
