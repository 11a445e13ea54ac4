"""Layer-by-layer sequential quantization.

Without calibration (methods that need no statistics) every linear is quantized straight from
its weight. With calibration the engine:
  1. captures the inputs of the first decoder layer on the calibration windows, and what every layer
     is called with besides (masks, position embeddings: they may differ from layer to layer);
  2. for each layer, moves it to the device and, step by step in true-sequential order (the plan
     models.adapters learns by watching one forward), runs the layer with hooks that gather
     statistics (a window's forward ends once the step's last hooked linear has run: nothing after
     it feeds them), quantizes the step's linears and puts their dequantized weights back; an expert of
     a MoE block gathers statistics from the tokens routed to it (_ExpertCalibration states the rule
     for an expert routed too few);
  3. runs the quantized layer once more to produce the next layer's inputs, then moves it back.

Memory: the device holds one decoder layer, the statistics of one group (a few d×d fp32 buffers),
one window's intermediate activations, and the calibration activations: the layer's inputs and
outputs, 2 · nsamples · seqlen · hidden values of the model dtype. With `offload_activations` those
stay in host memory and travel to the device one window at a time (slower, and the device then
holds about one layer plus the statistics). The host holds the model once (weights are replaced in
place by their dequantized values) plus the packed quantized tensors: all of them, or with a `store`
(engine.spill) one layer's, the others waiting on disk.

Options: `checkpoint` (engine.checkpoint) records every finished layer and resumes after the last
one recorded; `ranks` (engine.distributed) splits windows and linears over a torchrun job with the
same result as one process.
"""

import logging
import time

import torch
from tqdm.auto import tqdm

from quantkit.engine.distributed import LOCAL
from quantkit.engine.stats import InputGramCollector, output_error
from quantkit.engine.timing import EngineTimer
from quantkit.errors import QuantkitError
from quantkit.models.adapters import observe_calls
from quantkit.runtime.experts import RoutedExperts, replace_fused_experts

log = logging.getLogger(__name__)


class _StopForward(Exception):
    pass


class _BlockStandIn(torch.nn.Module):
    """Stands in for decoder block `index` while the model runs up to its blocks: hands what the block
    is called with to `sink`, which returns the block's input unchanged or stops the forward."""

    def __init__(self, layer, index, sink):
        super().__init__()
        self.layer = layer
        self.index = index
        self.sink = sink

    def forward(self, hidden_states, *args, **kwargs):
        return self.sink(self.index, hidden_states, args, kwargs)

    def __getattr__(self, name):  # models may read attributes of their layers (e.g. attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)


def _move_outside(module, skip, device):
    """Move every parameter and buffer of `module` except those under `skip` to `device`."""
    if module is skip:
        return
    for param in module.parameters(recurse=False):
        if param.device.type != "meta":  # a lazily read block's released weights
            param.data = param.data.to(device)
    for name, buf in module.named_buffers(recurse=False):
        if buf.device.type != "meta":
            module._buffers[name] = buf.to(device)
    for child in module.children():
        _move_outside(child, skip, device)


_NOT_CARRIED = ("past_key_values", "past_key_value", "cache", "layer_past", "use_cache")


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b.to(a.device)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable equality are compared by identity only
        return False


@torch.no_grad()
def capture_layer_inputs(model, layers, calib_ids, device, store=None):
    """Run the model up to its decoder blocks; returns (inputs [n, T, h], calls) where calls[i] =
    (args, kwargs) is what block i is called with besides its input: attention masks (which differ
    between sliding-window and global blocks), position ids and embeddings, whatever the architecture
    passes (caches and use_cache dropped). `store`: where the inputs are kept (default: `device`).

    Every block is replaced by a stand-in. On the first window the stand-ins return their input, so
    the forward reaches every block and each one's call is recorded; on the others the first stand-in
    stops it. The calls are taken from the first window and reused for all (they depend on the
    window's length, not its tokens); a second window is run through every block too and a call that
    differs between the two is refused rather than silently reused."""
    _move_outside(model, layers, device)
    inputs, calls, check = [], [None] * len(layers), [None] * len(layers)
    mode = {"record": calls}

    def sink(index, hidden, args, kwargs):
        if index == 0:
            inputs.append(hidden if store is None else hidden.to(store))
        target = mode["record"]
        if target is None:
            raise _StopForward
        target[index] = (args, {k: v for k, v in kwargs.items() if k not in _NOT_CARRIED})
        if index == len(layers) - 1:
            raise _StopForward
        return hidden

    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _BlockStandIn(layer, i, sink)
    try:
        for w, row in enumerate(calib_ids):
            mode["record"] = calls if w == 0 else check if w == 1 else None
            try:
                model(row.unsqueeze(0).to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        _move_outside(model, layers, "cpu")
    if check[0] is not None:
        for i, (first, second) in enumerate(zip(calls, check)):
            if not _same_value(first, second):
                raise QuantkitError(f"decoder block {i} is called with arguments that depend on the tokens of the "
                                    "window (not only its length); quantkit reuses one call for every window")
    return torch.cat(inputs), calls


class _BlockDone(Exception):
    pass


class _StopAfter:
    """Ends a block's forward (raises _BlockDone from a forward hook) as soon as every module of `modules`
    has run in the current window: a statistics pass needs nothing the block computes after its last
    hooked linear. A module that does not run in a window (an expert no token was routed to) lets the
    forward finish. Register it after the collectors, so that their hooks on the same module run first."""

    def __init__(self, modules):
        self.pending = {id(m) for m in modules}
        self.ran = set()
        self.handles = [m.register_forward_hook(self._hook) for m in {id(m): m for m in modules}.values()]

    def _hook(self, module, inputs, output):
        self.ran.add(id(module))
        if len(self.ran) == len(self.pending):
            raise _BlockDone

    def new_window(self):
        self.ran.clear()

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _run_layer(layer, inputs, args, kwargs, keep_outputs=True, collectors=(), stop=None):
    """Run `layer` on every window of `inputs` (one per forward, on the layer's device); returns the
    outputs where the inputs live, or None when only the hooks matter. Each collector is told when a
    window ends (a routed expert's linear may not run at all in a window). `stop` (a _StopAfter, only
    without outputs) may end a window's forward early."""
    device = next(layer.parameters()).device
    outputs = torch.empty_like(inputs) if keep_outputs else None
    for i in range(inputs.shape[0]):
        if stop is not None:
            stop.new_window()
        try:
            out = layer(inputs[i : i + 1].to(device), *args, **kwargs)
        except _BlockDone:
            out = None
        for collector in collectors:
            collector.end_window()
        if keep_outputs:
            outputs[i] = out[0] if isinstance(out, (tuple, list)) else out
    return outputs


def _quantize_linear(method, name, linear, stats, device):
    weight = linear.weight.data.to(device=device, dtype=torch.float32)
    if not torch.isfinite(weight).all():
        raise QuantkitError(f"{name}: weight contains NaN or Inf")
    start = time.perf_counter()
    qtensor, info = method.quantize(weight, stats)
    elapsed = time.perf_counter() - start
    dequant = qtensor.dequantize(torch.float32)
    delta = weight - dequant
    entry = {"module": name, "shape": list(weight.shape), "time_s": round(elapsed, 4),
             "weight_mse": delta.pow(2).mean().item(), **info}
    if stats is not None:
        entry["output_mse"] = output_error(delta, stats)
    linear.weight.data = dequant.to(device=linear.weight.device, dtype=linear.weight.dtype)
    return qtensor.to("cpu"), entry


def _quantize_together(ranks, jobs, method, device, timer=None):
    """Quantize the linears `jobs` ([(global position, name, linear, stats)], independent of each
    other: one sequential group, or a layer without calibration) over the ranks. Each rank first
    quantizes the linears it owns (ranks.owner), all of them, so the ranks work at the same time;
    then, in the jobs' order, each owner broadcasts its tensors and log entry and the other ranks put
    the same dequantized weight back. Any failure on an owner is raised on every rank, at that job.
    Returns [(QuantizedTensor, entry)] in the jobs' order. `timer`: an engine.timing.EngineTimer."""
    timer = timer or EngineTimer(enabled=False)
    if not ranks.distributed:
        with timer.phase("solve"):
            return [_quantize_linear(method, name, linear, stats, device) for _, name, linear, stats in jobs]
    with timer.phase("solve"):
        own = _quantize_own(ranks, jobs, method, device)
    timer.wait_for(ranks)
    with timer.phase("share"):
        return _share(ranks, jobs, own, device)


def _quantize_own(ranks, jobs, method, device) -> dict:
    """{job index: (qtensor, header, failure)} for the jobs this rank owns; stops at its first failure."""
    own = {}
    for i, (position, name, linear, stats) in enumerate(jobs):
        if ranks.owner(position) != ranks.rank:
            continue
        try:
            qtensor, entry = _quantize_linear(method, name, linear, stats, device)
            spec = [[k, str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in qtensor.state_dict().items()]
            own[i] = (qtensor, {"meta": qtensor.meta(), "entry": entry, "spec": spec}, None)
        except Exception as exc:  # tell the other ranks before failing, or they wait forever
            message = str(exc) if isinstance(exc, QuantkitError) else f"{type(exc).__name__}: {exc}"
            own[i] = (None, {"error": message}, exc)
            break  # every rank stops at this job's broadcast: this rank's later jobs are never shared
    return own


def _share(ranks, jobs, own, device) -> list:
    """Every job's result on every rank, broadcast by its owner in the jobs' order (_quantize_together)."""
    from quantkit.formats.base import quantized_tensor_from_state_dict

    results = []
    for i, (position, name, linear, _) in enumerate(jobs):
        owner = ranks.owner(position)
        qtensor, header, failure = own.get(i, (None, None, None))
        header = ranks.broadcast_json(header, src=owner)
        if "error" in header:
            if failure is not None:
                raise failure
            raise QuantkitError(f"rank {owner} failed on {name}: {header['error']}")
        tensors = ranks.broadcast_tensors(qtensor.state_dict() if qtensor is not None else None, header["spec"], owner)
        if qtensor is None:
            qtensor = quantized_tensor_from_state_dict(header["meta"], tensors)
            dequant = qtensor.to(device).dequantize(torch.float32)
            linear.weight.data = dequant.to(device=linear.weight.device, dtype=linear.weight.dtype)
        results.append((qtensor, header["entry"]))
    return results


def _signature(layer, linears):
    """What decides a block's plan: its class and its linears' names and shapes."""
    return type(layer).__name__, tuple((name, tuple(m.weight.shape)) for name, m in linears.items())


def _expert_slot(name, experts):
    """(experts module path, expert index, stage) of an expert linear's name inside a block, else None."""
    for path in experts:
        if name.startswith(path + "."):
            index, leaf = name[len(path) + 1:].split(".", 1)
            stage = next(s for s, leaves in enumerate(RoutedExperts.STAGES) if leaf in leaves)
            return path, int(index), stage
    return None


class _BlockPass:
    """Runs one decoder block over the calibration windows with statistics hooks on some of its linears."""

    def __init__(self, layer, inputs, call, linears, shard_sizes, ranks, timer):
        self.layer, self.inputs, self.linears = layer, inputs, linears
        self.args, self.kwargs = call
        self.shard_sizes, self.ranks, self.timer = shard_sizes, ranks, timer

    def observe(self):
        """[(linear name, input)] in the order one forward (the first window) runs the linears."""
        def one_window():
            _run_layer(self.layer, self.inputs[:1], self.args, self.kwargs, keep_outputs=False)

        return observe_calls(self.layer, list(self.linears), one_window)

    def stats(self, groups, experts=None, on_all=frozenset()) -> dict:
        """{group: statistics of its input} for `groups` (tuples of linears reading one input), from one
        pass over every window; `experts` runs the experts `on_all` on every token meanwhile."""
        collectors = [InputGramCollector(self.linears[group[0]], self.shard_sizes, eager=self.ranks.is_main)
                      for group in groups]
        stop = _StopAfter([self.linears[group[0]] for group in groups])
        if experts is not None:
            experts.calibrate_on_all_tokens = on_all
        try:
            with self.timer.phase("stats_forwards"):
                _run_layer(self.layer, self.inputs, self.args, self.kwargs, keep_outputs=False,
                           collectors=collectors, stop=stop)
        finally:
            stop.remove()
            for collector in collectors:
                collector.remove()
            if experts is not None:
                experts.calibrate_on_all_tokens = frozenset()
        self.timer.wait_for(self.ranks)
        with self.timer.phase("stats_reduce"):
            return {group: collector.stats(self.ranks) for group, collector in zip(groups, collectors)}


class _ExpertCalibration:
    """The routed-token rule for the experts of one block. Expert e is calibrated on the tokens routed
    to it; when they are fewer than its input width (Σ xᵀx would be singular), it is calibrated on all
    tokens that reached the experts module instead (RoutedExperts.calibrate_on_all_tokens), logged
    with its routed count, and its down projection follows the same choice."""

    RULE = ("an expert routed fewer tokens than its input width is calibrated on all tokens that reached "
            "its MoE block")

    def __init__(self, layer, index):
        self.layer, self.index = layer, index
        self.experts = [path for path, m in layer.named_modules() if isinstance(m, RoutedExperts)]
        self.routed = {}  # (path, e) -> routed token count (all ranks)
        self.short = {}  # path -> frozenset of experts calibrated on all tokens

    def gather(self, step, block: _BlockPass) -> dict:
        """Statistics of every group of `step`: {group: stats}, applying the rule."""
        slot = _expert_slot(step[0][0], self.experts)
        if slot is None:
            return block.stats(step)
        path, _, stage = slot
        module = self.layer.get_submodule(path)
        if stage > 0:  # the down projections: the experts chosen at the first stage see all tokens again
            return block.stats(step, module, self.short[path])
        stats = block.stats(step)
        indices = [_expert_slot(group[0], self.experts)[1] for group in step]
        short = set()
        for group, e in zip(step, indices):
            self.routed[path, e] = stats[group]["ntokens"]
            if stats[group]["ntokens"] < self.layer.get_submodule(group[0]).in_features:
                short.add(e)
        self.short[path] = frozenset(short)
        if short:
            log.warning("layer %d %s: experts %s were routed too few tokens (%s); %s", self.index, path,
                        sorted(short), ", ".join(str(self.routed[path, e]) for e in sorted(short)), self.RULE)
            again = [group for group, e in zip(step, indices) if e in short]
            stats.update(block.stats(again, module, self.short[path]))
        return stats

    def annotate(self, name, entry):
        slot = _expert_slot(name, self.experts)
        if slot is not None:
            path, e, _ = slot
            entry["routed_tokens"] = self.routed[path, e]
            entry["calibrated_on"] = "all block tokens" if e in self.short[path] else "routed tokens"


@torch.no_grad()
def quantize_model(model, adapter, method, calib_ids=None, device="cpu", progress=True, module_stats=None, *,
                   checkpoint=None, offload_activations=False, ranks=None, blocks=None, store=None, timer=None):
    """Quantize every linear the adapter finds in `model`'s decoder blocks, in place (weights replaced
    by their dequantized values; fused MoE experts are first split into one linear per expert matrix,
    runtime.experts). Returns ({module name: QuantizedTensor}, [per-module log entries]). `module_stats`
    ({module name: {key: tensor}}, e.g. the whole-model Fisher diagonal) is merged into the
    statistics of that module. `checkpoint`: a prepared engine.checkpoint.LayerCheckpoint; layers
    it has recorded are restored, not recomputed. `offload_activations`: keep the calibration
    activations in host memory. `ranks`: an engine.distributed.Ranks (default: this process alone).
    `blocks`: a models.lazy.LazyBlocks when the blocks of `model` are on the meta device, each read when
    its turn comes (on a GPU, read ahead while the block before it computes) and released once its
    quantized tensors are taken. `store`: an engine.spill.QuantizedStore
    that takes every finished layer's tensors (to disk: they do not stay in memory) and is returned in
    place of the dict. `timer`: an engine.timing.EngineTimer that adds up the seconds of each phase (default:
    one that records only when QUANTKIT_ENGINE_TIMINGS is set).

    With calibration each block's plan (models.adapters: groups of linears that read one input, in the
    order they run) is learned from one forward of the first block of its kind, on its first window."""
    ranks = ranks or LOCAL
    timer = timer or EngineTimer(device)
    replace_fused_experts(model)
    layers = adapter.layers(model)
    needs_stats = bool(method.stats)
    if needs_stats and calib_ids is None:
        raise QuantkitError(f"--method {method.name} needs calibration data (--nsamples > 0)")
    qtensors, log_entries = {} if store is None else store, []
    first = 0
    prefix = adapter.layers_path
    if checkpoint is not None and store is None:
        qtensors, log_entries = checkpoint.restore()
    elif checkpoint is not None:
        for index, path, modules, layer_entries in checkpoint.committed_layers():
            store.add_file(index, path, modules)
            log_entries += layer_entries
    if checkpoint is not None:
        first = checkpoint.layers_done
        for index in range(first if blocks is not None else 0):  # their float tensors go to the artifact too
            blocks.load_floats(index, [n for n in qtensors if n.startswith(f"{prefix}.{index}.")])
    show = progress and ranks.is_main
    todo = range(first, len(layers))
    position = 0  # a running count of linears, the same on every rank: decides which rank quantizes one

    def finish_layer(index, layer_q, layer_entries, next_inputs=None, window_start=0):
        log_entries.extend(layer_entries)
        if checkpoint is not None:
            checkpoint.commit(index, layer_q, layer_entries, next_inputs, window_start)
        if store is None:
            qtensors.update(layer_q)
        else:  # the checkpoint's layer file holds these very tensors: the store reads them from there
            store.add_layer(index, layer_q, None if checkpoint is None else checkpoint.layer_path(index))

    if calib_ids is None:
        for index in tqdm(todo, desc="quantize", unit="layer", disable=not show, initial=first, total=len(layers)):
            if blocks is not None:
                with timer.phase("block_wait"):
                    blocks.load(index)
            jobs = []
            for name, linear in adapter.linears(layers[index]).items():
                jobs.append((position, f"{prefix}.{index}.{name}", linear, None))
                position += 1
            done = _quantize_together(ranks, jobs, method, device, timer)
            layer_q = {name: qtensor for (_, name, _, _), (qtensor, _) in zip(jobs, done)}
            layer_entries = [entry for _, entry in done]
            del done
            with timer.phase("finish"):
                finish_layer(index, layer_q, layer_entries)
                if blocks is not None:
                    blocks.release(index, layer_q)
            del layer_q  # with a store, the layer's tensors are on disk now
        return qtensors, log_entries

    nwindows = calib_ids.shape[0]
    start, stop = ranks.window_range(nwindows)
    inputs_home = "cpu" if offload_activations else device
    with timer.phase("capture"):
        if first == 0:
            inputs, calls = capture_layer_inputs(model, layers, calib_ids[start:stop], device, inputs_home)
        elif first < len(layers):
            # the calls (rotary embeddings, masks) are recomputed; the activations come from the checkpoint
            _, calls = capture_layer_inputs(model, layers, calib_ids[start : start + 1], device, "cpu")
            inputs = checkpoint.load_inputs(start, stop).to(inputs_home)
    shard_sizes = ranks.local_shard_sizes(nwindows)
    plans = {}
    for index in tqdm(todo, desc="quantize", unit="layer", disable=not show, initial=first, total=len(layers)):
        layer = layers[index]
        if blocks is not None:
            with timer.phase("block_wait"):
                blocks.load(index, device)
            if torch.device(device).type == "cuda":  # the next block's read hides behind this one's work
                blocks.prefetch(index + 1, device)
        layer.to(device)
        linears = adapter.linears(layer)
        block = _BlockPass(layer, inputs, calls[index], linears, shard_sizes, ranks, timer)
        signature = _signature(layer, linears)
        if signature not in plans:
            plans[signature] = adapter.steps(layer, block.observe())
        routing = _ExpertCalibration(layer, index)
        layer_q, layer_entries = {}, []
        for step in plans[signature]:
            stats = routing.gather(step, block)
            jobs = []
            for group in step:
                if not torch.isfinite(stats[group]["xtx"]).all():
                    raise QuantkitError(f"layer {index} {group[0]}: calibration activations (Hessian) contain NaN "
                                        "or Inf")
                for name in group:
                    full = f"{prefix}.{index}.{name}"
                    extra = (module_stats or {}).get(full)
                    jobs.append((position, full, linears[name],
                                 stats[group] if extra is None else {**stats[group], **extra}))
                    position += 1
            for (_, full, _, _), (qtensor, entry) in zip(jobs, _quantize_together(ranks, jobs, method, device,
                                                                                   timer)):
                routing.annotate(full[len(f"{prefix}.{index}."):], entry)
                layer_q[full] = qtensor
                layer_entries.append(entry)
            del stats, jobs
        del block
        last = index == len(layers) - 1
        if not last:  # the last layer's outputs feed nothing that is quantized
            with timer.phase("outputs"):
                inputs = _run_layer(layer, inputs, *calls[index])
        with timer.phase("finish"):
            if blocks is None:
                layer.to("cpu")
            else:  # the quantized weights are dropped where they are rather than copied to the host first
                blocks.release(index, layer_q)
                _move_outside(layer, None, "cpu")
            finish_layer(index, layer_q, layer_entries, None if last else inputs, start)
        del layer_q  # with a store, the layer's tensors are on disk now
    return qtensors, log_entries
