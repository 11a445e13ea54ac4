"""SqueezeLLM-style non-uniform quantization: per-row sensitivity-weighted k-means codebooks.

Per output row, sensitivity-weighted 1-D k-means with 2^b centroids (exact, by the C++ extension of
kmeans_native.py when it builds; else the torch heuristic
of kmeans.py); stored as a per-row fp16 lookup table plus b-bit codes in the any-precision bitplane
format with seed == parent == b (formats/anyprec.py).

With table_refit "output" each table is then refitted to the calibration output error, codes fixed
(table_refit.py).

Sensitivity (the k-means weight of every element of W):
  "activation"  diag(Σ xᵀx) of the layer input, broadcast over the rows (stats "hessian"); cheap,
                gathered by the engine like GPTQ's Hessian.
  "none"        all ones (plain k-means), needs no calibration.
  "fisher"      Σ (∂loss/∂w)² over the calibration windows (SqueezeLLM's diagonal Fisher),
                computed once for the float model by engine/fisher.py before the layer walk
                (stats "fisher": the pipeline passes it to the engine as per-module stats).
"""

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.methods.base import Method, register_method
from quantkit.methods.configs import SENSITIVITIES, SqueezeLLMConfig
from quantkit.methods.kmeans import SortedRows, kmeans_runs
from quantkit.methods.kmeans_native import native_anyprec
from quantkit.methods.table_refit import refit_table


def sensitivity_weights(weight: torch.Tensor, stats, kind: str) -> torch.Tensor:
    """k-means weight of every element of `weight` [k, d] (broadcastable view)."""
    if kind == "none":
        return torch.ones_like(weight)
    if kind == "fisher":
        if stats is None or "fisher" not in stats:
            raise QuantkitError("--sensitivity fisher needs the Fisher statistics (calibration data, --nsamples > 0)")
        fisher = stats["fisher"].to(device=weight.device, dtype=torch.float64)
        return fisher + 1e-6 * fisher.mean().clamp_min(1e-30)
    if kind == "activation":
        if stats is None or "xtx" not in stats:
            raise QuantkitError("--sensitivity activation needs calibration statistics (--nsamples > 0)")
        diag = stats["xtx"].diagonal().to(device=weight.device, dtype=torch.float64)
        # a column no token ever activates still gets a tiny weight, so its values keep a cluster
        diag = diag + 1e-6 * diag.mean().clamp_min(1e-30)
        return diag[None, :].expand_as(weight)
    raise QuantkitError(f"unknown --sensitivity {kind!r}; choose {', '.join(SENSITIVITIES)}")


def seed_clusters(weight, sens, bits):
    """(SortedRows, starts [k, 2^bits + 1], centroids [k, 2^bits]) of the weighted k-means seed."""
    sr = SortedRows(weight, sens)
    starts, centroids = kmeans_runs(sr, 2**bits)
    return sr, starts, centroids


def sensitivity_stats(kind):
    """The statistics the engine must gather for a sensitivity."""
    return {"none": (), "activation": ("hessian",), "fisher": ("hessian", "fisher")}[kind]


def refit_stats(kind, table_refit):
    """The statistics for a sensitivity and a table refit (the output refit needs the Hessian)."""
    stats = sensitivity_stats(kind)
    return stats if table_refit == "none" or "hessian" in stats else ("hessian", *stats)


def refit_tables(weight, codes, luts, parent_bits, stats):
    """Output-aware refit (table_refit.py) of every width's table {b: [k, 2^b]} of the parent codes [k, d];
    returns (new tables, {b: rows refitted})."""
    out, rows = {}, {}
    for b, lut in luts.items():
        out[b], better = refit_table(weight, codes >> (parent_bits - b), lut, stats["xtx"])
        rows[b] = int(better.sum())
    return out, rows


@register_method(SqueezeLLMConfig)
class SqueezeLLM(Method):
    output_format = "anyprec"

    @property
    def stats(self):
        return refit_stats(self.sensitivity, self.table_refit)

    def quantize(self, weight, stats):
        sens = sensitivity_weights(weight, stats, self.sensitivity)
        native = native_anyprec(weight, sens, self.bits, self.bits)  # exact k-means; None without the extension
        if native is not None:
            codes, luts, info = native.codes, native.luts, {"weighted_sse": native.sse[self.bits].sum().item()}
        else:
            sr, starts, centroids = seed_clusters(weight, sens, self.bits)
            codes, luts = sr.codes(starts), {self.bits: centroids}
            info = {"weighted_sse": sr.run_sse(starts).sum().item()}
        if self.table_refit == "output":
            luts, rows = refit_tables(weight, codes, luts, self.bits, stats)
            info["table_refit_rows"] = rows[self.bits]
        return AnyPrecisionTensor.from_codes(codes, luts, self.bits, self.bits), info
