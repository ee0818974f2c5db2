"""The decoder: one propose–verify loop over a fast engine, and the methods that propose.

- ``engine``: our forward over a loaded model's weights with a preallocated KV cache and
  fixed-shape steps (optionally compiled), each linear on the kernel measured fastest here.
- ``kernels``: the weight formats a linear can decode from (fp32, bf16, int8, int4, W8A8).
- ``loop``: greedy decoding and ``speculate`` (greedy acceptance, the rejection rule).
- ``prompt_lookup``, ``datastore``: candidates copied from the context or earlier outputs.
- ``draft``: a draft model, a compressed copy of the target, or a subset of its layers.
- ``tree``: token trees verified in one step (lookahead's guesses, an EAGLE head's drafts).
- ``eagle``: an EAGLE head drafting from the target's own states, as a chain or a tree.
- ``lookahead``: Jacobi guesses and an n-gram pool in one forward (Fu et al. 2024).
- ``early_exit``: CALM's confidence-based early exit (lossy).
"""

from .draft import (
    DraftModel,
    LookupThenDraft,
    candidate_subsets,
    choose_layers,
    format_layers,
    layer_count,
    layer_subset,
    parse_layers,
    save_layers,
    saved_layers,
    search_layers,
)
from .loop import (
    DecodeError,
    DecodeResult,
    HFRunner,
    Sampling,
    accept_greedy,
    accept_sampled,
    common_prefix,
    greedy,
    speculate,
)
from .prompt_lookup import PromptLookup, default_token_cost

__all__ = [
    "DecodeError",
    "DecodeResult",
    "DraftModel",
    "HFRunner",
    "LookupThenDraft",
    "PromptLookup",
    "Sampling",
    "accept_greedy",
    "accept_sampled",
    "candidate_subsets",
    "choose_layers",
    "format_layers",
    "common_prefix",
    "default_token_cost",
    "greedy",
    "layer_count",
    "layer_subset",
    "parse_layers",
    "save_layers",
    "saved_layers",
    "search_layers",
    "speculate",
]
