"""Export uniform (rtn/gptq) artifacts to the checkpoint formats vLLM, SGLang and transformers load.

quantkit's uniform tensors already hold the bits these formats store: the integer codes are one
LSB-first bitstream per output row, exactly the packing of compressed-tensors and (transposed) of
the GPTQ format. An export is therefore transposes, renames and a config; the exported weights
dequantize to exactly quantkit's. What a target cannot represent, or what its loaders reject, is
refused before anything is written, with the format that can take it named.
"""

import json
import shutil
import time
from pathlib import Path

import torch

from quantkit.artifact import (
    check_out_dir,
    directory_written_whole,
    is_quantkit_artifact,
    read_config,
    read_quantized_tensors,
)
from quantkit.errors import QuantkitError
from quantkit.export import compressed_tensors, gptq
from quantkit.formats.uniform import UniformQuantizedTensor

TARGETS = {"gptq": gptq, "compressed-tensors": compressed_tensors}

# files of the artifact that the export replaces rather than copies
_NOT_COPIED = {"config.json", "model.safetensors.index.json"}


def export_artifact(src, out, to, *, checkpoint_format="gptq", overwrite=False, verify=True) -> dict:
    """Write the uniform artifact `src` as a `to` checkpoint ("gptq" or "compressed-tensors") in `out`.
    checkpoint_format (gptq only): "gptq" (v1, zero points stored minus one, what vLLM reads) or
    "gptq_v2" (zero points as they are; GPTQModel). Returns a summary dict."""
    if to not in TARGETS:
        raise QuantkitError(f"unknown export target {to!r}; available: {', '.join(TARGETS)}")
    target = TARGETS[to]
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise QuantkitError("--out must differ from the source artifact")
    _check_out(out, overwrite)
    config = read_config(src)
    qcfg = config.pop("quantization_config")
    modules = qcfg["modules"]
    not_uniform = sorted({meta.get("format") for meta in modules.values()} - {"uniform"})
    if not_uniform:
        raise QuantkitError(f"{src}: only uniform (rtn/gptq) artifacts export to {to}; this one stores "
                            f"{', '.join(not_uniform)} weights, which only quantkit's runtime serves")
    settings = _shared_settings(src, modules)
    check_whole_groups(settings, to)
    target.check(settings, checkpoint_format)

    start = time.perf_counter()
    qtensors, tensors = read_quantized_tensors(src, modules, verify=verify)
    for name, qt in qtensors.items():
        assert isinstance(qt, UniformQuantizedTensor)  # _shared_settings admitted uniform modules only
        converted = target.module_tensors(qt, checkpoint_format)
        tensors.update({f"{name}.{key}": value.contiguous() for key, value in converted.items()})
    quant_config = target.quantization_config(settings, checkpoint_format, lambda: _linears_left_float(config, modules))
    config["quantization_config"] = quant_config
    _write(src, out, config, tensors, quant_config, to)
    return {"out": str(out), "to": to, "modules_exported": len(modules), "source": str(src),
            "settings": settings, "export_seconds": round(time.perf_counter() - start, 2)}


def _check_out(out: Path, overwrite: bool):
    """Like an artifact's --out: an existing directory is replaced only with overwrite, and only if it
    is empty, a quantkit artifact or an earlier export (which carries quantkit's quant_log.json)."""
    if out.is_dir() and overwrite and not is_quantkit_artifact(out) and (out / "quant_log.json").is_file():
        try:
            method = json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"]
        except (OSError, ValueError, KeyError, TypeError):
            method = None
        if method in ("gptq", "compressed-tensors"):
            return
    check_out_dir(out, overwrite)


def check_whole_groups(settings: dict, to: str):
    """Neither target has a partial last group (quantkit keeps one where the group size does not divide a
    row, as the GPTQ reference does), and their loaders expect whole groups."""
    group_size = settings["group_size"]
    for d in settings["in_features"]:
        if group_size != -1 and d % group_size:
            raise QuantkitError(f"group size {group_size} does not divide the input width {d}; {to} has no partial "
                                "last group (re-quantize with a group size that divides it)")


def _shared_settings(src, modules) -> dict:
    """bits, group size (-1 = per-channel), symmetry and act-order of the artifact's linears: the
    formats declare one scheme, so the linears must share them."""
    seen = set()
    for meta in modules.values():
        per_channel = meta["group_size"] >= meta["in_features"]
        seen.add((meta["bits"], -1 if per_channel else meta["group_size"], meta["sym"], bool(meta.get("has_g_idx"))))
    if len(seen) != 1:
        raise QuantkitError(f"{src}: its linears use {len(seen)} different settings (bits, group, sym, act-order); "
                            "an exported checkpoint declares one")
    bits, group_size, sym, g_idx = seen.pop()
    widths = sorted({meta["in_features"] for meta in modules.values()})
    outs = sorted({meta["out_features"] for meta in modules.values()})
    return {"bits": bits, "group_size": group_size, "sym": sym, "act_order_g_idx": g_idx,
            "in_features": widths, "out_features": outs}


def _linears_left_float(config: dict, modules: dict) -> list:
    """Names of the model's nn.Linear modules that the artifact keeps in float (usually lm_head),
    found on a model built on the meta device from the config."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.loader import _model_config

    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(_model_config(config))
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear) and name not in modules)


def _write(src, out, config, tensors, quant_config, to):
    """Write to a temporary sibling and put it in place when complete: nothing half written is ever left."""
    from huggingface_hub import save_torch_state_dict

    with directory_written_whole(out, "the export") as tmp:
        save_torch_state_dict(tensors, str(tmp), max_shard_size="4GB", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        if to == "gptq":  # GPTQModel and AutoGPTQ read the settings from this file
            (tmp / "quantize_config.json").write_text(json.dumps(quant_config, indent=2, sort_keys=True))
        for path in src.iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name not in _NOT_COPIED:
                shutil.copy2(path, tmp / path.name)
