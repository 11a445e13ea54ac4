"""Layer-by-layer sequential quantization.

Without calibration (methods that need no statistics) every linear is quantized straight from
its weight. With calibration the engine:
  1. captures the inputs (and call kwargs) of the first decoder layer on the calibration windows;
  2. for each layer, moves it to the device and, group by group in true-sequential order, runs
     the layer with hooks that gather statistics, quantizes the group's linears and puts their
     dequantized weights back;
  3. runs the quantized layer once more to produce the next layer's inputs, then moves it back.

Memory: the device holds one decoder layer, the statistics of one group (a few d×d fp32 buffers),
one window's intermediate activations, and the calibration activations: the layer's inputs and
outputs, 2 · nsamples · seqlen · hidden values of the model dtype. With `offload_activations` those
stay in host memory and travel to the device one window at a time (slower, and the device then
holds about one layer plus the statistics). The host holds the model once (weights are replaced in
place by their dequantized values) plus the packed quantized tensors.

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
from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)


class _StopForward(Exception):
    pass


class _InputCatcher(torch.nn.Module):
    """Stands in for layer 0, records its inputs and aborts the forward pass."""

    def __init__(self, layer, sink, store=None):
        super().__init__()
        self.layer = layer
        self.sink = sink
        self.store = store

    def forward(self, hidden_states, *args, **kwargs):
        kept = hidden_states if self.store is None else hidden_states.to(self.store)
        self.sink.append((kept, args, kwargs))
        raise _StopForward

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
        param.data = param.data.to(device)
    for name, buf in module.named_buffers(recurse=False):
        module._buffers[name] = buf.to(device)
    for child in module.children():
        _move_outside(child, skip, device)


@torch.no_grad()
def capture_layer_inputs(model, layers, calib_ids, device, store=None):
    """Run the model up to its first decoder layer; returns (inputs [n, T, h], args, kwargs).
    `store`: where the inputs are kept (default: `device`)."""
    _move_outside(model, layers, device)
    sink = []
    original = layers[0]
    layers[0] = _InputCatcher(original, sink, store)
    try:
        for row in calib_ids:
            try:
                model(row.unsqueeze(0).to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        layers[0] = original
        _move_outside(model, layers, "cpu")
    inputs = torch.cat([hidden for hidden, _, _ in sink])
    _, args, kwargs = sink[0]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "cache", "use_cache")}
    return inputs, args, kwargs


def _run_layer(layer, inputs, args, kwargs, keep_outputs=True):
    """Run `layer` on every window of `inputs` (one per forward, on the layer's device); returns the
    outputs where the inputs live, or None when only the hooks matter."""
    device = next(layer.parameters()).device
    outputs = torch.empty_like(inputs) if keep_outputs else None
    for i in range(inputs.shape[0]):
        out = layer(inputs[i : i + 1].to(device), *args, **kwargs)
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


def _quantize_together(ranks, jobs, method, device):
    """Quantize the linears `jobs` ([(global position, name, linear, stats)], independent of each
    other: one sequential group, or a layer without calibration) over the ranks. Each rank first
    quantizes the linears it owns (ranks.owner), all of them, so the ranks work at the same time;
    then, in the jobs' order, each owner broadcasts its tensors and log entry and the other ranks put
    the same dequantized weight back. Any failure on an owner is raised on every rank, at that job.
    Returns [(QuantizedTensor, entry)] in the jobs' order."""
    if not ranks.distributed:
        return [_quantize_linear(method, name, linear, stats, device) for _, name, linear, stats in jobs]
    from quantkit.formats.base import quantized_tensor_from_state_dict

    own = {}  # job index -> (qtensor, header, failure), for the jobs this rank owns
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


@torch.no_grad()
def quantize_model(model, adapter, method, calib_ids=None, device="cpu", progress=True, module_stats=None, *,
                   checkpoint=None, offload_activations=False, ranks=None):
    """Quantize every adapter linear of `model` in place (weights replaced by their dequantized
    values). Returns ({module name: QuantizedTensor}, [per-module log entries]). `module_stats`
    ({module name: {key: tensor}}, e.g. the whole-model Fisher diagonal) is merged into the
    statistics of that module. `checkpoint`: a prepared engine.checkpoint.LayerCheckpoint; layers
    it has recorded are restored, not recomputed. `offload_activations`: keep the calibration
    activations in host memory. `ranks`: an engine.distributed.Ranks (default: this process alone)."""
    ranks = ranks or LOCAL
    layers = adapter.layers(model)
    needs_stats = bool(method.stats)
    if needs_stats and calib_ids is None:
        raise QuantkitError(f"--method {method.name} needs calibration data (--nsamples > 0)")
    qtensors, log_entries = {}, []
    first = 0
    if checkpoint is not None:
        qtensors, log_entries = checkpoint.restore()
        first = checkpoint.layers_done
    prefix = adapter.layers_path
    per_layer = len(adapter.linear_names())
    show = progress and ranks.is_main
    todo = range(first, len(layers))

    def finish_layer(index, layer_q, layer_entries, next_inputs=None, window_start=0):
        qtensors.update(layer_q)
        log_entries.extend(layer_entries)
        if checkpoint is not None:
            checkpoint.commit(index, layer_q, layer_entries, next_inputs, window_start)

    if calib_ids is None:
        for index in tqdm(todo, desc="quantize", unit="layer", disable=not show, initial=first, total=len(layers)):
            jobs = [(index * per_layer + position, f"{prefix}.{index}.{name}", linear, None)
                    for position, (name, linear) in enumerate(adapter.linears(layers[index]).items())]
            done = _quantize_together(ranks, jobs, method, device)
            layer_q = {name: qtensor for (_, name, _, _), (qtensor, _) in zip(jobs, done)}
            finish_layer(index, layer_q, [entry for _, entry in done])
        return qtensors, log_entries

    nwindows = calib_ids.shape[0]
    start, stop = ranks.window_range(nwindows)
    store = "cpu" if offload_activations else device
    if first == 0:
        inputs, args, kwargs = capture_layer_inputs(model, layers, calib_ids[start:stop], device, store)
    elif first < len(layers):
        # the call kwargs (rotary embeddings, masks) are recomputed; the activations come from the checkpoint
        _, args, kwargs = capture_layer_inputs(model, layers, calib_ids[start : start + 1], device, "cpu")
        inputs = checkpoint.load_inputs(start, stop).to(store)
    shard_sizes = ranks.local_shard_sizes(nwindows)
    for index in tqdm(todo, desc="quantize", unit="layer", disable=not show, initial=first, total=len(layers)):
        layer = layers[index]
        layer.to(device)
        linears = adapter.linears(layer)
        layer_q, layer_entries = {}, []
        position = 0
        for group in adapter.sequential_groups:
            # the linears of a group read the same input, so one collector serves them all
            collector = InputGramCollector(linears[group[0]], shard_sizes, eager=ranks.is_main)
            try:
                _run_layer(layer, inputs, args, kwargs, keep_outputs=False)
            finally:
                collector.remove()
            stats = collector.stats(ranks)
            del collector
            if not torch.isfinite(stats["xtx"]).all():
                raise QuantkitError(f"layer {index} {group[0]}: calibration activations (Hessian) contain NaN or Inf")
            jobs = []
            for name in group:
                full = f"{prefix}.{index}.{name}"
                extra = (module_stats or {}).get(full)
                jobs.append((index * per_layer + position, full, linears[name],
                             stats if extra is None else {**stats, **extra}))
                position += 1
            for (_, full, _, _), (qtensor, entry) in zip(jobs, _quantize_together(ranks, jobs, method, device)):
                layer_q[full] = qtensor
                layer_entries.append(entry)
            del stats, jobs
        last = index == len(layers) - 1
        if not last:  # the last layer's outputs feed nothing that is quantized
            inputs = _run_layer(layer, inputs, args, kwargs)
        layer.to("cpu")
        finish_layer(index, layer_q, layer_entries, None if last else inputs, start)
    return qtensors, log_entries
