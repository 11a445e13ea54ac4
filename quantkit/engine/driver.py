"""Layer-by-layer sequential quantization.

Without calibration (methods that need no statistics) every linear is quantized straight from
its weight. With calibration the engine:
  1. captures the inputs (and call kwargs) of the first decoder layer on the calibration windows;
  2. for each layer, moves it to the device and, group by group in true-sequential order, runs
     the layer with hooks that gather statistics, quantizes the group's linears and puts their
     dequantized weights back;
  3. runs the quantized layer once more to produce the next layer's inputs, then moves it back.
Peak device memory is about one decoder layer plus the calibration activations.
"""

import logging
import time

import torch
from tqdm.auto import tqdm

from quantkit.engine.stats import InputGramCollector, output_error
from quantkit.errors import QuantkitError

log = logging.getLogger(__name__)


class _StopForward(Exception):
    pass


class _InputCatcher(torch.nn.Module):
    """Stands in for layer 0, records its inputs and aborts the forward pass."""

    def __init__(self, layer, sink):
        super().__init__()
        self.layer = layer
        self.sink = sink

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((hidden_states, args, kwargs))
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
    for name, param in module.named_parameters(recurse=False):
        param.data = param.data.to(device)
    for name, buf in module.named_buffers(recurse=False):
        module._buffers[name] = buf.to(device)
    for child in module.children():
        _move_outside(child, skip, device)


@torch.no_grad()
def capture_layer_inputs(model, layers, calib_ids, device):
    """Run the model up to its first decoder layer; returns (inputs [n, T, h], args, kwargs)."""
    _move_outside(model, layers, device)
    sink = []
    original = layers[0]
    layers[0] = _InputCatcher(original, sink)
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
    kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
    return inputs, args, kwargs


def _run_layer(layer, inputs, args, kwargs):
    outputs = torch.empty_like(inputs)
    for i in range(inputs.shape[0]):
        out = layer(inputs[i : i + 1], *args, **kwargs)
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


@torch.no_grad()
def quantize_model(model, adapter, method, calib_ids=None, device="cpu", progress=True, module_stats=None):
    """Quantize every adapter linear of `model` in place (weights replaced by their dequantized
    values). Returns ({module name: QuantizedTensor}, [per-module log entries]). `module_stats`
    ({module name: {key: tensor}}, e.g. the whole-model Fisher diagonal) is merged into the
    statistics of that module."""
    layers = adapter.layers(model)
    needs_stats = bool(method.stats)
    if needs_stats and calib_ids is None:
        raise QuantkitError(f"--method {method.name} needs calibration data (--nsamples > 0)")
    qtensors, log_entries = {}, []
    prefix = adapter.layers_path

    if calib_ids is None:
        for index, layer in enumerate(tqdm(layers, desc="quantize", unit="layer", disable=not progress)):
            for name, linear in adapter.linears(layer).items():
                full = f"{prefix}.{index}.{name}"
                qtensors[full], entry = _quantize_linear(method, full, linear, None, device)
                log_entries.append(entry)
        return qtensors, log_entries

    inputs, args, kwargs = capture_layer_inputs(model, layers, calib_ids, device)
    for index, layer in enumerate(tqdm(layers, desc="quantize", unit="layer", disable=not progress)):
        layer.to(device)
        linears = adapter.linears(layer)
        for group in adapter.sequential_groups:
            # the linears of a group read the same input, so one collector serves them all
            collector = InputGramCollector(linears[group[0]])
            try:
                _run_layer(layer, inputs, args, kwargs)
            finally:
                collector.remove()
            stats = collector.stats()
            if not torch.isfinite(stats["xtx"]).all():
                raise QuantkitError(f"layer {index} {group[0]}: calibration activations (Hessian) contain NaN or Inf")
            for name in group:
                full = f"{prefix}.{index}.{name}"
                extra = (module_stats or {}).get(full)
                module_in = stats if extra is None else {**stats, **extra}
                qtensors[full], entry = _quantize_linear(method, full, linears[name], module_in, device)
                log_entries.append(entry)
            del collector, stats
        inputs = _run_layer(layer, inputs, args, kwargs)
        layer.to("cpu")
    return qtensors, log_entries
