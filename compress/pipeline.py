"""The sequential block sweep: every layer-pass sees one decoder block at a time.

Block 0's inputs are caught with a stand-in on the layer list (no graph tracing);
then, per block: passes observe and transform it, and the block is re-run on the
calibration inputs to feed the next block from its *compressed* output. Only the
current block and one set of activations need to sit on the compute device.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections.abc import Callable, Iterator

import torch
from tqdm import tqdm

from . import distributed, moe
from .arch import arch_of, decoder_layers
from .hessian import Statistic
from .lazy import streamed
from .models import cast_params, compute_dtype
from .resume import BlockCheckpoints


class _Stop(Exception):
    pass


class _StandIn(torch.nn.Module):
    """Takes a module's place; attributes the caller reads (such as attention_type) come from it."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class _Recorder(_StandIn):
    """Stands in for a decoder layer: records its call, then passes through or stops."""

    def __init__(self, layer: torch.nn.Module, on_call: Callable):
        super().__init__(layer)
        self.on_call = on_call

    def forward(self, hidden_states, *args, **kwargs):
        return self.on_call(hidden_states, args, kwargs)


class _Replay(_StandIn):
    """Stands in for a module whose last op is ``linear`` (attention ends in o_proj, the MLP in
    down_proj): its output is ``linear`` applied to that linear's input kept from an earlier
    forward, so nothing before the linear is computed again. ``sample`` picks the input.
    Once ``settle`` is called the linear is final: its outputs are kept instead, so later
    forwards do not multiply again."""

    def __init__(
        self, module: torch.nn.Module, linear: torch.nn.Module, inputs: list[torch.Tensor], tail: tuple | None
    ):
        super().__init__(module)
        self.linear, self.kept, self.tail = linear, inputs, tail
        self.settled = False
        self.sample = 0

    def settle(self) -> None:
        if not self.settled:
            for i, x in enumerate(self.kept):  # one at a time: no second copy of the activations
                self.kept[i] = self.linear(x)
            self.settled = True

    def forward(self, *args, **kwargs):
        # a copy: a layer that works in place on this output must not change what is kept
        y = self.kept[self.sample].clone() if self.settled else self.linear(self.kept[self.sample])
        return y if self.tail is None else (y, *self.tail)


def _home(module: torch.nn.Module) -> torch.device:
    tensor = next(module.parameters(), None)
    tensor = tensor if tensor is not None else next(module.buffers(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _layers_parent(model):
    path = arch_of(model).layers.rsplit(".", 1)[0]
    return model.get_submodule(path)


@torch.no_grad()
def capture_inputs(
    model, ids: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None, store: Callable[[], list] = list
):
    """Hidden states entering block 0 for each sample (in a list made by ``store``), and each
    block's call arguments.

    Arguments (masks, rotary tables) are the same for every sample of one length,
    so they are recorded once per block; Gemma-3 gives local and global layers
    different ones, hence per block. The modules before block 0 run in ``dtype``
    (the compute dtype), so the captured tensors are in it too.
    """
    layers = decoder_layers(model)
    parent = _layers_parent(model)
    storage = model.dtype
    others = [(child, _home(child)) for child in parent.children() if child is not layers]
    handles = []
    for child, _ in others:
        if type(child) is torch.nn.Embedding and dtype is not None:
            # a lookup, then the rows cast: what the cast table would give, without a float32 copy
            # of the whole table (2.1 GB at Llama-3-8B's vocabulary). Not for subclasses: Gemma's
            # scales its rows in the table's dtype.
            cast_params(child, device, storage)
            handles.append(child.register_forward_hook(lambda module, args, out: out.to(dtype)))
        else:
            cast_params(child, device, dtype or storage)
    originals = list(layers)
    calls: list[tuple] = [None] * len(layers)
    inputs = store()
    state = {"all": True}

    def recorder(i):
        def on_call(hidden, args, kwargs):
            if calls[i] is None:
                calls[i] = (
                    args,
                    {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache", "use_cache")},
                )
            if i == 0:
                inputs.append(hidden)
                if not state["all"]:
                    raise _Stop
            return hidden

        return on_call

    for i, layer in enumerate(originals):
        layers[i] = _Recorder(layer, recorder(i))
    try:
        for n in range(ids.shape[0]):
            state["all"] = n == 0  # one full pass records every block's arguments
            try:
                parent(input_ids=ids[n : n + 1].to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        for handle in handles:
            handle.remove()
        for child, home in others:
            cast_params(child, home, storage)
    return inputs, calls


class BlockData:
    """One block's calibration inputs and call arguments; runs the block over them.

    ``replay`` maps a module of the block (``self_attn``, ``mlp``) to a stand-in that
    rebuilds its output from its last linear's kept inputs; forwards use them. Only
    ``observe(..., replay_after=True)`` adds one, and ``run_sequential`` clears them
    before each pass, so a stand-in never outlives the pass that vouched for it.
    """

    def __init__(
        self,
        block: torch.nn.Module,
        inputs: list[torch.Tensor],
        call: tuple,
        original: torch.nn.Module | None = None,
        store: Callable[[], list] = list,
        dense_inputs: list[torch.Tensor] | None = None,
    ):
        self.block = block
        self.inputs = inputs
        self.dense_inputs = dense_inputs  # the dense model's inputs to this block, for passes with needs_dense_inputs
        self.store = store  # makes the lists activations go to (``activation_store``)
        self.args, self.kwargs = call
        self.original = original  # the block before any pass touched it, for passes with needs_original
        self.replay: dict[str, _Replay] = {}

    @contextlib.contextmanager
    def _replays_in_place(self):
        swapped = []
        try:
            for name, stand_in in self.replay.items():
                owner_name, _, attr = name.rpartition(".")
                owner = self.block.get_submodule(owner_name)
                swapped.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, stand_in)
            yield
        finally:
            for owner, attr, module in reversed(swapped):
                setattr(owner, attr, module)

    @torch.no_grad()
    def forward(
        self, hooks: dict[str, Callable] | None = None, stop_at: str | None = None, first: int | None = None
    ) -> list[torch.Tensor]:
        """Run the block on every sample (or the ``first`` few); ``hooks[name](x)`` sees each
        named module's input.

        With ``stop_at``, each sample's forward ends once that module's input has
        been seen (observing q/k/v needs only the input norm, not the whole block).
        """
        hooks = dict(hooks or {})
        names = set(hooks) | ({stop_at} if stop_at else set())
        hidden = [n for n in names for r in self.replay if n.startswith(r + ".")]
        if hidden:
            raise RuntimeError(f"cannot observe {hidden}: their module is replayed from kept inputs")

        def pre_hook(name):
            def fn(module, args):
                if name in hooks:
                    hooks[name](args[0])
                if name == stop_at:
                    raise _Stop

            return fn

        handles = [self.block.get_submodule(n).register_forward_pre_hook(pre_hook(n)) for n in names]
        outputs = self.store()
        try:
            with self._replays_in_place():
                for i, x in enumerate(itertools.islice(self.inputs, first)):  # one mapped at a time
                    for stand_in in self.replay.values():
                        stand_in.sample = i
                    try:
                        outputs.append(self.block(x, *self.args, **self.kwargs))
                    except _Stop:
                        pass
        finally:
            for h in handles:
                h.remove()
        return outputs

    def dense_inputs_to(self, block: torch.nn.Module, linear: str) -> Iterator[torch.Tensor]:
        """Each sample's input to ``linear`` when ``block`` (a copy of this one) runs on the dense
        model's inputs to this block, one sample at a time, in the order ``forward`` visits them."""
        for x in self.dense_inputs:
            seen = []
            BlockData(block, [x], (self.args, self.kwargs)).forward({linear: seen.append}, stop_at=linear)
            yield seen[0]

    @torch.no_grad()
    def _output_tail(self, module: str, linear: str):
        """If ``module``'s output is exactly ``linear``'s (checked on sample 0): None when it is
        that tensor, the Nones after it when it is a tuple. ``False`` when it is not."""
        seen = {}

        def keep_output(mod, args, out):
            seen["out"] = out

        handle = self.block.get_submodule(module).register_forward_hook(keep_output)
        try:
            self.forward({linear: lambda x: seen.setdefault("x", x)}, first=1)
        finally:
            handle.remove()
        out = seen.get("out")
        head, tail = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, None)
        if "x" not in seen or not isinstance(head, torch.Tensor) or any(t is not None for t in tail or ()):
            return False
        mine = self.block.get_submodule(linear)(seen["x"])  # a replayed module's output may be kept on the CPU
        return tail if torch.equal(head.to(mine.device), mine) else False

    def observe(
        self, groups, make_stat: Callable[[torch.nn.Module], Statistic], replay_after: bool = False
    ) -> dict[str, Statistic]:
        """One forward over the data, feeding each group's input to one statistic.

        ``groups`` are tuples of linears that read the same input (q/k/v), given in
        forward order: they share one statistic, built by ``make_stat(first_linear)``
        and fed via ``.add(x)``. The forward stops at the last group. With several processes,
        each statistic is then combined over every rank's samples (its ``.reduce()``, which a
        statistic for one process may leave out).

        ``replay_after`` (one group of one linear that ends its module, as o_proj ends the
        attention): keep that linear's inputs, and let later forwards of this pass rebuild the
        module's output from them instead of running it. The caller promises to change
        nothing this pass that feeds the linear; the linear itself may change until the
        caller says ``settle()``.
        """
        stats, hooks = {}, {}
        if not groups:  # every linear of this block is ignored
            return stats
        for group in groups:
            stat = make_stat(self.block.get_submodule(group[0]))
            hooks[group[0]] = stat.add
            stats.update({name: stat for name in group})
        linear = groups[-1][0]
        module = linear.rpartition(".")[0]
        one_linear = len(groups) == 1 and len(groups[0]) == 1 and module
        tail = self._output_tail(module, linear) if replay_after and one_linear and self.inputs else False
        kept = self.store()
        if tail is not False:
            add = hooks[linear]
            hooks[linear] = lambda x: (add(x), kept.append(x))
        self.forward(hooks, stop_at=linear)
        for stat in {id(s): s for s in stats.values()}.values():
            stat.reduce()
        if tail is not False and len(kept) == len(self.inputs):
            self.replay[module] = _Replay(
                self.block.get_submodule(module), self.block.get_submodule(linear), kept, tail
            )
        return stats

    @torch.no_grad()
    def settle(self) -> None:
        """The caller is done changing every linear it observed so far this pass: replayed
        modules keep their outputs from now on (o_proj is then not multiplied again by the
        gate/up, down and final forwards)."""
        for stand_in in self.replay.values():
            stand_in.settle()


MIN_EXPERT_TOKENS = 16  # as the recipe's calibration.min_expert_tokens


def run_sequential(
    model,
    ids: torch.Tensor | None,
    passes,
    device: torch.device,
    on_block: Callable[[int, torch.nn.Module], None] | None = None,
    keep: bool = False,
    store: Callable[[], list] = list,
    checkpoints: BlockCheckpoints | None = None,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
    route_all_experts: bool = False,
    compute: torch.dtype | None = None,
) -> None:
    """Apply layer-passes block by block over a ``StreamedModel``. ``ids`` is None when no pass needs data.

    Each block is read (if it is not in memory), computes in ``compute`` (default: the device's
    compute dtype, float32 on the CPU), goes back to the CPU in the storage dtype when its passes are done,
    is handed to ``on_block`` (the export writes it) and is freed, unless ``keep``. ``store``
    makes the lists that hold calibration activations (``activation_store``). ``checkpoints``
    keeps each finished block, and the first ``checkpoints.resumable`` blocks are read back
    from it instead of compressed (they only run over the data, for the next block's inputs).
    Mixture-of-experts blocks: see ``_calibrate_experts``; ``route_all_experts`` runs every
    expert on every calibration token while the block's passes observe it.
    """
    model = streamed(model)
    storage = model.dtype
    dtype = compute or compute_dtype(device, storage)
    if ids is not None:
        mine = distributed.share(len(ids))  # several processes: each calibrates on its own samples
        ids = ids[mine.start : mine.stop]
    inputs, calls = capture_inputs(model.model, ids, device, dtype, store) if ids is not None else (None, None)
    # GPTAQ compares with the dense model's activations: they travel beside the compressed ones,
    # each block's original (copied before its passes, or before a checkpoint replaces it) feeding the next
    dense = inputs is not None and any(p.needs_dense_inputs for p in passes)
    dense_inputs = inputs if dense else None
    keep_original = dense or any(p.needs_original for p in passes)
    resumable = checkpoints.resumable if checkpoints is not None else 0
    for p in passes:  # this run's training logs (a recipe may be applied twice in one process)
        p.log = dict(checkpoints.logs.get(p.where, {})) if resumable else {}
    for i in tqdm(range(len(model)), desc="compressing blocks", unit="block", disable=not distributed.is_main()):
        with model.block(i, keep=keep) as block:
            home = _home(block)
            original = copy.deepcopy(block) if keep_original and (i >= resumable or dense) else None
            if i < resumable:
                checkpoints.restore(i, block)
            cast_params(block, device, dtype)
            if original is not None:
                cast_params(original, device, dtype)
            data = None
            if inputs is not None or original is not None:  # without calibration data, only ``original`` is there
                call = calls[i] if calls else ((), {})
                data = BlockData(block, inputs or [], call, original, store, dense_inputs)
            prefix = f"{model.prefix}{i}."
            if inputs is not None and i >= resumable and moe.experts_of(block):
                _calibrate_experts(block, data, prefix, min_expert_tokens, route_all_experts)
            starved = bool(moe.starved_linears(block))
            with moe.routing_all(block, route_all_experts):
                for p in passes if i >= resumable else ():
                    if data is not None:
                        data.replay = {}  # a pass's stand-ins are only valid until another pass changes the block
                    p.apply(block, data, prefix)
                    if starved and p.needs_data:
                        p.without_data(block, prefix)
            moe.mark_starved(block, {})
            if inputs is not None and i + 1 < len(model):
                # the next block sees what the exported block produces: its weights rounded to the
                # storage dtype (AWQ's folded scales, SparseGPT's updates are computed in float32)
                # and run whole, not rebuilt from inputs kept before the last pass changed the
                # block; so --resume, which reads the block back, computes the same activations
                cast_params(cast_params(block, device, storage), device, dtype)
                data.replay = {}
                inputs = data.forward()
                if dense:
                    dense_inputs = BlockData(original, dense_inputs, call, store=store).forward()
            del data, original
            cast_params(block, home, storage)
            if checkpoints is not None and i >= resumable:
                checkpoints.save(i, block, {p.where: p.log for p in passes if p.log})
            if on_block is not None:
                on_block(i, block)


def _calibrate_experts(block, data: BlockData, prefix: str, min_tokens: int, route_all: bool) -> None:
    """Count the calibration tokens routed to each expert (one forward; summed over processes) and
    print them; experts below ``min_tokens`` are marked starved (unless every expert sees every
    token): data-based passes leave them to their data-free fallback (``LayerPass.without_data``)."""
    counts = moe.count_routed(block, data.forward)
    totals = {name: torch.tensor(c, dtype=torch.float64) for name, c in counts.items()}
    distributed.sum_(*totals.values())
    starved = {}
    for name, t in totals.items():
        c = [int(n) for n in t.tolist()]
        low = [e for e, n in enumerate(c) if n < min_tokens]
        shown = (
            " ".join(map(str, c)) if len(c) <= 16 else f"min {min(c)}, median {sorted(c)[len(c) // 2]}, max {max(c)}"
        )
        if distributed.is_main():
            tqdm.write(f"[compress] {prefix}{name}: calibration tokens per expert: {shown}")
        if low and not route_all:
            starved[name] = low
            if distributed.is_main():
                warnings.warn(
                    f"{prefix}{name}: experts {', '.join(map(str, low))} received fewer than {min_tokens} "
                    "calibration tokens; data-based passes round them to nearest (RTN) or prune them by "
                    "magnitude instead; more calibration samples or calibration.route_all_experts: true "
                    "calibrate them",
                    stacklevel=2,
                )
    moe.mark_starved(block, starved)


def run_passes(
    model,
    ids: torch.Tensor | None,
    passes,
    device: torch.device,
    load_teacher: Callable[[], torch.nn.Module],
    on_block: Callable[[int, torch.nn.Module], None] | None = None,
    store: Callable[[], list] = list,
    checkpoints: BlockCheckpoints | None = None,
    min_expert_tokens: int = MIN_EXPERT_TOKENS,
    route_all_experts: bool = False,
    compute: torch.dtype | None = None,
    tokenizer=None,
) -> torch.nn.Module | None:
    """The block sweep over the layer-passes, then the model passes (recovery training), which
    train the whole model (``model.load_all()`` first) against the original model from
    ``load_teacher()`` (where one needs it), and the ``tokenizer`` (a draft head generates chat
    replies to train on); returns that teacher, if loaded. ``on_block`` sees each block once final;
    ``store``, ``checkpoints``, ``compute``: see ``run_sequential`` (a resumed run trains again from
    the start)."""
    from .passes import ModelPass

    model = streamed(model)
    for p in passes:
        p.prepare(model)
    model_passes = [p for p in passes if isinstance(p, ModelPass)]
    layer_passes = [p for p in passes if not isinstance(p, ModelPass)]
    run_sequential(
        model,
        ids if layer_passes else None,  # only model passes (a draft head): no block runs over the data
        layer_passes,
        device,
        None if model_passes else on_block,
        keep=bool(model_passes),
        store=store,
        checkpoints=checkpoints,
        min_expert_tokens=min_expert_tokens,
        route_all_experts=route_all_experts,
        compute=compute,
    )
    if not model_passes:
        return None
    teacher = load_teacher() if any(p.needs_teacher for p in model_passes) else None
    for p in layer_passes if teacher is not None else []:  # the teacher as the student was: rotated too
        p.prepare(streamed(teacher))
    for p in model_passes:
        p.apply_model(model.model, teacher, ids, device, tokenizer)
    if on_block is not None:
        for i in range(len(model)):
            with model.block(i) as block:
                on_block(i, block)
    return teacher
