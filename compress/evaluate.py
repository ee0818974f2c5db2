"""Perplexity, and fidelity to the uncompressed model, under one stated protocol.

Protocol: the text is tokenized without special tokens, cut into non-overlapping
windows of ``seqlen`` tokens, the first ``windows`` of them are scored, and
perplexity is exp(mean NLL over every predicted token). With a reference model,
the same windows give KL(reference ‖ model) per token and top-1 agreement —
perplexity alone hides damage.

The reference's part (its final hidden states on the windows) is the same for every recipe
applied to one model under one protocol, so it is kept in ``$COMPRESS_CACHE/reference/``
(exact, in the compute dtype) and read back by the next run instead of computed again.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from . import distributed, kv_quant, lazy, pipeline
from .arch import arch_of
from .data import DataError, describe_source, load_text, tokenize
from .lazy import StreamedModel, streamed
from .models import cache_dir, cast_params, compute_dtype
from .pipeline import capture_inputs

REFERENCE_CACHE_BYTES = 4e9  # a reference's hidden states larger than this are not kept
REFERENCE_CACHE_FILES = 4  # the most recently used are kept, older ones removed


@dataclass
class EvalResult:
    protocol: str
    ppl: float
    ref_ppl: float | None = None
    kl: float | None = None  # mean KL(reference ‖ model), nats per token
    top1: float | None = None  # share of positions where both models' argmax agree
    # Standard errors over windows (None with one window): of the perplexity, and of its relative
    # increase over the reference's (ppl / ref_ppl - 1), paired window by window: a window's own
    # difficulty cancels there, and the relative increase, unlike the absolute one, does not move
    # with how hard the windows chosen are.
    ppl_se: float | None = None
    increase_se: float | None = None

    def as_dict(self):
        return asdict(self)


def windows_of(tokenizer, source: str, seqlen: int, windows: int) -> torch.Tensor:
    ids = tokenize(tokenizer, load_text(source, "test"))
    available = len(ids) // seqlen
    if available == 0:
        raise DataError(f"{source} has {len(ids)} tokens, fewer than one window of {seqlen}")
    if windows > available:
        raise DataError(f"{source} has only {available} windows of {seqlen} tokens; lower --windows")
    return ids[: windows * seqlen].reshape(windows, seqlen)


def output_logits(model):
    """The output head as a function of hidden states (Gemma's final logit soft-capping and
    Granite's logit scaling included)."""
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    divide = getattr(model.config, "logits_scaling", None) or 1.0

    def logits(hidden):
        out = head(hidden).float() / divide
        return torch.tanh(out / cap) * cap if cap else out

    return logits, head.weight.shape[0]


class _Score:
    """Running sums for one model: NLL, and against the reference KL and top-1 agreement; and over
    windows, the sums and squares of each window's mean NLL and of its difference from the
    reference's, for the standard errors."""

    def __init__(self):
        self.nll = self.kl = 0.0
        self.agree = self.count = 0
        self.x = self.xx = self.d = self.dd = 0.0

    def add_window(self, mean_nll: float, reference_mean_nll: float | None) -> None:
        self.x += mean_nll
        self.xx += mean_nll**2
        if reference_mean_nll is not None:
            self.d += mean_nll - reference_mean_nll
            self.dd += (mean_nll - reference_mean_nll) ** 2

    def totals(self) -> list[float]:
        return [self.nll, self.kl, self.agree, self.count, self.x, self.xx, self.d, self.dd]


def _standard_error(total: float, squares: float, n: int) -> float | None:
    """Of the mean of ``n`` values given their sum and sum of squares."""
    if n < 2:
        return None
    mean = total / n
    return math.sqrt(max(squares / n - mean * mean, 0.0) * n / (n - 1) / n)


@torch.no_grad()
def final_hidden(
    model: StreamedModel, data: torch.Tensor, device: torch.device, progress: bool = True, desc: str = "evaluating"
) -> list[torch.Tensor]:
    """Each window's hidden states after the final norm (positions that predict a token), computed
    block by block over all windows: one block of the model is in memory at a time."""
    dtype = compute_dtype(device, model.dtype)
    arch = arch_of(model.model)
    with kv_quant.simulating(model.model):  # a quantized KV cache, as a decoder would see it
        hidden, calls = capture_inputs(model.model, data, device, dtype)
        for i in tqdm(range(len(model)), desc=desc, unit="block", disable=not progress):
            with model.block(i) as block:
                cast_params(block, device, dtype)
                args, kwargs = calls[i]
                for n, h in enumerate(hidden):
                    out = block(h, *args, **kwargs)
                    hidden[n] = out[0] if isinstance(out, tuple) else out
    norm = model.model.get_submodule(arch.norm)
    home = next(norm.parameters()).device, next(norm.parameters()).dtype
    cast_params(norm, device, dtype)
    try:
        return [norm(h)[0, :-1] for h in hidden]
    finally:
        cast_params(norm, *home)


def _score(
    data: torch.Tensor, hidden: dict[str, list[torch.Tensor]], heads: dict, scores: dict, progress: bool = True
) -> None:
    # minutes with a large vocabulary (Gemma-3's 262k): a bar, not silence
    for w, window in enumerate(tqdm(data, desc="scoring", unit="window", disable=not progress)):
        targets = window[1:]
        window_nll = dict.fromkeys(scores, 0.0)
        chunk = max(1, (1 << 26) // max(vocab for _, vocab in heads.values()))
        for start in range(0, len(targets), chunk):  # a window's logits are ~400 MB: a chunk at a time
            logps = {
                name: torch.log_softmax(heads[name][0](h[w][start : start + chunk]), -1) for name, h in hidden.items()
            }
            ref = logps.get(_REF)
            for name, logp in logps.items():
                sc = scores[name]
                t = targets[start : start + chunk, None].to(logp.device)
                nll = -logp.gather(1, t).sum().item()
                sc.nll += nll
                window_nll[name] += nll
                sc.count += t.shape[0]
                if ref is not None and name != _REF:
                    ref = ref.to(logp.device)
                    sc.kl += (ref.exp() * (ref - logp)).sum().item()
                    sc.agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()
        reference = window_nll.get(_REF)
        for name, sc in scores.items():
            paired = None if reference is None or name == _REF else reference / len(targets)
            sc.add_window(window_nll[name] / len(targets), paired)


@contextlib.contextmanager
def head_on_device(model, device: torch.device):
    """The head (and what it is tied to) on ``device`` in the compute dtype while scoring."""
    head = model.get_output_embeddings()
    p = head.weight
    home = p.device, p.dtype
    cast_params(head, device, compute_dtype(device, p.dtype))
    try:
        yield
    finally:
        cast_params(head, *home)


@torch.no_grad()
def evaluate_many(
    models: dict,
    tokenizer,
    source: str = "wikitext2",
    seqlen: int = 2048,
    windows: int = 40,
    reference=None,
    progress: bool = True,
    data: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> dict[str, EvalResult]:
    """Score several models on the same windows.

    Models are ``StreamedModel``s (read a block at a time) or whole transformers models; each
    runs block by block over all windows, so only its current block is in memory, with one
    set of hidden states per model. Log-probabilities are formed a chunk of positions at a
    time, never as a whole (seqlen × vocab) tensor. ``device``: where blocks compute (default:
    where the first model's embeddings are). With several processes each scores its share of
    the windows and the sums are combined.
    """
    data = windows_of(tokenizer, source, seqlen, windows) if data is None else data
    if len(data) < distributed.size():
        raise DataError(
            f"{len(data)} evaluation windows for {distributed.size()} processes; give each one at least one"
        )
    mine = distributed.share(len(data))  # several processes: each scores its own windows
    data = data[mine.start : mine.stop]
    progress = progress and distributed.is_main()
    everyone = {name: streamed(m) for name, m in models.items()}
    if reference is not None:
        everyone[_REF] = streamed(reference)
    if device is None:
        device = next(iter(everyone.values())).model.get_input_embeddings().weight.device
    scores = {name: _Score() for name in everyone}
    hidden = {
        name: reference_hidden(m, data, device, progress)
        if name == _REF
        else final_hidden(m, data, device, progress, f"evaluating {name}")
        for name, m in everyone.items()
    }
    heads = {name: output_logits(m.model) for name, m in everyone.items()}
    with contextlib.ExitStack() as stack:
        for m in everyone.values():
            stack.enter_context(head_on_device(m.model, device))
        _score(data, hidden, heads, scores, progress)
    n = int(distributed.total(float(len(data)))[0])
    for sc in scores.values():  # sums over every rank's windows
        sc.nll, sc.kl, sc.agree, sc.count, sc.x, sc.xx, sc.d, sc.dd = distributed.total(*sc.totals())
    return _results(scores, list(models), f"{describe_source(source, 'test')}, {n} × {seqlen} tokens", n)


@torch.no_grad()
def evaluate_gguf(
    path, tokenizer, source: str = "wikitext2", seqlen: int = 2048, windows: int = 40, reference=None, threads=None
) -> EvalResult:
    """A GGUF file scored from llama.cpp's own logits (``compress.llama_cpp``) on the windows that
    ``tokenizer`` (the reference's) cuts, against ``reference``'s hidden states as ``evaluate`` does."""
    from . import llama_cpp

    data = windows_of(tokenizer, source, seqlen, windows)
    with llama_cpp.opened(path, seqlen, threads, all_logits=True) as llm, contextlib.ExitStack() as stack:
        logits = llama_cpp.WindowLogits(llm, data)
        hidden, heads, scores = {"gguf": logits}, {"gguf": (lambda x: x, logits.vocab)}, {"gguf": _Score()}
        ref = None if reference is None else streamed(reference)
        theirs = len(tokenizer) if ref is None else output_logits(ref.model)[1]
        if logits.vocab != theirs:
            raise DataError(f"{path} scores {logits.vocab} tokens, the reference {theirs}: not the same vocabulary")
        if ref is not None:
            device = ref.model.get_input_embeddings().weight.device
            hidden[_REF], heads[_REF] = reference_hidden(ref, data, device), output_logits(ref.model)
            scores[_REF] = _Score()
            stack.enter_context(head_on_device(ref.model, device))
        _score(data, hidden, heads, scores)
    protocol = f"{describe_source(source, 'test')}, {len(data)} × {seqlen} tokens, logits from llama.cpp"
    return _results(scores, ["gguf"], protocol, len(data))["gguf"]


def _results(scores: dict, names: list[str], protocol: str, n: int) -> dict[str, EvalResult]:
    """Each model's ``EvalResult`` from its summed scores over ``n`` windows (``_REF``'s: the reference's)."""
    ref_ppl = math.exp(scores[_REF].nll / scores[_REF].count) if _REF in scores else None
    out = {}
    for name in names:
        sc = scores[name]
        ppl = math.exp(sc.nll / sc.count)
        se = _standard_error(sc.x, sc.xx, n)  # of the mean NLL: times ppl for the perplexity's
        result = EvalResult(protocol, ppl, ppl_se=None if se is None else ppl * se)
        if ref_ppl is not None:
            se = _standard_error(sc.d, sc.dd, n)
            result.ref_ppl, result.kl, result.top1 = ref_ppl, sc.kl / sc.count, sc.agree / sc.count
            result.increase_se = None if se is None else ppl / ref_ppl * se
        out[name] = result
    return out


_REF = "\0reference"


def _reference_key(model: StreamedModel, data: torch.Tensor, device: torch.device) -> str | None:
    """What a reference's hidden states depend on: its files (path, size, modification time), the
    windows, the dtypes and device kind, and the code and libraries that compute them. None for
    a model held in memory (it may have been changed there)."""
    if model.checkpoint is None:
        return None
    h = hashlib.sha256(model.checkpoint.fingerprint().encode())
    h.update(data.cpu().numpy().tobytes())
    h.update(f"{device.type}:{model.dtype}:{compute_dtype(device, model.dtype)}".encode())
    h.update(f"{torch.__version__}:{transformers.__version__}".encode())
    for module in (sys.modules[__name__], lazy, pipeline, kv_quant):
        h.update(Path(module.__file__).read_bytes())
    return h.hexdigest()[:32]


def reference_hidden(model: StreamedModel, data: torch.Tensor, device: torch.device, progress: bool = True):
    """``final_hidden`` of the reference, read from the cache when this model, these windows and
    this code computed it before; else computed and kept there (atomically)."""
    key = _reference_key(model, data, device)
    folder = cache_dir() / "reference"
    path = folder / f"{key}.safetensors"  # unused when key is None (a model held in memory)
    if key is not None and path.is_file():
        try:
            kept = load_file(path, device=str(device))
            hidden = [kept[f"window{i}"] for i in range(len(data))]
        except Exception:  # a damaged file: compute again, and replace it below
            hidden = None
        if hidden is not None:
            os.utime(path)  # most recently used
            if distributed.is_main():
                print(f"[compress] reference: hidden states read from {path} (an earlier run's)", file=sys.stderr)
            return hidden
    hidden = final_hidden(model, data, device, progress, "evaluating reference")
    size = sum(h.numel() * h.element_size() for h in hidden)
    if key is not None and size <= REFERENCE_CACHE_BYTES:
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            save_file({f"window{i}": h.contiguous().cpu() for i, h in enumerate(hidden)}, tmp)
            os.replace(tmp, path)
        except OSError as e:  # a full disk or a read-only cache: the evaluation does not need it
            tmp.unlink(missing_ok=True)
            print(f"[compress] reference: could not keep its hidden states in {folder} ({e})", file=sys.stderr)
            return hidden
        for old in sorted(folder.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)[:-REFERENCE_CACHE_FILES]:
            old.unlink(missing_ok=True)  # ours: this folder holds only what this function wrote
        if distributed.is_main():
            print(
                f"[compress] reference: kept its hidden states for later runs on these windows ({size / 1e6:.0f} MB "
                f"in {folder})",
                file=sys.stderr,
            )
    return hidden


def evaluate(model, tokenizer, *args, **kwargs) -> EvalResult:
    """One model scored as ``evaluate_many`` scores several (same arguments after the tokenizer).
    ``data`` (windows × seqlen ids from ``windows_of``) may be prepared early to fail before compute."""
    return evaluate_many({"model": model}, tokenizer, *args, **kwargs)["model"]
