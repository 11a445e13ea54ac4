"""The end-to-end jobs behind the CLI: quantize a checkpoint into an artifact, evaluate a model."""

import logging
import platform
import time
from pathlib import Path

import torch

from quantkit import __version__
from quantkit.artifact import float_tensors, write_artifact
from quantkit.data import calibration_windows, eval_tokens
from quantkit.engine import quantize_model
from quantkit.errors import QuantkitError
from quantkit.eval import perplexity
from quantkit.methods import make_method
from quantkit.models import adapter_for, load_model, load_tokenizer, resolve_source

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantkitError("--device cuda requested but no CUDA device is available")
    if not device.startswith(("cpu", "cuda")):
        raise QuantkitError(f"unknown device {device!r}; use cpu or cuda[:N]")
    return device


def resolve_dtype(dtype, device):
    if dtype is None:
        return torch.float16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise QuantkitError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)}")
    return DTYPES[dtype]


def output_format(quantizer, fmt=None):
    """The format to store: the method's own (`output_format`, default uniform), or bcq for a uniform
    method, converted exactly (LUT-GEMM appendix C). Refuses any other combination up front."""
    native = getattr(quantizer, "output_format", "uniform")
    if fmt in (None, native):
        return native
    if fmt != "bcq" or native != "uniform":
        raise QuantkitError(f"--format {fmt} is not available for --method {quantizer.name}, which writes {native} "
                            "tensors; only uniform methods (rtn, gptq) can also be written as bcq")
    if getattr(quantizer, "act_order", False) and not getattr(quantizer, "static_groups", False):
        raise QuantkitError("--format bcq needs groups of consecutive columns: with --act-order add --static-groups")
    return fmt


def convert_qtensors(qtensors: dict, fmt: str) -> dict:
    """{module: QuantizedTensor} with every tensor in `fmt` (uniform -> bcq is the only conversion)."""
    from quantkit.formats.bcq import bcq_from_uniform

    out = {}
    for name, qt in qtensors.items():
        if qt.format_name == fmt:
            out[name] = qt
        elif fmt == "bcq" and qt.format_name == "uniform":
            try:
                out[name] = bcq_from_uniform(qt)
            except QuantkitError as exc:
                raise QuantkitError(f"{name}: {exc}") from exc
        else:
            raise QuantkitError(f"{name}: cannot convert a {qt.format_name} tensor to {fmt}")
    return out


def quantize_checkpoint(src, out, method, method_params, *, calib="c4", nsamples=None, seqlen=2048, seed=0,
                        device=None, dtype=None, data_dir=None, overwrite=False, progress=True, fmt=None):
    """Quantize `src` with `method` and write the artifact to `out`. Returns a summary dict."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise QuantkitError(f"{out} already exists; pass --overwrite to replace it")
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    quantizer = make_method(method, **method_params)
    fmt = output_format(quantizer, fmt)
    if nsamples is None:
        nsamples = 128 if quantizer.stats else 0
    if quantizer.stats and nsamples < 1:
        raise QuantkitError(f"--method {method} needs calibration data: --nsamples must be >= 1")
    torch.manual_seed(seed)

    source = resolve_source(src)
    tokenizer = load_tokenizer(source)
    model = load_model(source, dtype=torch_dtype)
    adapter = adapter_for(model.config)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if nsamples and max_positions and seqlen > max_positions:
        raise QuantkitError(f"--seqlen {seqlen} exceeds the model's context of {max_positions} tokens")

    calib_ids, calib_protocol = None, None
    if nsamples:
        calib_ids, calib_protocol = calibration_windows(calib, tokenizer, nsamples, seqlen, seed, data_dir)

    module_stats, sensitivity_seconds = None, None
    if "fisher" in quantizer.stats:  # whole-model squared gradients, before any layer is quantized
        from quantkit.engine.fisher import fisher_sensitivity

        start = time.perf_counter()
        names = {f"{adapter.layers_path}.{i}.{n}" for i, layer in enumerate(adapter.layers(model))
                 for n in adapter.linears(layer)}
        model.to(device)
        fisher = fisher_sensitivity(model, calib_ids, names=names, device=device)
        model.to("cpu")
        module_stats = {name: {"fisher": value.to("cpu")} for name, value in fisher.items()}
        sensitivity_seconds = round(time.perf_counter() - start, 2)
        del fisher

    start = time.perf_counter()
    qtensors, entries = quantize_model(model, adapter, quantizer, calib_ids, device=device, progress=progress,
                                       module_stats=module_stats)
    elapsed = time.perf_counter() - start

    quant_config = {"method": method, **quantizer.config(), "architecture": adapter.name}
    if fmt != "uniform":  # bcq; from rtn/gptq the engine kept the uniform weights (z differs by fp16 rounding)
        qtensors = convert_qtensors(qtensors, fmt)
        quant_config["format"] = fmt
    summary = {"model": source.display, "method": method, "settings": quantizer.config(),
               "calibration": calib_protocol, "device": device, "dtype": str(torch_dtype).replace("torch.", ""),
               "quantize_seconds": round(elapsed, 2), "modules_quantized": len(qtensors),
               **({} if sensitivity_seconds is None else {"sensitivity_seconds": sensitivity_seconds}),
               "quantkit_version": __version__, "torch": torch.__version__, "host": platform.node()}
    quant_log = {**summary, "modules": entries}
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["use_cache"] = True
    write_artifact(out, model_config=config, tokenizer=tokenizer, qtensors=qtensors,
                   float_tensors=float_tensors(model, qtensors), quantization_config=quant_config,
                   quant_log=quant_log, overwrite=overwrite)
    summary["out"] = str(out)
    return summary


def load_for_eval(src, device="cpu", dtype=None, verify=True, bits=None):
    """(model, tokenizer, source) for a float checkpoint or a quantkit artifact, on `device`; `bits`
    picks the served width of an any-precision artifact."""
    from quantkit.runtime import load_quantized

    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    source = resolve_source(src)
    tokenizer = load_tokenizer(source)
    if source.kind == "artifact":
        model = load_quantized(source.path, device=device, dtype=torch_dtype, verify=verify, bits=bits)
    elif bits is not None:
        raise QuantkitError(f"--bits applies only to any-precision artifacts, not to {source.display}")
    else:
        model = load_model(source, dtype=torch_dtype).to(device)
    return model, tokenizer, source


def evaluate_ppl(src, datasets, *, seqlen=2048, max_windows=None, device=None, dtype=None, data_dir=None,
                 batch_size=1, verify=True, progress=True, bits=None):
    """Perplexity of one model on each dataset; one result dict per dataset, protocol included.
    `bits` serves that width of an any-precision artifact (recorded as served_bits)."""
    device = resolve_device(device)
    model, tokenizer, source = load_for_eval(src, device, dtype, verify, bits=bits)
    results = []
    for name in datasets:
        ids, protocol = eval_tokens(name, tokenizer, seqlen, data_dir)
        scores = perplexity(model, ids, seqlen, max_windows, device, batch_size, progress)
        results.append({"model": source.display, "model_kind": source.kind, **scores, **protocol,
                        "tokenizer": type(tokenizer).__name__, "vocab_size": len(tokenizer),
                        "device": device, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                        **({} if bits is None else {"served_bits": bits})})
    return results


def convert_artifact(src, out, fmt="bcq", overwrite=False):
    """Rewrite the quantkit artifact `src` with every quantized module in `fmt` (uniform -> bcq, LUT-GEMM
    appendix C); float tensors, tokenizer and settings are carried over. Returns a summary dict."""
    from quantkit.artifact import read_config, read_log, read_tensors, split_module_tensors
    from quantkit.formats.base import quantized_tensor_from_state_dict

    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise QuantkitError("--out must differ from the source artifact")
    if out.exists() and not overwrite:
        raise QuantkitError(f"{out} already exists; pass --overwrite to replace it")
    config = read_config(src)
    qcfg = config.pop("quantization_config")
    per_module, rest = split_module_tensors(read_tensors(src), qcfg["modules"])
    qtensors = {name: quantized_tensor_from_state_dict(meta, per_module[name]) for name, meta in qcfg["modules"].items()}
    start = time.perf_counter()
    qtensors = convert_qtensors(qtensors, fmt)
    elapsed = time.perf_counter() - start
    tokenizer = None
    if any((src / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(src))
    settings = {k: v for k, v in qcfg.items() if k not in ("quant_method", "quantkit_version", "modules", "files")}
    quant_config = {**settings, "format": fmt, "converted_from": str(src)}
    quant_log = {**read_log(src), "converted_from": str(src), "convert_seconds": round(elapsed, 2)}
    write_artifact(out, model_config=config, tokenizer=tokenizer, qtensors=qtensors, float_tensors=rest,
                   quantization_config=quant_config, quant_log=quant_log, overwrite=overwrite)
    return {"out": str(out), "format": fmt, "modules_converted": len(qtensors), "convert_seconds": round(elapsed, 2),
            "source": str(src), "settings": settings}
