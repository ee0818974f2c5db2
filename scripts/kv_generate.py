"""Greedy generation over a ~1,000-token prompt with the dense and the KIVI-quantized KV cache.

    python scripts/kv_generate.py [--model smollm2-135m] [--new-tokens 64]

Prints a markdown table: scheme, KV bytes per token (scales and minima included), tokens
the output shares with the dense output before the first difference, and the output.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from compress import data, models
from compress.kv_quant import KIVICache, KVScheme, cache_dims, dense_bytes_per_token

SCHEMES = [KVScheme(8, 32, 128), KVScheme(4, 32, 128), KVScheme(2, 32, 128), KVScheme(2, 32, 0)]


def prompt_ids(tokenizer, tokens: int) -> torch.Tensor:
    """A wikitext-2 test passage of about ``tokens`` tokens, with a request to summarise it."""
    text = data.load_text("wikitext2", "test")
    passage = tokenizer.decode(data.tokenize(tokenizer, text)[2000 : 2000 + tokens])
    messages = [{"role": "user", "content": f"{passage}\n\nSummarise the text above in two sentences."}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()

    loaded = models.load(args.model, torch.bfloat16)
    model, tokenizer = models.for_compute(loaded.model, torch.device("cpu")), loaded.tokenizer
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    dims = cache_dims(model.config)
    print(f"command: python {' '.join(sys.argv)}")
    print(
        f"model: {args.model}; prompt {ids.shape[1]} tokens; {args.new_tokens} new tokens, greedy; "
        f"KV bytes per token for bf16 storage\n"
    )
    print("| cache | KV bytes/token | same tokens as dense | s | output |")
    print("|---|---|---|---|---|")
    dense = None
    for scheme in [None, *SCHEMES]:
        cache = None if scheme is None else KIVICache(scheme, dims[0])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, past_key_values=cache)
        seconds = time.perf_counter() - start
        new = out[0, ids.shape[1] :]
        dense = new if dense is None else dense
        same = next((i for i, (a, b) in enumerate(zip(new.tolist(), dense.tolist())) if a != b), len(new))
        size = dense_bytes_per_token(*dims) if scheme is None else scheme.bytes_per_token(*dims)
        text = tokenizer.decode(new, skip_special_tokens=True).replace("\n", " ").replace("|", "\\|")
        name = "bf16 (dense)" if scheme is None else scheme.describe()
        print(f"| {name} | {size:,.0f} | {same}/{len(new)} | {seconds:.1f} | {text} |", flush=True)


if __name__ == "__main__":
    main()
