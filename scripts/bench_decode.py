"""Decode speed of every method against transformers' eager greedy; one markdown row per method as
soon as it is measured.

    python scripts/bench_decode.py [--model smollm2-135m] [--prompts 8] [--new-tokens 128]
        [--w4 DIR] [--w4-kernel auto|int4|dense] [--w8a8 DIR] [--fp8 DIR] [--kivi DIR] [--eagle DIR ...]
        [--eagle-threshold P] [--only WORD ...] [--skip WORD ...]

Two prompt sets of 8 through the chat template, greedy, batch 1: "grounded" (a ~300-token
wikitext-2 test passage and a request to repeat or summarise it: the output reuses the input)
and "open" (open-ended requests). Rows: transformers' eager greedy (fp32, as our evaluation
computes, and bf16), transformers' static cache + ``torch.compile`` as its docs recommend, our
engine eager and compiled (kernels chosen by timing), W4 (an export given with ``--w4``, else
the model rounded to W4 in memory: the same kernel and bytes; with the exact lm_head, with
``--lm-head argmax`` on a CPU with our kernels, compared token for token with the exact head's
row, and with a lossy int4 lm_head), W4A8 on a CPU with our kernels
(the same W4 weights, each step's rows rounded to int8: ``--kernel int4-a8``), W8A8 (``--w8a8``), FP8
weights and inputs on ``torch._scaled_mm`` (``--fp8``: Hopper's FP8 tensor cores; on a CPU torch's
slow reference loop, there to check it runs, not for speed), prompt lookup,
a W4 copy of the model drafting for it (alone and behind prompt lookup; both speculative
methods also on the compiled target, whose verify steps round as its one-token steps), lookahead, early exit
(lossy), EAGLE heads (``--eagle``: eager, compiled, as a tree, behind prompt lookup, and drafting for the
``--w4`` export), a KIVI cache (``--kivi``: an export of ``kv-int4``; the engine reproduces KIVI's
numerics at dense speed, not its memory), and llama.cpp on the bundled
GGUF when llama-cpp-python is installed. Columns: tokens/s; × transformers' eager fp32 greedy;
new tokens per target forward; outputs identical to transformers' bf16 greedy (the checkpoint's
own precision; our bf16 engine is token-identical to it, so lossless rows on it match too);
outputs identical to our greedy on the same engine (eager rows: ours eager; compiled rows: ours
compiled: what lossless speculation must reproduce); the
seconds of the first compiled step (compiling, or "loaded" when an earlier run left the
compiled package on disk); weight bytes read per token; that traffic as a share of the
machine's measured read bandwidth (printed in the header); and for our rows the same for the
steps alone, the prompt's forward timed apart (a prompt is bound by arithmetic, a step by its
weight reads: the roofline is the steps'). On a GPU everything runs in bf16, the reference is
transformers' eager bf16 greedy, our greedy runs eager and on CUDA graphs, and "= ours greedy"
compares with the graph greedy that speculation must reproduce. A row that fails prints why
and is dropped; the others go on. Every method runs on a prompt before the next prompt starts, so a machine whose speed
drifts during the run (this project's shared CPUs do, by up to 2× between runs) slows all
methods alike; rows are printed at the end of each set, a progress line after each prompt.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from compress import data, kv_quant, machine, models
from compress.decode import DraftModel, early_exit, greedy, native
from compress.decode.engine import Engine
from compress.decode.loop import sync
from compress.decode.methods import METHODS, Settings
from compress.formats import eagle_head
from compress.formats.compressed_tensors import attach_integers

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

# Other requests, whose greedy outputs can fill a prompt-lookup datastore (replay_prompt_lookup.py);
# none opens with the first three words of an OPEN prompt.
STORE_PROMPTS = Path(__file__).resolve().parent.parent / "calibration" / "chat-prompts.txt"


def chat(tokenizer, text: str) -> torch.Tensor:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def prompts(tokenizer) -> dict[str, list[torch.Tensor]]:
    ids = data.tokenize(tokenizer, data.load_text("wikitext2", "test"))
    asks = ["Repeat the text above word for word.", "Summarise the text above."]
    grounded = [f"{tokenizer.decode(ids[5000 + 1500 * i : 5300 + 1500 * i])}\n\n{asks[i % 2]}" for i in range(8)]
    return {"grounded": [chat(tokenizer, t) for t in grounded], "open": [chat(tokenizer, t) for t in OPEN]}


def datastore(path: str, model, tokenizer, new_tokens: int, eos: set[int], device):
    """The store at ``path``, or one filled with greedy outputs on STORE_PROMPTS and saved there."""
    from tqdm import tqdm

    from compress.decode.datastore import Datastore

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


def read_bandwidth(device: torch.device, megabytes: int = 512, passes: int = 10) -> float:
    """GB/s of summing a buffer far larger than the caches (the pages touched first): the fastest of
    ``passes`` passes. Neighbours on a shared CPU slow a pass by up to a third, and a probe that
    caught them once put decode steps above 100% of the bandwidth: hence the fastest pass."""
    buffer = torch.randn(megabytes * 2**20 // 4, device=device)
    buffer.sum()
    sync(device)
    best = 0.0
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        sync(device)
        best = max(best, buffer.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def run_hf(model, prompt, new_tokens, **kwargs):
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    return out[0, prompt.shape[1] :].tolist(), time.perf_counter() - start, None, 0.0


def ours(result):
    return result.tokens, result.seconds, result.forwards - 1, result.prompt_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per set")
    parser.add_argument("--sets", nargs="*", default=["grounded", "open"], choices=["grounded", "open"])
    parser.add_argument("--w4", help="a W4 export (e.g. of rtn-w4 or awq-w4); default: the model rounded in memory")
    parser.add_argument("--w4-kernel", default="auto", help="the W4 rows' --kernel (auto: the fastest measured)")
    parser.add_argument("--w8a8", help="a W8A8 export (of smoothquant-w8a8)")
    parser.add_argument("--fp8", help="an FP8 export (of fp8-dynamic or fp8), run on torch._scaled_mm")
    parser.add_argument("--kivi", help="an export with a KIVI cache (of kv-int4)")
    parser.add_argument(
        "--eagle",
        nargs="*",
        default=[],
        help="exports holding an EAGLE head (eagle/, of the eagle-head or best-w4-eagle recipe): each drafts "
        "for the model, and for the --w4 export when one is given",
    )
    parser.add_argument("--eagle-threshold", type=float, default=0.2, help="the head drafts on while this sure")
    parser.add_argument("--exit-layer", type=int, default=8)
    parser.add_argument(
        "--only",
        nargs="*",
        help="run only the rows whose name contains one of these words "
        "(the transformers eager rows always run: they are the references)",
    )
    parser.add_argument("--skip", nargs="*", default=[], help="skip the rows whose name contains one of these words")
    args = parser.parse_args()

    device = models.pick_device("auto")
    cuda = device.type == "cuda"
    loaded = models.load(args.model, torch.bfloat16)
    tokenizer, hf_bf16 = loaded.tokenizer, loaded.model
    # on the CPU our evaluation computes in fp32 and transformers' fp32 greedy is the reference;
    # on a GPU everything runs in the checkpoint's bf16
    hf_fp32 = None if cuda else models.for_compute(copy.deepcopy(hf_bf16), device)
    hf_bf16 = hf_bf16.to(device)
    base = hf_bf16 if cuda else hf_fp32
    reference_name = f"transformers eager greedy, {'bf16' if cuda else 'fp32'}"
    eos = set(tokenizer.convert_tokens_to_ids([tokenizer.eos_token])) | set(
        [hf_bf16.generation_config.eos_token_id]
        if isinstance(hf_bf16.generation_config.eos_token_id, int)
        else hf_bf16.generation_config.eos_token_id or []
    )
    n = args.new_tokens
    bandwidth = read_bandwidth(device)
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"machine: {machine.describe()}; read bandwidth {bandwidth:.1f} GB/s ({device.type})")
    print(f"model: {args.model}; {n} new tokens, greedy, batch 1, {args.prompts} prompts per set\n", flush=True)

    def wanted(name: str) -> bool:
        return (not args.only or any(w in name for w in args.only)) and not any(w in name for w in args.skip)

    # Each row: name -> setup() returning (run, bytes, compile s), where
    # run(prompt) -> (tokens, seconds, forwards, prompt seconds).
    # Setups run lazily, so a skipped row costs nothing and a row's build time is not its speed.
    rows = {}

    def hf_row(model, bytes_per_token, **kw):
        return lambda: (lambda p: run_hf(model, p, n, **kw), bytes_per_token, None)

    engines = {}  # rows with the same engine settings share one engine (and one compile)

    def shared_engine(model, **kw) -> Engine:
        key = (id(model), tuple(sorted(kw.items())))
        if key not in engines:
            engines[key] = Engine(model, max_len=1024, **kw)
            if engines[key].compiled is not None:
                greedy(engines[key], sets_[next(iter(sets_))][0], 4)  # the first call compiles
        return engines[key]

    def engine_row(model, method="greedy", w4_draft=False, k=8, head=None, **kw):
        """A row of ``methods.METHODS[method]`` on our engine (with a W4 copy of the model drafting,
        or an EAGLE head)."""

        def setup():
            engine = shared_engine(model, **kw)
            print(f"  [{engine.describe()}; {engine.step_tokens}-token verify steps]", file=sys.stderr, flush=True)
            drafter = Engine(model, quantize="w4", max_len=1024) if w4_draft else None
            run_method = METHODS[method].run
            threshold = args.eagle_threshold if head is not None else 0.4

            def run(p):
                draft = DraftModel(drafter, 0.4) if drafter is not None else None  # a fresh cache per prompt
                settings = Settings(eos=eos, k=k, draft=draft, guesses=4, head=head, model=model, threshold=threshold)
                return ours(run_method(engine, p, n, settings))

            compiled = engine.compile_seconds or ("failed: ran eager" if kw.get("compile") and not cuda else None)
            if compiled and engine.compiled is not None and engine.compiled.built is False:
                compiled = f"{compiled:.0f} (loaded)"
            return run, engine.weight_bytes(), compiled

        return setup

    def hf_static_compiled():
        model = copy.deepcopy(hf_bf16)
        model.generation_config.cache_implementation = "static"
        if not cuda:  # on a GPU, generate compiles the static-cache forward itself (wrapping it too fails)
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        start = time.perf_counter()
        run_hf(model, sets_[next(iter(sets_))][0], 4)
        return (lambda p: run_hf(model, p, n)), bf16_bytes, time.perf_counter() - start

    bf16_bytes = sum(m.weight.numel() for m in hf_bf16.modules() if isinstance(m, torch.nn.Linear)) * 2
    if not cuda:
        rows["transformers eager greedy, fp32"] = hf_row(hf_fp32, 2 * bf16_bytes)
    rows["transformers eager greedy, bf16"] = hf_row(hf_bf16, bf16_bytes)
    ours_name = "ours greedy, CUDA graphs" if cuda else "ours greedy, eager"  # what speculation must reproduce
    rows["ours greedy, eager"] = engine_row(base, graphs=False) if cuda else engine_row(base)
    if cuda:  # the engine does not combine compiling with its CUDA graphs yet
        rows["ours greedy, CUDA graphs"] = engine_row(base)
        rows["ours greedy, CUDA graphs of 1 row (unpadded)"] = engine_row(base, step_rows=1)
    else:
        rows["ours greedy, compiled"] = engine_row(base, compile=True)
    w4, how = dict(compile=not cuda, kernel=args.w4_kernel), "CUDA graphs" if cuda else "compiled"
    if args.w4:
        w4_model = models.for_compute(models.load(args.w4, torch.bfloat16).model, device)
        attach_integers(w4_model, args.w4)
        rows[f"ours W4 greedy ({Path(args.w4).name}), {how}"] = engine_row(w4_model, **w4)
    else:
        rows[f"ours W4 greedy (RTN in memory), {how}"] = engine_row(base, quantize="w4", **w4)
    w4_exact = next(name for name in rows if name.startswith("ours W4 greedy ("))
    same_as = {}  # rows whose tokens must equal another row's, not our dense greedy's
    if not cuda and native.available():  # int8 scores, the largest logit exact: the exact head's tokens
        argmax = f"ours W4 greedy + argmax lm_head (exact), {how}"
        rows[argmax], same_as[argmax] = engine_row(base, quantize="w4", lm_head="argmax", **w4), w4_exact
    rows[f"ours W4 greedy + int4 lm_head (lossy), {how}"] = engine_row(base, quantize="w4", lm_head="int4", **w4)
    if not cuda:  # the fp32 stream's KV cache in bf16: half the attention reads (a bf16 stream has it already)
        rows["ours W4 greedy + int4 lm_head + bf16 KV cache (lossy), compiled"] = engine_row(
            base, quantize="w4", lm_head="int4", cache_dtype=torch.bfloat16, **w4
        )
    if not cuda and native.available():  # W4 weights times int8 rows: lossy in the activations
        a8 = dict(quantize="w4", kernel="int4-a8", compile=True)
        rows["ours W4A8 greedy (RTN in memory, int4-a8), compiled"] = engine_row(base, **a8)
        rows["ours W4A8 greedy + int4 lm_head (lossy), compiled"] = engine_row(base, lm_head="int4", **a8)
    plain = "CUDA graphs" if cuda else "eager"  # the target's steps (a W4 draft: its own graphs, or eager)
    if args.w8a8:
        w8a8 = models.for_compute(models.load(args.w8a8, torch.bfloat16).model, device)
        rows[f"ours W8A8 greedy ({Path(args.w8a8).name}), {plain}"] = engine_row(w8a8)
    if args.fp8:  # FP8 weights and inputs on torch._scaled_mm (on a CPU, torch's slow reference loop)
        fp8 = models.for_compute(models.load(args.fp8, torch.bfloat16).model, device)
        attach_integers(fp8, args.fp8)
        rows[f"ours FP8 greedy ({Path(args.fp8).name}, _scaled_mm), {plain}"] = engine_row(fp8, kernel="fp8")
    lookup, w4_draft, both = dict(k=10), dict(w4_draft=True, k=6), dict(w4_draft=True, k=8)
    rows[f"ours prompt lookup, {plain}"] = engine_row(base, "prompt-lookup", **lookup)
    rows[f"ours W4 self-draft, {plain}"] = engine_row(base, "draft", **w4_draft)
    rows[f"ours W4 self-draft + prompt lookup, {plain}"] = engine_row(base, "prompt-lookup", **both)
    if not cuda:  # speculation on the compiled target (the W4 draft stays eager)
        rows["ours prompt lookup, compiled"] = engine_row(base, "prompt-lookup", compile=True, **lookup)
        rows["ours W4 self-draft + prompt lookup, compiled"] = engine_row(base, "prompt-lookup", compile=True, **both)
    rows[f"ours lookahead (W=3 N=3 G=4), {plain}"] = engine_row(base, "lookahead")
    for folder in args.eagle:  # a head drafts up to 7 tokens: a compiled verify step has 8 rows
        head, label = eagle_head.load_matching(folder, base.config), Path(folder).name
        rows[f"ours EAGLE head ({label}), {plain}"] = engine_row(base, "eagle", head=head, k=7)
        # a tree of 15 drafted tokens and its root fill the 16 rows a verify step scores exactly
        rows[f"ours EAGLE tree of 15 ({label}), {plain}"] = engine_row(base, "eagle-tree", head=head, k=15)
        if not cuda:
            rows[f"ours EAGLE head ({label}), compiled"] = engine_row(base, "eagle", compile=True, head=head, k=7)
            rows[f"ours EAGLE head ({label}) + prompt lookup, compiled"] = engine_row(
                base, "eagle-lookup", compile=True, head=head, k=7
            )
        if args.w4:
            on_w4 = f"ours EAGLE head ({label}) on W4 ({Path(args.w4).name}), {how}"
            rows[on_w4], same_as[on_w4] = engine_row(w4_model, "eagle", head=head, k=7, **w4), w4_exact

    def early_exit_row():
        from compress.arch import decoder_layers

        exits = early_exit.default_exits(len(decoder_layers(base)))
        threshold = early_exit.calibrated_threshold(base, tokenizer, exits, "softmax")
        settings = Settings(eos=eos, exits=exits, exit_threshold=threshold)
        engine = shared_engine(base, graphs=False) if cuda else shared_engine(base)  # exits run eager
        run = METHODS["early-exit"].run
        return (lambda p: ours(run(engine, p, n, settings))), engine.weight_bytes(), None

    rows["ours early exit (lossy), eager"] = early_exit_row
    if args.kivi:
        kivi = models.for_compute(models.load(args.kivi, torch.bfloat16).model, device)
        rows[f"ours KIVI {kv_quant.scheme_of(kivi).describe()} greedy, {plain}"] = engine_row(kivi)
    rows["transformers static cache + torch.compile, bf16"] = hf_static_compiled  # last: a failure inside
    # inductor's CUDA graphs can leave the GPU's state broken for the rows after it
    try:
        import llama_cpp  # noqa: F401 - optional: the speed CPU users know

        rows["llama.cpp (llama-cpp-python) on the bundled GGUF"] = llama_cpp_row(args.model, n)
    except ImportError:
        pass

    sets_ = {
        name: [p.to(device) for p in ps[: args.prompts]] for name, ps in prompts(tokenizer).items() if name in args.sets
    }
    head = [
        "prompts",
        "method",
        "tokens/s",
        f"× {reference_name.removesuffix(' greedy')}",
        "tokens/forward",
        "= transformers bf16 greedy",
        "= ours greedy (same engine)",
        "compile s",
        "weights MB/token",
        "of read bandwidth",
        "ms/step after the prompt",
        "steps: of read bandwidth",
    ]
    built = {}
    for name, setup in rows.items():
        if name.startswith("transformers eager") or name == ours_name or wanted(name):
            print(f"setting up: {name}", file=sys.stderr, flush=True)
            try:
                built[name] = setup()
            except Exception as e:  # noqa: BLE001 - one broken row must not cost the others
                print(f"  [{name}: setup failed: {why(e)}]", file=sys.stderr)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    for set_name, ps in sets_.items():
        outputs = {name: [] for name in built}
        seconds, forwards = dict.fromkeys(built, 0.0), dict.fromkeys(built, 0)
        prompt_seconds = dict.fromkeys(built, 0.0)
        for i, p in enumerate([ps[0][:, :32]] + ps):  # a warm-up, then every method on one prompt before the
            for name, (run, _, _) in list(built.items()):  # next: a drifting machine hits all alike
                try:
                    out, s, f, prompt_s = run(p)
                except Exception as e:  # noqa: BLE001
                    print(f"  [{name}: failed: {why(e)}]", file=sys.stderr)
                    del built[name]
                    continue
                if i == 0:
                    continue
                outputs[name].append(out)
                seconds[name] += s
                forwards[name] += f or 0
                prompt_seconds[name] += prompt_s
            print(f"{set_name}: prompt {i}/{len(ps)} done", file=sys.stderr, flush=True)
        reference_rate = sum(map(len, outputs[reference_name])) / seconds[reference_name]
        reference = outputs.get("transformers eager greedy, bf16")
        for name, (_, bytes_per_token, compile_s) in built.items():
            # speculation must reproduce the greedy of its own engine: compiled rows compare with compiled greedy
            ours_greedy = outputs.get(
                same_as.get(name, "ours greedy, compiled" if name.endswith(", compiled") else ours_name)
            )
            tokens = sum(map(len, outputs[name]))
            rate = tokens / seconds[name]
            same, same_ours = (
                f"{sum(a == b for a, b in zip(outputs[name], ref))}/{len(ps)}" if ref else ""
                for ref in (reference, ours_greedy)
            )  # empty where --only left the row out
            traffic = f"{bytes_per_token * rate / 1e9 / bandwidth:.0%}" if bandwidth and bytes_per_token else ""
            # the steps alone (ours: the prompt's forward timed apart), where the weight reads are the wall
            step_ms = (seconds[name] - prompt_seconds[name]) / forwards[name] * 1e3 if prompt_seconds[name] else None
            step_traffic = (
                f"{bytes_per_token / step_ms / 1e6 / bandwidth:.0%}"
                if step_ms and bandwidth and bytes_per_token
                else ""
            )
            print(
                "| "
                + " | ".join(
                    [
                        set_name,
                        name,
                        f"{rate:.1f}",
                        f"{rate / reference_rate:.2f}×",
                        f"{tokens / forwards[name]:.2f}" if forwards[name] else "",
                        same,
                        same_ours,
                        f"{compile_s:.0f}" if isinstance(compile_s, float) else compile_s or "",
                        f"{bytes_per_token / 1e6:.0f}" if bytes_per_token else "",
                        traffic,
                        f"{step_ms:.2f}" if step_ms else "",
                        step_traffic,
                    ]
                )
                + " |",
                flush=True,
            )


def why(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


# llama.cpp runs in a process of its own: a crash in native code there (seen: llama-cpp-python
# built from source segfaulting in llama_decode on the bundled file) must cost its row, not the run.
LLAMA_CPP_WORKER = """
import json, sys, time
from llama_cpp import Llama
path, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=1024, n_threads=threads, verbose=False)
for line in sys.stdin:
    llm.reset()
    start, out = time.perf_counter(), []
    for token in llm.generate(json.loads(line), temp=0.0, top_k=1, reset=True):
        if token == llm.token_eos() or len(out) >= n:
            break
        out.append(token)
    print(json.dumps([out, time.perf_counter() - start]), flush=True)
"""


def llama_cpp_row(alias: str, n: int):
    """llama.cpp decoding the bundled GGUF (SmolLM2's Q4_1) on this CPU, greedy, same token ids."""

    def setup():
        import subprocess

        folder, name = models.bundled_gguf(alias)
        path = Path(folder) / name
        worker = subprocess.Popen(
            [sys.executable, "-c", LLAMA_CPP_WORKER, str(path), str(n), str(torch.get_num_threads())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

        def run(prompt):
            worker.stdin.write(json.dumps(prompt[0].tolist()) + "\n")
            worker.stdin.flush()
            line = worker.stdout.readline()
            if not line:
                raise RuntimeError(f"the llama.cpp process ended (exit status {worker.wait()})")
            out, seconds = json.loads(line)
            return out, seconds, None, 0.0

        return run, Path(path).stat().st_size, None

    return setup


if __name__ == "__main__":
    main()
