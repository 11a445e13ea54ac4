"""The end-to-end jobs behind the CLI: quantize a checkpoint into an artifact, evaluate a model."""

import logging
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from quantkit import __version__
from quantkit.artifact import check_out_dir, check_output_location, float_tensors, read_log, write_artifact
from quantkit.data import calibration_windows, check_available, eval_tokens
from quantkit.data.calib_file import is_calibration_file
from quantkit.engine import quantize_model
from quantkit.engine.spill import QuantizedStore, remove_stale_spills, spill_dir
from quantkit.engine.timing import EngineTimer
from quantkit.errors import CheckpointError, QuantkitError, StorageError
from quantkit.eval import perplexity
from quantkit.kernels.build import sources_digest
from quantkit.methods import make_method
from quantkit.models import adapter_for, check_architecture, load_model, load_tokenizer, resolve_source
from quantkit.models.lazy import check_shards
from quantkit.models.loading import checkpoint_dtype
from quantkit.settings import DEFAULT_NSAMPLES, DEFAULT_VAL_WINDOWS

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device):
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantkitError("--device cuda requested but no CUDA device is available")
    if not device.startswith(("cpu", "cuda")):
        raise QuantkitError(f"unknown device {device!r}; use cpu or cuda[:N]")
    return device


def resolve_dtype(dtype, device, native=None):
    """The compute dtype: a torch.dtype, its name ("float16", ...), or None / "auto": on CUDA the
    checkpoint's own dtype `native` when it is bfloat16 or float16 (a bf16-trained model can overflow
    fp16 activations), else float16; float32 on the CPU (where fp16/bf16 matmuls are slow or emulated)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if not device.startswith("cuda"):
            return torch.float32
        return native if native in (torch.float16, torch.bfloat16) else torch.float16
    if dtype not in DTYPES:
        raise QuantkitError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def storage_dtype(native):
    """The dtype of an artifact's unquantized tensors: bfloat16 for a bf16 checkpoint (fp16 could overflow
    its values), else float16."""
    return torch.bfloat16 if native == torch.bfloat16 else torch.float16


def output_format(quantizer, fmt=None):
    """The format to store: the method's own (`output_format`, default uniform), or bcq for a uniform
    method, converted by LUT-GEMM appendix C (exact but for the fp16 rounding of the offset). Refuses
    any other combination up front."""
    native = getattr(quantizer, "output_format", "uniform")
    if fmt in (None, native):
        return native
    if fmt != "bcq" or native != "uniform":
        raise QuantkitError(f"--format {fmt} is not available for --method {quantizer.name}, which writes {native} "
                            "tensors; only uniform methods (rtn, gptq) can also be written as bcq")
    if getattr(quantizer, "act_order", False) and not getattr(quantizer, "static_groups", False):
        raise QuantkitError("--format bcq needs groups of consecutive columns: with --act-order add --static-groups")
    return fmt


def _convert_one(name, qt, fmt):
    from quantkit.formats.bcq import bcq_from_uniform

    if qt.format_name == fmt:
        return qt
    if fmt == "bcq" and qt.format_name == "uniform":
        try:
            return bcq_from_uniform(qt)
        except QuantkitError as exc:
            raise QuantkitError(f"{name}: {exc}") from exc
    raise QuantkitError(f"{name}: cannot convert a {qt.format_name} tensor to {fmt}")


def convert_qtensors(qtensors, fmt: str):
    """{module: QuantizedTensor} with every tensor in `fmt` (uniform -> bcq is the only conversion). A
    QuantizedStore (engine/spill.py) is converted one layer at a time into another store, so the converted
    tensors wait on disk too; a dict gives a dict."""
    if isinstance(qtensors, QuantizedStore):
        return qtensors.converted(lambda name, qt: _convert_one(name, qt, fmt))
    return {name: _convert_one(name, qt, fmt) for name, qt in qtensors.items()}


def check_finite_weights(model):
    """Refuse a model with NaN/Inf in any parameter before any work is done (names the tensor)."""
    for name, param in model.named_parameters():
        if param.device.type == "meta":
            continue
        bad = (~torch.isfinite(param)).sum().item() if param.is_floating_point() else 0
        if bad:
            raise QuantkitError(f"model tensor {name} contains {bad} NaN/Inf values; the checkpoint is damaged")


def _step(progress, message):
    """One line on stderr per slow step before the per-layer progress bar starts."""
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)


def estimated_bytes(source, quantizer):
    """A lower bound on the artifact's size, from the float checkpoint's tensor count (safetensors headers of
    a local directory; None for other sources): every weight at the method's widest code width."""
    if source.kind != "hf_dir":
        return None
    from quantkit.artifact import read_header

    settings = quantizer.config()
    bits = max(v for k, v in settings.items() if k in ("bits", "parent_bits", "high_bits", "low_bits"))
    params = 0
    for path in Path(source.path).glob("*.safetensors"):
        try:
            header = read_header(path)
        except QuantkitError:
            return None  # a damaged checkpoint is reported by the loader, with its own message
        for name, entry in header.items():
            if name != "__metadata__":
                params += math.prod(entry["shape"])
    return params * bits // 8 or None


def _weight_files_signature(source):
    """(name, size, mtime) of the source's weight files: cheap evidence that the model is unchanged."""
    if source.kind == "gguf":
        paths = [Path(source.path) / source.gguf_file]
    elif source.kind == "hf_dir":
        paths = sorted(p for p in Path(source.path).iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    else:
        return []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def run_fingerprint(source, model, quantizer, calib_ids, device, dtype) -> dict:
    """Everything that decides the quantized tensors; a checkpoint resumes only under an equal one."""
    import hashlib
    import json

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    calib = None
    if calib_ids is not None:
        calib = hashlib.sha256(calib_ids.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()
        calib = f"{tuple(calib_ids.shape)} {calib}"
    return {"quantkit_version": __version__, "model": source.display, "model_files": _weight_files_signature(source),
            "model_config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
            "method": quantizer.name, "settings": quantizer.config(), "calibration_windows": calib,
            "device_type": torch.device(device).type, "dtype": str(dtype).replace("torch.", ""),
            # what else changes the arithmetic: torch's kernels, the CPU thread count (sum order), quantkit's own
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads() if torch.device(device).type == "cpu" else None,
            "kernels": {"1": "disabled", "cuda": f"cuda disabled, sources {sources_digest()[:16]}"}.get(
                os.environ.get("QUANTKIT_NO_KERNELS"), f"sources {sources_digest()[:16]}")}


class _Job:
    """The reliability side of one quantize run: the ranks of a torchrun job, the layer checkpoint
    next to the output, and what is left behind when something fails.

    On failure the checkpoint is kept only where continuing makes sense — an interruption, a full
    disk, running out of memory (KeyboardInterrupt, OSError, OOM) — and the error says so; errors
    in the input itself (NaN, a Hessian that cannot be factored) remove it, as resuming would only
    meet them again."""

    def __init__(self, out, device, *, resume, checkpoint, offload_activations, overwrite):
        from quantkit.engine.distributed import init_from_env

        self.out = Path(out)
        self.ranks = init_from_env(device)
        self.device = self.ranks.device if self.ranks.distributed else device
        self.resume = resume
        self.use_checkpoint = checkpoint
        self.offload = offload_activations
        self.overwrite = overwrite
        self.fingerprint = None
        self.checkpoint = None
        self.timer = None  # the engine's EngineTimer, once it has run
        self.engine_seconds = None

    def check_settings(self, quantizer, nsamples, ensemble):
        world = self.ranks.world_size
        if ensemble and self.resume:
            raise QuantkitError("--resume is not available with --ensemble (its two flows are not checkpointed)")
        if self.resume and not self.use_checkpoint:
            raise QuantkitError("--resume continues from OUT.partial/, which --no-checkpoint turns off; "
                                "give one of them")
        if ensemble:
            self.use_checkpoint = False
        if world > 1 and ensemble:
            raise QuantkitError("--ensemble runs in one process; launch it without torchrun")
        if world > 1 and "fisher" in quantizer.stats:
            raise QuantkitError("--sensitivity fisher runs in one process; launch it without torchrun "
                                "or use activation")
        if world > 1 and nsamples and nsamples < world:
            raise QuantkitError(f"--nsamples {nsamples} is below the number of ranks ({world}); "
                                "every rank needs a window")

    def summary(self) -> dict:
        out = {"world_size": self.ranks.world_size, "offload_activations": self.offload}
        if self.checkpoint is not None and self.checkpoint.resumed_from:
            out["resumed_at_layer"] = self.checkpoint.resumed_from
        if self.timer is not None and self.timer.enabled:  # QUANTKIT_ENGINE_TIMINGS (engine/timing.py)
            out["engine_phases"] = self.timer.report(self.engine_seconds)
        return out

    def _hint(self):
        done = self.checkpoint.layers_done if self.checkpoint is not None else 0
        if not done:
            return ""
        return f"; {done} finished layers are kept in {self.checkpoint.dir}: rerun with --resume to continue"

    def _drop_checkpoint(self):
        if self.checkpoint is not None:
            import shutil

            if self.ranks.is_main:
                shutil.rmtree(self.checkpoint.dir, ignore_errors=True)
            self.checkpoint = None

    def _fail(self, exc, writing=False):
        """The exception to raise for `exc`, after deciding whether the checkpoint stays: kept (and
        named in the message) when something was saved and continuing can help; removed otherwise."""
        if self.checkpoint is not None and not self.checkpoint.layers_done:
            self._drop_checkpoint()
        if isinstance(exc, torch.OutOfMemoryError):
            return QuantkitError(f"out of memory on {self.device}: try --offload-activations, fewer --nsamples or a "
                                 f"shorter --seqlen{self._hint()}")
        if isinstance(exc, QuantkitError) and not writing and not isinstance(exc, (StorageError, CheckpointError)):
            self._drop_checkpoint()  # the input itself is at fault: resuming would meet it again
            return exc
        if isinstance(exc, QuantkitError) and self._hint():
            return type(exc)(f"{exc}{self._hint()}")
        return exc  # an interruption or a bug: the checkpoint stays for a later --resume

    def quantize(self, model, adapter, quantizer, calib_ids, module_stats, progress, blocks=None, store=None):
        from quantkit.engine.checkpoint import LayerCheckpoint

        if self.use_checkpoint:
            nwindows = 0 if calib_ids is None else calib_ids.shape[0]
            self.checkpoint = LayerCheckpoint(self.out, self.fingerprint, self.ranks, nwindows)
            self.checkpoint.prepare(self.resume, self.overwrite)
            if self.resume and self.checkpoint.layers_done:
                log.warning("resuming after %d finished layers from %s", self.checkpoint.layers_done,
                            self.checkpoint.dir)
        self.timer = EngineTimer(self.device)
        start = time.perf_counter()
        try:
            return quantize_model(model, adapter, quantizer, calib_ids, device=self.device, progress=progress,
                                  module_stats=module_stats, checkpoint=self.checkpoint,
                                  offload_activations=self.offload, ranks=self.ranks, blocks=blocks, store=store,
                                  timer=self.timer)
        except BaseException as exc:
            failure = self._fail(exc)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self.engine_seconds = time.perf_counter() - start

    def write(self, write_fn):
        """write_fn() on rank 0 (the artifact), then drop the checkpoint; every rank learns the outcome."""
        from quantkit.engine.distributed import shutdown

        failure = None
        try:
            if self.ranks.is_main:
                try:
                    write_fn()
                except BaseException as exc:
                    failure = exc
            if not self.ranks.all_ok(failure is None) and failure is None:
                failure = QuantkitError("rank 0 could not write the artifact")
            if failure is not None:
                mapped = self._fail(failure, writing=True)
                if mapped is failure:
                    raise failure
                raise mapped from failure
            if self.checkpoint is not None:
                self.checkpoint.remove()
        finally:
            shutdown(self.ranks)


def quantize_checkpoint(src, out, method, method_params, *, calib="c4", calib_field="text", calib_chat=False,
                        nsamples=None, seqlen=2048, seed=0,
                        device=None, dtype=None, data_dir=None, overwrite=False, progress=True, fmt=None,
                        ensemble=False, val_windows=DEFAULT_VAL_WINDOWS, resume=False, checkpoint=True,
                        offload_activations=False, lazy=True, spill=True):
    """Quantize `src` with `method` and write the artifact to `out`. Returns a summary dict.
    checkpoint: record every finished layer in <out>.partial/ (engine/checkpoint.py) so that a killed
    run continues with resume=True, writing the artifact an uninterrupted run would have written.
    offload_activations: keep the calibration activations in host memory (engine/driver.py).
    Under torchrun (WORLD_SIZE > 1) the work is split over the ranks (engine/distributed.py) with the
    same result; rank 0 writes.
    ensemble (ooc only): the two-flow OOC(h,l,p,s), choosing GPTQ(l) or GPTQ(h,l,p,s) by the loss on
    `val_windows` held-out windows of the calibration dataset (quantkit/ensemble.py).
    lazy: read a local safetensors checkpoint one decoder block at a time (models/lazy.py; not with the
    whole-model passes of --ensemble and Fisher sensitivity, nor for GGUF or hub sources); lazy=False
    loads it whole first.
    spill: keep every finished layer's quantized tensors on disk, not in memory, until the artifact is written
    (engine/spill.py: in the layer checkpoint's files when it is on, else in a directory beside `out` that is
    removed when the run ends); spill=False keeps them in memory, as --ensemble always does."""
    out = Path(out)
    check_out_dir(out, overwrite)
    # memory freed by one layer's tensors is handed out again in any size: without it, the GPU memory reserved
    # for a 7B model was twice what was allocated. Takes effect if CUDA has not allocated yet; the caller's
    # setting (under either name torch reads) stands.
    if not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    device = resolve_device(device)
    resolve_dtype(dtype, device)  # an unknown name is refused before anything else
    job = _Job(out, device, resume=resume, checkpoint=checkpoint, offload_activations=offload_activations,
               overwrite=overwrite)
    device = job.device
    quantizer = make_method(method, **method_params)
    fmt = output_format(quantizer, fmt)
    if nsamples is None:
        nsamples = DEFAULT_NSAMPLES if quantizer.stats else 0
    if quantizer.stats and nsamples < 1:
        raise QuantkitError(f"--method {method} needs calibration data: --nsamples must be >= 1")
    if ensemble and method != "ooc":
        raise QuantkitError(f"--ensemble is the two-flow OOC scheme: it needs --method ooc, not {method}")
    if ensemble and (not isinstance(val_windows, int) or val_windows < 1):
        raise QuantkitError(f"--val-windows must be a positive integer, got {val_windows}")
    job.check_settings(quantizer, nsamples, ensemble)
    torch.manual_seed(seed)

    # everything that can be refused is refused here, before the tokenizer or any weight is read
    source = resolve_source(src)
    size = estimated_bytes(source, quantizer)
    check_output_location(out, source.path if source.kind == "hf_dir" else None, size)
    max_positions = check_architecture(source)
    if source.kind == "hf_dir":
        check_shards(source.path)
    native_dtype = checkpoint_dtype(source)
    torch_dtype = resolve_dtype(dtype, device, native_dtype)
    if nsamples and max_positions and seqlen > max_positions:
        raise QuantkitError(f"--seqlen {seqlen} exceeds the model's context of {max_positions} tokens")
    if ensemble and is_calibration_file(calib):
        raise QuantkitError("--ensemble draws its held-out windows from a dataset's train split; use --calib c4 or "
                            "ptb with it")
    if nsamples or ensemble:
        check_available(calib, "train", data_dir, calib_field)
    _step(progress, f"loading the tokenizer of {source.display}")
    tokenizer = load_tokenizer(source)
    if calib_chat and nsamples and not getattr(tokenizer, "chat_template", None):
        raise QuantkitError(f"--calib-chat: the tokenizer of {source.display} has no chat template")
    calib_ids, calib_protocol = None, None
    if nsamples:  # before the weights: text that is missing or too short is refused without loading them
        _step(progress, f"sampling {nsamples} calibration windows of {seqlen} tokens from {calib}")
        calib_ids, calib_protocol = calibration_windows(calib, tokenizer, nsamples, seqlen, seed, data_dir,
                                                        field=calib_field, chat=calib_chat)
    loaded = time.perf_counter()
    blocks = None
    if lazy and source.kind == "hf_dir" and not ensemble and "fisher" not in quantizer.stats:
        from quantkit.models.lazy import open_lazy

        _step(progress, f"reading the weights outside the decoder blocks of {source.display}")
        opened = open_lazy(source, torch_dtype)
        if opened is not None:
            model, blocks, adapter = opened
    if blocks is None:
        _step(progress, f"loading the weights of {source.display}")
        model = load_model(source, dtype=torch_dtype)
        adapter = adapter_for(model)
    if blocks is None:  # a lazy model's tensors are checked as they are read (models/lazy.py)
        check_finite_weights(model)
    load_seconds = round(time.perf_counter() - loaded, 2)

    module_stats, sensitivity_seconds = None, None
    if "fisher" in quantizer.stats:  # whole-model squared gradients, before any layer is quantized
        from quantkit.engine.fisher import fisher_module_stats

        module_stats, sensitivity_seconds = fisher_module_stats(model, adapter, calib_ids, device)

    store = None
    try:
        ensemble_report = None
        start = time.perf_counter()
        if ensemble:
            from quantkit.data import validation_windows
            from quantkit.ensemble import ooc_flows, run_flows

            val_ids, val_protocol = validation_windows(calib, tokenizer, val_windows, seqlen, data_dir)
            _, flows, qtensors, entries = run_flows(model, adapter, ooc_flows(quantizer), calib_ids, val_ids, device,
                                                    progress, module_stats)
            ensemble_report = {"flows": flows, "validation": val_protocol}
        else:
            job.fingerprint = run_fingerprint(source, model, quantizer, calib_ids, device, torch_dtype)
            if spill:  # rank 0 writes the artifact; the other ranks keep only the modules' meta
                if job.ranks.is_main:
                    remove_stale_spills(out)
                store = QuantizedStore(spill_dir(out), keep=job.ranks.is_main)
            qtensors, entries = job.quantize(model, adapter, quantizer, calib_ids, module_stats, progress, blocks,
                                             store)
        elapsed = time.perf_counter() - start

        quant_config = {"method": method, **quantizer.config(), "architecture": adapter.name}
        if ensemble_report is not None:
            quant_config["ensemble"] = {"chosen": next(f["flow"] for f in ensemble_report["flows"] if f["chosen"]),
                                        "flows": [f["flow"] for f in ensemble_report["flows"]]}
        if fmt != "uniform":  # bcq; from rtn/gptq the engine kept the uniform weights (z differs by fp16 rounding)
            quant_config["format"] = fmt  # converted in write(): on the writing rank, where a failure is shared
        summary = {"model": source.display, "method": method, "settings": quantizer.config(),
                   "calibration": calib_protocol, "device": device, "dtype": str(torch_dtype).replace("torch.", ""),
                   "quantize_seconds": round(elapsed, 2), "load_seconds": load_seconds,
                   **({} if blocks is None else {"block_read_seconds": round(blocks.seconds, 2),
                                                 "block_read_ahead_seconds": round(blocks.ahead_seconds, 2)}),
                   "modules_quantized": len(qtensors),
                   **({} if sensitivity_seconds is None else {"sensitivity_seconds": sensitivity_seconds}),
                   **({} if ensemble_report is None else {"ensemble": ensemble_report}),
                   **job.summary(),
                   "quantkit_version": __version__, "torch": torch.__version__, "host": platform.node()}
        quant_log = {**summary, "modules": entries}
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["use_cache"] = True
        if native_dtype is not None:  # the checkpoint's own dtype, not the one the engine computed in
            config["dtype"] = str(native_dtype).replace("torch.", "")
        floats = storage_dtype(native_dtype)
        written = time.perf_counter()

        def write():
            stored = qtensors if fmt == "uniform" else convert_qtensors(qtensors, fmt)
            write_artifact(out, model_config=config, tokenizer=tokenizer, qtensors=stored,
                           float_tensors=float_tensors(model, stored, floats), quantization_config=quant_config,
                           quant_log=quant_log, overwrite=overwrite)

        job.write(write)
    finally:
        if blocks is not None:
            blocks.close()
        if store is not None:
            store.remove()
    summary["write_seconds"] = round(time.perf_counter() - written, 2)
    summary["out"] = str(out)
    return summary


def load_for_eval(src, device="cpu", dtype=None, verify=True, bits=None):
    """(model, tokenizer, source) for a float checkpoint or a quantkit artifact, on `device`; `bits`
    picks the served width of an any-precision artifact."""
    from quantkit.runtime import load_quantized

    device = resolve_device(device)
    source = resolve_source(src)
    torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype(source))
    tokenizer = load_tokenizer(source)
    if source.kind == "artifact":
        model = load_quantized(source.path, device=device, dtype=torch_dtype, verify=verify, bits=bits)
    elif bits is not None:
        raise QuantkitError(f"--bits applies only to any-precision artifacts, not to {source.display}")
    else:
        model = load_model(source, dtype=torch_dtype).to(device)
    return model, tokenizer, source


def evaluate_ppl(src, datasets, *, seqlen=2048, max_windows=None, device=None, dtype=None, data_dir=None,
                 batch_size=1, verify=True, progress=True, bits=None, against=None, reference=None):
    """Perplexity of one model on each dataset; one result dict per dataset, protocol included.
    `bits` serves that width of an any-precision artifact (recorded as served_bits). `against`: a
    reference model scored on the same windows (KL divergence, top-1 agreement; see eval/perplexity.py)."""
    device = resolve_device(device)
    model, tokenizer, source = load_for_eval(src, device, dtype, verify, bits=bits)
    reference_source = None
    if against is not None or reference is not None:  # reference: load_for_eval's triple, loaded once for many
        reference = reference or load_for_eval(against, device, dtype, verify)
        reference, reference_tokenizer, reference_source = reference
        if reference_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise QuantkitError(f"--against {reference_source.display} has another tokenizer than {source.display}; "
                                "divergences compare next-token distributions over one vocabulary")
    quantized_with = {}
    if source.kind == "artifact":  # how the artifact was made: its calibration counts in comparisons too
        log = read_log(source.path)
        keys = ("model", "method", "settings", "calibration")
        quantized_with = {"quantized_with": {key: log.get(key) for key in keys}}
    results = []
    for name in datasets:
        ids, protocol = eval_tokens(name, tokenizer, seqlen, data_dir)
        scores = perplexity(model, ids, seqlen, max_windows, device, batch_size, progress, reference=reference)
        if reference is not None:
            scores["reference"] = reference_source.display
        results.append({"model": source.display, "model_kind": source.kind, **scores, **protocol,
                        "tokenizer": type(tokenizer).__name__, "tokenizer_source": tokenizer.name_or_path,
                        "vocab_size": len(tokenizer), **quantized_with,
                        "device": device, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
                        **({} if bits is None else {"served_bits": bits})})
    return results


def convert_artifact(src, out, fmt="bcq", overwrite=False):
    """Rewrite the quantkit artifact `src` with every quantized module in `fmt` (uniform -> bcq, LUT-GEMM
    appendix C); float tensors, tokenizer and settings are carried over. Returns a summary dict."""
    from quantkit.artifact import read_config, read_quantized_tensors

    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise QuantkitError("--out must differ from the source artifact")
    check_out_dir(out, overwrite)
    config = read_config(src)
    qcfg = config.pop("quantization_config")
    qtensors, rest = read_quantized_tensors(src, qcfg["modules"])
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
