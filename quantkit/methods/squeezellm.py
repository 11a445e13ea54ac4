"""SqueezeLLM-style non-uniform quantization: per-row sensitivity-weighted k-means codebooks.

Per output row, sensitivity-weighted 1-D k-means with 2^b centroids (exact, by the C++ extension of
kmeans_native.py when it builds; else the torch heuristic
of kmeans.py); stored as a per-row fp16 lookup table plus b-bit codes in the any-precision bitplane
format with seed == parent == b (formats/anyprec.py).

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


@register_method(SqueezeLLMConfig)
class SqueezeLLM(Method):
    output_format = "anyprec"

    @property
    def stats(self):
        return sensitivity_stats(self.sensitivity)

    def quantize(self, weight, stats):
        sens = sensitivity_weights(weight, stats, self.sensitivity)
        native = native_anyprec(weight, sens, self.bits, self.bits)  # exact k-means; None without the extension
        if native is not None:
            qt = AnyPrecisionTensor.from_codes(native.codes, native.luts, self.bits, self.bits)
            return qt, {"weighted_sse": native.sse[self.bits].sum().item()}
        sr, starts, centroids = seed_clusters(weight, sens, self.bits)
        qt = AnyPrecisionTensor.from_codes(sr.codes(starts), {self.bits: centroids}, self.bits, self.bits)
        return qt, {"weighted_sse": sr.run_sse(starts).sum().item()}
