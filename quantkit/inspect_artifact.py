"""A short summary of an artifact for `quantkit inspect`."""

from collections import Counter
from pathlib import Path

from quantkit.artifact import read_config, read_log, verify_files
from quantkit.bitfamily import measured_bits


def summarize(path, verify=True) -> dict:
    """Method, settings, formats, sizes, calibration and errors; the tensor files' checksums are checked
    first unless verify=False, so a damaged artifact is reported, not summarised."""
    path = Path(path)
    config = read_config(path)
    qcfg = config["quantization_config"]
    if verify:
        verify_files(path, qcfg)
    log = read_log(path)
    modules = log.get("modules", [])
    bits = measured_bits(path, verify=False)  # checked above
    settings = {k: v for k, v in qcfg.items() if k not in ("modules", "files", "quant_method", "method")}
    summary = {
        "artifact": str(path),
        "model_type": config.get("model_type"),
        "layers": config.get("num_hidden_layers"),
        "method": qcfg.get("method"),
        "settings": settings,
        "formats": dict(Counter(m["format"] for m in qcfg["modules"].values())),
        "quantized_modules": len(qcfg["modules"]),
        "bits_per_weight": round(bits["bits_per_weight"], 5),
        "files": {f: f"{(path / f).stat().st_size / 2**20:.1f} MiB" for f in qcfg["files"]},
        "source_model": log.get("model"),
        "quantize_seconds": log.get("quantize_seconds"),
    }
    if log.get("calibration"):
        cal = log["calibration"]
        summary["calibration"] = {k: cal.get(k) for k in ("dataset", "nsamples", "seqlen", "seed", "source")}
    if modules and "output_mse" in modules[0]:
        worst = max(modules, key=lambda m: m["output_mse"])
        summary["worst_output_mse"] = f"{worst['module']} {worst['output_mse']:.3e}"
    if modules:
        summary["mean_weight_mse"] = f"{sum(m['weight_mse'] for m in modules) / len(modules):.3e}"
    return summary
