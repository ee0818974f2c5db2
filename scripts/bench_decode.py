"""Decode speed of each method against plain greedy, on grounded and open prompts; a markdown table.

    python scripts/bench_decode.py [--model smollm2-135m] [--new-tokens 128] [--draft DIR]

Two prompt sets of 8, through the chat template, greedy, batch 1: "grounded" (a ~300-token
wikitext-2 test passage and a request to repeat or summarise it: the output reuses the
input) and "open" (open-ended requests). Per method: tokens/s, speedup against our plain
greedy loop and against transformers' ``generate``, new tokens per target forward, and the
share of prompts whose output is identical to plain greedy. Every method runs on the same
model object (fp32 compute on the CPU), one prompt at a time, after one warm-up prompt; each
prompt goes through every method before the next, so a machine whose speed drifts during the
run (up to 25% between runs here) slows every method alike.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from compress import data, models
from compress.decode import early_exit, kernels
from compress.decode.datastore import Datastore
from compress.decode.lookahead import lookahead
from compress.arch import decoder_layers
from compress.decode import (DraftModel, PromptLookup, default_token_cost, greedy, layer_subset, parse_layers,
                             search_layers, speculate)

OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a weekend trip in the mountains.",
    "What are the pros and cons of working from home?",
    "Write a poem about the sea at night.",
    "How do I make a good cup of coffee without a machine?",
    "Describe a day in the life of a medieval blacksmith.",
    "What should I consider when adopting a dog?",
]


# Other requests, whose greedy outputs fill the datastore (--datastore); none opens with the
# first three words of an OPEN prompt, so the store cannot hold a benchmark request's template.
STORE_PROMPTS = Path(__file__).with_name("datastore_prompts.txt")


def chat(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def prompts(tokenizer) -> dict[str, list[torch.Tensor]]:
    ids = data.tokenize(tokenizer, data.load_text("wikitext2", "test"))
    asks = ["Repeat the text above word for word.", "Summarise the text above."]
    grounded = [f"{tokenizer.decode(ids[5000 + 1500 * i : 5300 + 1500 * i])}\n\n{asks[i % 2]}" for i in range(8)]
    return {"grounded": [chat(tokenizer, t) for t in grounded], "open": [chat(tokenizer, t) for t in OPEN]}


def datastore(path: str, model, tokenizer, new_tokens: int, eos: set[int], device) -> Datastore:
    """The store at ``path``, or one filled with greedy outputs on STORE_PROMPTS and saved there."""
    store = Datastore.load(path, data.tokenizer_fingerprint(tokenizer))
    if len(store) == 0:
        asks = STORE_PROMPTS.read_text().splitlines()
        openings = {" ".join(text.lower().split()[:3]) for text in OPEN}
        if shared := [a for a in asks if " ".join(a.lower().split()[:3]) in openings]:
            sys.exit(f"{STORE_PROMPTS} must not open like a benchmark prompt: {shared}")
        for text in tqdm(asks, desc="datastore: greedy outputs on other requests", unit="request"):
            store.add(greedy(model, chat(tokenizer, text).to(device), new_tokens, eos).tokens)
        store.save(path)
    return store


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {torch.get_num_threads()} threads, {gpu}, torch {torch.__version__}"


def run_hf(model, prompt, new_tokens, eos, **kwargs):
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    tokens = out[0, prompt.shape[1]:].tolist()
    return tokens, time.perf_counter() - start, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft", help="a draft checkpoint with the same tokenizer (e.g. an export of ours)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--exit-layer", type=int, default=8,
                        help="early-exit drafting (ours and transformers') drafts with the layers below this one")
    parser.add_argument("--w4", help="a W4 export (e.g. of awq-w4): greedy with its weights dequantized to fp32, "
                                      "and on torch's int4 CPU kernel")
    parser.add_argument("--w8a8", help="a W8A8 export (e.g. of smoothquant-w8a8): greedy with fake-quantized "
                                        "activations (as evaluated), and on torch's int8 matmul")
    parser.add_argument("--self-layers", help="also self-speculate with these layers (e.g. 0-14,16,18), or auto: "
                                              "searched for speed on two calibration prompts")
    parser.add_argument("--lookahead", nargs="*", default=["15,5,15", "3,3,5"], metavar="W,N,G",
                        help="lookahead decoding rows: window, n-gram size, guesses (default: the paper's and ours)")
    parser.add_argument("--linear", choices=["onednn", "mkl"], default="onednn",
                        help="fp32 linears of every model: oneDNN for multi-token forwards (kernels.use_onednn), "
                             "or torch's default (MKL)")
    parser.add_argument("--datastore", metavar="FILE.json",
                        help="also prompt lookup with a datastore of the model's greedy outputs on the requests in "
                             "scripts/datastore_prompts.txt (built and saved here if the file is missing; fixed "
                             "during the run)")
    parser.add_argument("--sets", nargs="*", default=["grounded", "open"], choices=["grounded", "open"])
    parser.add_argument("--only", nargs="*", help="run only the methods whose name contains one of these words "
                                                  "(both greedy rows always run: they are the references)")
    args = parser.parse_args()

    device = models.pick_device(args.device)
    loaded = models.load(args.model, torch.bfloat16)
    model, tokenizer = models.for_compute(loaded.model, device), loaded.tokenizer

    def linears(m):  # before any layer-subset view is taken: views share the swapped modules
        if args.linear == "onednn" and device.type == "cpu":
            kernels.use_onednn(m)
        return m

    model = linears(model)
    eos = set(tokenizer.convert_tokens_to_ids([tokenizer.eos_token])) | set(
        [model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int)
        else model.generation_config.eos_token_id or [])
    n, cost = args.new_tokens, default_token_cost(device)
    methods = {
        "greedy (ours)": lambda p: _ours(greedy(model, p, n, eos)),
        "greedy (transformers generate)": lambda p: run_hf(model, p, n, eos),
        "prompt lookup (transformers, 10)": lambda p: run_hf(model, p, n, eos, prompt_lookup_num_tokens=10),
        "prompt lookup, every match (ours, k=10)":
            lambda p: _ours(speculate(model, p, n, PromptLookup(), k=10, eos=eos)),
        f"prompt lookup, token cost {cost} (ours, k=10)":
            lambda p: _ours(speculate(model, p, n, PromptLookup(token_cost=cost), k=10, eos=eos)),
        f"early-exit drafting (transformers, layer {args.exit_layer})":
            lambda p: run_hf(model, p, n, eos, assistant_early_exit=args.exit_layer),
        f"early-exit drafting (ours, layer {args.exit_layer})":
            lambda p: _ours(speculate(model, p, n, DraftModel(first_layers), k=8, eos=eos)),
    }
    if args.datastore:
        store = datastore(args.datastore, model, tokenizer, n, eos, device)
        methods[f"prompt lookup + datastore of {len(store)} outputs, token cost {cost} (ours, k=10)"] = \
            lambda p: _ours(speculate(model, p, n, PromptLookup(token_cost=cost, store=store), k=10, eos=eos))
    for spec in args.lookahead:
        w, ng, g = map(int, spec.split(","))
        methods[f"lookahead (ours, W={w} N={ng} G={g})"] = \
            lambda p, w=w, ng=ng, g=g: _ours(lookahead(model, p, n, w, ng, g, eos=eos))
    first_layers = layer_subset(model, list(range(args.exit_layer)))
    if args.self_layers:
        count = len(decoder_layers(model))
        if args.self_layers == "auto":
            ids, _ = data.calibration_batches(model, tokenizer, "wikitext2", 2, 64, seed=0)
            keep, _ = search_layers(model, [row.unsqueeze(0).to(device) for row in ids])
        else:
            keep = parse_layers(args.self_layers, count)
        skipping = layer_subset(model, keep)
        methods[f"layer-skip self-speculation (ours, {len(keep)}/{count} layers)"] = \
            lambda p: _ours(speculate(model, p, n, DraftModel(skipping), k=8, eos=eos))
    if args.draft:
        draft = linears(models.for_compute(models.load(args.draft, torch.bfloat16).model, device))
        methods["draft model (ours)"] = lambda p: _ours(speculate(model, p, n, DraftModel(draft), k=6, eos=eos))
        methods["assisted (transformers, same draft)"] = lambda p: run_hf(model, p, n, eos, assistant_model=draft)

    exits = early_exit.default_exits(len(decoder_layers(model)))
    calibration, _ = data.calibration_batches(model, tokenizer, "wikitext2", 2, 256, seed=0)
    found = early_exit.calibrate(model, calibration, exits, target=0.9)
    methods[f"early exit, lossy (ours, softmax ≥ {found['threshold']:.2f} at layers {exits})"] = \
        lambda p: _ours(early_exit.early_exit_greedy(model, p, n, found["threshold"], exits, eos=eos))
    if args.w4:
        dequantized = models.for_compute(models.load(args.w4, torch.bfloat16).model, device)
        int4 = copy.deepcopy(dequantized)
        kernels.attach_from_export(int4, args.w4)
        swapped = kernels.use_int4_kernel(int4)
        dequantized, int4 = linears(dequantized), linears(int4)
        methods["greedy, W4 export dequantized to fp32 (ours)"] = lambda p: _ours(greedy(dequantized, p, n, eos))
        methods[f"greedy, W4 export on the int4 kernel, {swapped} linears (ours)"] = \
            lambda p: _ours(greedy(int4, p, n, eos))
        methods["prompt lookup, W4 export on the int4 kernel (ours, k=10)"] = \
            lambda p: _ours(speculate(int4, p, n, PromptLookup(), k=10, eos=eos))
    if args.w8a8:
        fake = models.for_compute(models.load(args.w8a8, torch.bfloat16).model, device)
        int8 = copy.deepcopy(fake)
        swapped8 = kernels.use_int8_kernel(int8)
        fake, int8 = linears(fake), linears(int8)
        methods["greedy, W8A8 export, fake-quantized in fp32 (ours)"] = lambda p: _ours(greedy(fake, p, n, eos))
        methods[f"greedy, W8A8 export on _int_mm, {swapped8} linears (ours)"] = lambda p: _ours(greedy(int8, p, n, eos))

    if args.only:
        methods = {k: v for k, v in methods.items()
                   if k.startswith("greedy (") or any(word in k for word in args.only)}
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {machine()}")
    print(f"model: {args.model}, computed in {next(model.parameters()).dtype}, fp32 linears on {args.linear}; "
          f"{n} new tokens, greedy, batch 1\n")
    sets = {name: [p.to(device) for p in ps[: args.prompts]] for name, ps in prompts(tokenizer).items()
            if name in args.sets}
    methods["greedy (ours)"](next(iter(sets.values()))[0][:, :32])  # warm-up
    rows = []
    for set_name, ps in sets.items():
        outputs_of = {name: [] for name in methods}
        seconds_of, forwards_of = dict.fromkeys(methods, 0.0), dict.fromkeys(methods, 0)  # forwards: ours only
        for i, p in enumerate(ps):  # every method on one prompt, then the next: a drifting machine hits all alike
            for name, fn in methods.items():
                out, s, f = fn(p)
                outputs_of[name].append(out)
                seconds_of[name] += s
                forwards_of[name] += f or 0
            print(f"{set_name}: prompt {i + 1}/{len(ps)} done", file=sys.stderr, flush=True)
        results = {name: (outputs_of[name], sum(map(len, outputs_of[name])) / seconds_of[name], forwards_of[name])
                   for name in methods}
        reference, ours, hf = results["greedy (ours)"][0], results["greedy (ours)"][1], \
            results["greedy (transformers generate)"][1]
        for name, (outputs, rate, forwards) in results.items():
            tokens = sum(map(len, outputs))
            rows.append([set_name, name, f"{rate:.1f}", f"{rate / ours:.2f}×", f"{rate / hf:.2f}×",
                         f"{tokens / forwards:.2f}" if forwards else "",
                         f"{sum(a == b for a, b in zip(outputs, reference))}/{len(ps)}"])
    head = ["prompts", "method", "tokens/s", "vs our greedy", "vs transformers greedy", "tokens/forward",
            "same as greedy"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _ours(result):
    return result.tokens, result.seconds, result.forwards - 1


if __name__ == "__main__":
    main()
