"""GGUF files for llama.cpp (and ollama, LM Studio) from an export: our GPTQ/AWQ/RTN integers and
scales packed bit for bit into llama.cpp's block formats, with no rounding of their own.

At group size 32 our weights map onto llama.cpp's blocks of 32 exactly (``q`` our signed
integers, ``s`` the scale, ``z`` the zero-point, ``w = (q - z) * s``):

- Q4_0 (4-bit symmetric): ``w = d * (u - 8)`` with ``u = q + 8`` and ``d = s``;
- Q4_1 (4-bit asymmetric): ``w = d * u + m`` with ``u = q + 8``, ``d = s`` and ``m = -s * (8 + z)``;
- Q8_0 (8-bit symmetric): ``w = d * q`` with ``d = s``;
- Q5_0 and Q5_1 as Q4_0 and Q4_1 with 5-bit integers (``u = q + 16``): written only where a
  k-quant cannot go (below).

The k-quants (Q2_K ... Q6_K) come from weights rounded on their own grid (``compress/kquant.py``),
packed by ``gguf_kquants``. Their super-blocks span 256 weights of a row, so a layer whose input
width is not a multiple of 256 takes the type llama.cpp itself falls back to (``kquant.FALLBACK``).
No compressed-tensors layout holds these types: an export of them keeps those linears dense
(float32, the very values the GGUF dequantizes to) and hands their integers to this module through
a scratch folder (``CODES``) that only lives while the export is written.

``d`` and ``m`` are float16 in the file; a recipe that exports GGUF rounds its scales to float16
numbers (``QuantScheme.fp16_scales``) so they are stored exactly, and computes in float32 so
that each dequantized weight is the same number here and in llama.cpp. Dense matrices are
written F16 where that is exact (F32 otherwise), norms and biases F32. Metadata and the
tokenizer follow llama.cpp's own converter (``convert_hf_to_gguf.py``) for the families listed
in ``ARCHES``. The file is written tensor by tensor (one tensor in memory at a time).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch

from .. import kquant
from . import gguf_kquants

GROUP = 32
CODES = ".gguf-codes"  # the scratch folder of an export's GGUF-only integers (``codes_of``)


@dataclass(frozen=True)
class BlockType:
    bits: int
    symmetric: bool

    def describe(self) -> str:
        return f"{self.bits}-bit {'symmetric' if self.symmetric else 'asymmetric'} weights in groups of {GROUP}"


LEGACY = {
    "q4_0": BlockType(4, True),
    "q4_1": BlockType(4, False),
    "q5_0": BlockType(5, True),
    "q5_1": BlockType(5, False),
    "q8_0": BlockType(8, True),
}
# A k-quant file as llama.cpp's quantizer makes it (``llama_tensor_get_type`` in llama-quant.cpp) is
# a mix: a base type, and more bits for some attention-value, FFN-down and attention-output tensors
# (``mix_type``). q3_k, q4_k and q5_k alone are llama.cpp's ``--pure`` files of those types.
MIX_BASE = {
    "q2_k": "q2_k",
    "q3_k_s": "q3_k",
    "q3_k_m": "q3_k",
    "q3_k_l": "q3_k",
    "q4_k_s": "q4_k",
    "q4_k_m": "q4_k",
    "q5_k_s": "q5_k",
    "q5_k_m": "q5_k",
    "q6_k": "q6_k",
    "q3_k": "q3_k",
    "q4_k": "q4_k",
    "q5_k": "q5_k",
}
TYPES = ["q4_0", "q4_1", "q5_1", "q8_0", *MIX_BASE]  # what a recipe's export.type names
# transformers model_type -> llama.cpp architecture (Mistral is written as Llama, as llama.cpp does)
ARCHES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
PERMUTED = ("llama",)  # llama.cpp's Llama rotates q/k rows pairwise interleaved, not by halves
NORM_PLUS_ONE = ("gemma3",)  # transformers' Gemma norms multiply by 1 + w, llama.cpp's by the weight it reads
# llama_ftype: MOSTLY_Q4_0, _Q4_1, _Q8_0, _Q2_K, _Q3_K_S, _M, _L, _Q4_K_S, _M, _Q5_K_S, _M, _Q6_K
FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q5_1": 9, "q8_0": 7, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12, "q3_k_l": 13}
FILE_TYPES |= {"q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "q3_k": 11, "q4_k": 14, "q5_k": 16}
ROLES = {"v_proj": "attn_v", "down_proj": "ffn_down", "o_proj": "attn_output"}  # the tensors mixes single out


def mix_type(mix: str, linear: str, layer: int, layers: int, gqa: int) -> str:
    """The k-quant llama.cpp gives the linear ``linear`` (its name in the block) of block ``layer``
    in a ``mix`` file, before any fallback (``kquant.FALLBACK``), for a dense model of ``layers``
    blocks with ``gqa`` query heads per key-value head."""
    base, role = MIX_BASE.get(mix, mix), ROLES.get(linear.rsplit(".", 1)[-1])
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if mix == "q2_k" and role:
        return "q4_k" if role == "attn_v" and gqa >= 4 else "q3_k"
    if mix == "q3_k_m" and role:
        first = layer < 2 if role == "attn_v" else layer < layers // 16
        return "q5_k" if first and role != "attn_output" else "q4_k"
    if mix == "q3_k_l" and role:
        return "q5_k"
    if mix in ("q4_k_m", "q5_k_m") and role in ("attn_v", "ffn_down") and more:
        return "q6_k"
    if mix == "q4_k_s" and (role == "attn_v" and layer < 4 or role == "ffn_down" and layer < layers // 8):
        return "q5_k"
    return base


# llama.cpp names a GPT-2-style tokenizer's pre-tokenizer by hashing the ids of this text
# (``get_vocab_base_pre`` in its converter); the families we write, by hash:
_CHECK_TEXT = "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"  # noqa: E501
_PRE_TOKENIZERS = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
}


class GGUFError(RuntimeError):
    """A model, recipe or export that cannot be written as the GGUF asked for."""


def file_name(gguf_type: str | None) -> str:
    return f"model-{gguf_type or 'f16'}.gguf"


def type_problem(gguf_type: str) -> str | None:
    if gguf_type not in TYPES:
        return f"GGUF type {gguf_type!r} is not one we write; choose one of {', '.join(TYPES)}"
    return None


def type_of(scheme) -> str | None:
    """The GGUF type that holds weights of ``scheme`` exactly, or None."""
    if scheme.is_kquant:
        return scheme.format
    return _legacy_type(scheme.bits, scheme.group_size, scheme.symmetric) if scheme.format == "int" else None


def _legacy_type(bits: int, group_size: int, symmetric: bool) -> str | None:
    if group_size != GROUP:
        return None
    return next((t for t, b in LEGACY.items() if (b.bits, b.symmetric) == (bits, symmetric)), None)


def only_in_gguf(scheme) -> bool:
    """Weights that a GGUF file holds but compressed-tensors does not: k-quants, and the 5-bit
    types they fall back to."""
    return scheme.is_kquant or scheme.bits == 5


def scheme_problem(gguf_type: str, bits: int, group_size, symmetric: bool) -> str | None:
    """Why weights quantized so cannot be written as ``gguf_type`` blocks, or None."""
    need = LEGACY[gguf_type]
    if (bits, group_size, symmetric) != (need.bits, GROUP, need.symmetric):
        got = f"{bits}-bit {'symmetric' if symmetric else 'asymmetric'}, group_size {group_size}"
        options = f"bits: {need.bits}, group_size: {GROUP}, symmetric: {str(need.symmetric).lower()}"
        return f"GGUF {gguf_type} needs {need.describe()} ({options}); got {got}"
    return None


STORES = frozenset({"quantized", "prune_mask"})  # the kinds of state a GGUF file holds (pruned: zeros)


def adapt(p, gguf_type: str) -> str | None:
    """Fit the recipe's pass ``p`` to a ``gguf_type`` file, or say why it cannot be: the file holds
    quantized and pruned linears whose integers match the type's blocks, and stores scales as
    float16, so the pass rounds its scales to float16 numbers (``QuantScheme.fp16_scales``)."""
    if not p.compresses or not p.leaves or p.leaves - STORES:
        return "export.format gguf holds quantized and pruned linears only; drop this pass or export compressed-tensors"
    if (spec := p.rounding) is not None:
        if gguf_type in MIX_BASE or gguf_type == "q5_1" or spec.format in kquant.TYPES:
            grid = MIX_BASE.get(gguf_type, gguf_type)
            if spec.format != grid and grid not in kquant.TYPES:
                return f"GGUF {gguf_type} has no grid of that name: drop format: {spec.format}"
            if spec.format != grid:
                return f"GGUF {gguf_type} needs the pass to round onto its grid: set format: {grid}"
            p.gguf_type = gguf_type
        elif spec.format != "int":
            return f"GGUF {gguf_type} stores integers, not {spec.format}; drop format or export compressed-tensors"
        elif problem := scheme_problem(gguf_type, spec.bits, spec.group_size, spec.symmetric):
            return problem
    p.fp16_scales = True
    return None


def family_problem(model_type: str | None, config: dict | None = None) -> str | None:
    if model_type not in ARCHES:
        return f"GGUF export knows the families {', '.join(sorted(ARCHES))}; this model is {model_type!r}"
    layer_types = (config or {}).get("layer_types")
    if ARCHES[model_type] == "gemma3" and layer_types:  # the file has no field for it
        every_sixth = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(len(layer_types))]
        if layer_types != every_sixth:
            return "llama.cpp runs Gemma-3 with full attention in every sixth layer; this model's layer_types differ"
    return None


# --- packing our integers into llama.cpp's blocks -------------------------------------------


def _fp16(t: torch.Tensor, what: str) -> np.ndarray:
    half = t.to(torch.float16)
    if not torch.equal(half.float(), t.float()):
        raise GGUFError(f"{what} are not float16 numbers, so GGUF cannot store them exactly")
    return half.numpy()


def pack_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, gguf_type: str, name: str) -> np.ndarray:
    """(rows, cols) signed integers with per-32 ``scale``/``zero`` -> (rows, bytes per row) uint8
    in llama.cpp's block layout (``block_q4_0``, ``block_q4_1``, ``block_q5_0``, ``block_q5_1``,
    ``block_q8_0``)."""
    rows, cols = q.shape
    blocks = q.reshape(rows, cols // GROUP, GROUP).to(torch.int16)
    d = _fp16(scale, f"{name}'s scales").reshape(rows, -1, 1).view(np.uint8)  # (rows, blocks, 2)
    if gguf_type == "q8_0":
        return np.concatenate([d, blocks.to(torch.int8).numpy().view(np.uint8)], axis=-1).reshape(rows, -1)
    half = 2 ** (LEGACY[gguf_type].bits - 1)
    u = (blocks + half).to(torch.uint8).numpy()  # 0..15, or 0..31
    nibbles = (u[..., :16] & 0xF) | ((u[..., 16:] & 0xF) << 4)  # byte j: weights j (low) and j + 16 (high)
    parts = [d, nibbles]
    if half == 16:  # bit j of a little-endian uint32: weight j's fifth bit
        high = ((u >> 4).astype(np.uint32) << np.arange(GROUP, dtype=np.uint32)).sum(-1, dtype=np.uint32)
        parts.insert(1, high.reshape(rows, -1, 1).astype("<u4").view(np.uint8))
    if not LEGACY[gguf_type].symmetric:
        m = -(scale.float() * (half + zero.float()))
        parts.insert(1, _fp16(m, f"{name}'s minimums (-scale * ({half} + zero))").reshape(rows, -1, 1).view(np.uint8))
    elif bool(zero.any()):
        raise GGUFError(f"{name} has zero-points; {gguf_type} stores symmetric weights only")
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _permute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: within each head, rows (0..d/2, d/2..d) -> interleaved."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``_permute_rows`` undone."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


# --- reading an export ----------------------------------------------------------------------


def codes_of(name: str, qw) -> dict[str, torch.Tensor]:
    """What an export keeps of a GGUF-only linear in ``CODES`` while it writes the file."""
    out = {f"{name}.q": qw.q, f"{name}.scale": qw.scale.float(), f"{name}.zero_point": qw.zero_point}
    if qw.scheme.is_kquant:
        out[f"{name}.super"] = qw.global_scale
    return out


class _Export:
    """The tensors of an export folder, read one at a time, and its quantized linears: those of
    its compressed-tensors config, and the GGUF-only ones kept in ``CODES`` (``types`` names their
    GGUF types)."""

    def __init__(self, folder: Path, types: dict[str, str] | None = None):
        from .compressed_tensors import Reader
        from .safetensors import Checkpoint

        self.folder = folder
        self.checkpoint = Checkpoint(folder)
        self.where = self.checkpoint.file_of
        self.shapes = self.checkpoint.shapes()
        self.config = json.loads((folder / "config.json").read_text())
        self.qconfig = self.config.get("quantization_config")
        compressed = (self.qconfig or {}).get("quant_method") == "compressed-tensors"
        self.layout = Reader(self.qconfig) if compressed else None
        self.types = types or {}
        self.codes = Checkpoint(folder / CODES) if self.types else None

    def read(self, key: str) -> torch.Tensor:
        return self.checkpoint.read([key])[key]

    def linears(self) -> list[str]:
        return (self.layout.quantized_linears(self.checkpoint) if self.layout else []) + list(self.types)

    def type_of(self, name: str) -> str | None:
        """The GGUF type of a quantized linear's blocks (None: no type holds them)."""
        return self.types[name] if name in self.types else _legacy_type(*self.scheme_of(name))

    def scheme_of(self, name: str):
        """(bits, group_size, symmetric) of a quantized linear, from the compressed-tensors config."""
        scheme = self.layout.scheme_for(name) if self.layout else None
        if scheme is None:
            raise GGUFError(f"{name}: the export's quantization_config names no scheme for it")
        w = scheme.weights
        if w.type != "int":
            raise GGUFError(f"{name} stores {w.num_bits}-bit float values; GGUF holds integers: export an int recipe")
        return w.num_bits, w.group_size or -1, w.symmetric

    def weight_shape(self, name: str) -> list[int]:
        if f"{name}.weight_packed" in self.where:
            return self.read(f"{name}.weight_shape").tolist()
        return self.shapes[f"{name}.weight"]

    def integers(self, name: str) -> tuple[torch.Tensor, ...]:
        """(q, scale, zero) of a quantized linear: signed integers (out, in) and (out, groups) each,
        and for a k-quant its super-block scales."""
        if name in self.types:
            keys = ["q", "scale", "zero_point"] + (["super"] if self.types[name] in kquant.TYPES else [])
            found = self.codes.read([f"{name}.{k}" for k in keys])
            return tuple(found[f"{name}.{k}"] for k in keys)
        qw = self.layout.integers(self.checkpoint, name)
        return qw.q, qw.scale, qw.zero_point


# --- metadata -------------------------------------------------------------------------------


def _rope_theta(config: dict) -> float | None:
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    return rope.get("rope_theta", config.get("rope_theta"))


def _add_hyperparameters(writer, config: dict, arch: str, gguf_type: str | None) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(config.get("_name_or_path") or arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    if (theta := _rope_theta(config)) is not None:
        writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":  # as llama.cpp's converter: local layers' rope base and attention scale are its defaults
        if config.get("sliding_window") and "sliding_attention" in (config.get("layer_types") or []):
            writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_file_type(FILE_TYPES[gguf_type] if gguf_type else 1)  # 1: mostly F16
    writer.add_quantization_version(2)  # GGML_QNT_VERSION


def _sentencepiece(folder: Path) -> dict | None:
    """The tokenizer.json of a SentencePiece-style BPE (``▁`` for spaces, bytes as ``<0xNN>``: Gemma,
    Llama-2), or None for a byte-level one."""
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    spec = json.loads(path.read_text())
    model = spec.get("model") or {}
    return spec if model.get("type") == "BPE" and model.get("byte_fallback") else None


def _add_sentencepiece(writer, folder: Path, spec: dict, vocab_size: int) -> None:
    """A SentencePiece vocabulary as llama.cpp's ``llama`` tokenizer reads it. Its merges run by
    score, highest first; a token's score here is minus the rank of the first merge that makes it,
    so llama.cpp merges in the order of the tokenizer's own merge list."""
    import gguf

    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    first = {}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        first.setdefault(left + right, rank)
    by_id = {i: t for t, i in vocab.items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    tokens, scores, types = [], [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            special = added[i]["special"]
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            scores.append(-1000.0)
        elif i in by_id:
            token = by_id[i]
            tokens.append(token)
            byte = len(token) == 6 and token.startswith("<0x") and token.endswith(">")
            types.append(gguf.TokenType.BYTE if byte else gguf.TokenType.NORMAL)
            scores.append(0.0 if byte else -float(first.get(token, len(merges))))
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            scores.append(-1000.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(False)
    gguf.SpecialVocab(folder, load_merges=False, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _add_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's converter writes it: GPT-2-style (byte-level BPE), or SentencePiece."""
    import gguf
    from transformers import AutoTokenizer

    if (spec := _sentencepiece(folder)) is not None:
        return _add_sentencepiece(writer, folder, spec, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise GGUFError(f"the tokenizer has ids up to {max(vocab.values())} but the model only {vocab_size} rows")
    checksum = sha256(str(tokenizer.encode(_CHECK_TEXT)).encode()).hexdigest()
    pre = _PRE_TOKENIZERS.get(checksum)
    if pre is None:
        print(
            "[compress] warning: llama.cpp will not recognise this tokenizer's pre-tokenizer; it uses its default one"
        )
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    added_decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif token in added:
            special = added_decoder[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
            tokens.append(token)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


# --- the file -------------------------------------------------------------------------------


@dataclass
class _Entry:
    """One tensor of the file: its GGUF name, shape, type and how to produce its data."""

    name: str
    source: str  # the export's tensor, or quantized linear's name
    quantized: bool
    gguf_type: str  # q4_0 / q4_1 / q8_0 / f16 / f32


def _plan(export: _Export, tensor_map, embedding: str) -> list[_Entry]:
    linears = set(export.linears())
    entries = []
    keys = [k for k in export.where if k.rsplit(".", 1)[0] not in linears] + [f"{n}.weight" for n in linears]
    for key in sorted(keys):
        gguf_name = tensor_map.get_name(key, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFError(f"no llama.cpp name for the tensor {key}")
        owner = key.rsplit(".", 1)[0]
        if owner in linears:
            gguf_type = export.type_of(owner)
            if gguf_type is None:
                bits, group, _ = export.scheme_of(owner)
                kinds = "; ".join(f"{t}: {b.describe()}" for t, b in LEGACY.items())
                raise GGUFError(f"{owner}: {bits}-bit weights in groups of {group} fit no GGUF type we write ({kinds})")
            entries.append(_Entry(gguf_name, owner, True, gguf_type))
        elif len(export.shapes[key]) == 1:
            entries.append(_Entry(gguf_name, key, False, "f32"))
        elif gguf_name.startswith(("token_embd", "output.")) and embedding == "q8_0":
            entries.append(_Entry(gguf_name, key, False, "q8_0"))
        else:
            t = export.read(key).float()
            entries.append(_Entry(gguf_name, key, False, "f16" if torch.equal(t.half().float(), t) else "f32"))
    return entries


_GGML = {t: t.upper() for t in [*LEGACY, *kquant.TYPES, "f16", "f32"]}


def _data(export: _Export, entry: _Entry, config: dict, arch: str) -> np.ndarray:
    from ..quant import QuantScheme, quantize_weight

    permute = None
    if arch in PERMUTED and entry.name.endswith(("attn_q.weight", "attn_q.bias")):
        permute = config["num_attention_heads"]
    elif arch in PERMUTED and entry.name.endswith(("attn_k.weight", "attn_k.bias")):
        permute = config.get("num_key_value_heads") or config["num_attention_heads"]
    if entry.quantized:
        integers = export.integers(entry.source)
        if permute:
            integers = [_permute_rows(t, permute) for t in integers]
        if export.types.get(entry.source) in kquant.TYPES:  # a grid with super-block scales (q4_1: a float minimum)
            return gguf_kquants.pack(*integers, entry.gguf_type)
        return pack_blocks(*integers, entry.gguf_type, entry.source)
    t = export.read(entry.source).float()
    if arch in NORM_PLUS_ONE and entry.source.endswith("norm.weight"):
        t = t + 1
    if permute:
        t = _permute_rows(t, permute)
    if entry.gguf_type == "q8_0":  # an embedding rounded as llama.cpp's Q8_0 would (not evaluated by us)
        qw = quantize_weight(t, QuantScheme(8, GROUP, True, fp16_scales=True), torch.float32)
        return pack_blocks(qw.q, qw.scale, qw.zero_point, "q8_0", entry.source)
    return t.numpy().astype(np.float16 if entry.gguf_type == "f16" else np.float32)


def _info(export: _Export, entry: _Entry) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, numpy dtype and bytes of an entry's data, without computing it."""
    import gguf

    if entry.quantized:
        shape = export.weight_shape(entry.source)
    else:
        shape = export.shapes[entry.source]
    if entry.gguf_type in ("f16", "f32"):
        dtype = np.dtype(np.float16 if entry.gguf_type == "f16" else np.float32)
        return tuple(shape), dtype, int(np.prod(shape)) * dtype.itemsize
    block, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, _GGML[entry.gguf_type])]
    row_bytes = shape[-1] // block * size
    return (*shape[:-1], row_bytes), np.dtype(np.uint8), int(np.prod(shape[:-1])) * row_bytes


def write(folder: str | Path, gguf_type: str | None, out: str | Path, embedding: str = "dense", types=None) -> Path:
    """Write ``out`` (a .gguf file) from the export in ``folder``: its quantized linears as
    ``gguf_type`` blocks (None: an export with no quantized linear, written F16/F32), or for a
    k-quant, the type it falls back to where it cannot go; ``types``: the GGUF-only linears kept in
    ``folder / CODES`` and their types. Written beside ``out`` and renamed at the end."""
    import gguf

    folder, out = Path(folder), Path(out)
    export = _Export(folder, types)
    config = export.config
    if problem := family_problem(config.get("model_type"), config):
        raise GGUFError(problem)
    if (folder / "adapter").is_dir():
        raise GGUFError(f"{folder} carries a LoRA adapter, which GGUF files do not hold; merge it (merge: true)")
    if (export.qconfig or {}).get("quant_method") == "bitsandbytes":
        raise GGUFError(
            f"{folder} holds bitsandbytes NF4/FP4 weights, which GGUF has no type for; use an integer recipe"
        )
    arch = ARCHES[config["model_type"]]
    model_arch = getattr(gguf.MODEL_ARCH, arch.upper())
    tensor_map = gguf.get_tensor_name_map(model_arch, config["num_hidden_layers"])
    entries = _plan(export, tensor_map, embedding)
    if gguf_type is not None and not any(e.quantized for e in entries):
        raise GGUFError(
            f"{folder} holds no quantized linear to write as {gguf_type} (an export of k-quants keeps its "
            "integers in its own GGUF file only: use that file)"
        )
    if gguf_type in LEGACY and not export.types:  # a k-quant mix holds what the recipe's rounding chose per layer
        if wrong := [e for e in entries if e.quantized and e.gguf_type != gguf_type]:
            raise GGUFError(f"{wrong[0].source}: {scheme_problem(gguf_type, *export.scheme_of(wrong[0].source))}")
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(partial, arch)
    try:
        _add_hyperparameters(writer, config, arch, gguf_type)
        _add_tokenizer(writer, folder, config["vocab_size"])
        for e in entries:  # every tensor is listed before the data
            shape, dtype, nbytes = _info(export, e)
            raw = getattr(gguf.GGMLQuantizationType, _GGML[e.gguf_type]) if dtype == np.uint8 else None
            writer.add_tensor_info(e.name, shape, dtype, nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for e in entries:
            writer.write_tensor_data(_data(export, e, config, arch))
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out
