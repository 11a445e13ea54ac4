"""Any-precision quantization by incremental upscaling (Any-Precision LLM §4): a SqueezeLLM seed at
`seed_bits`, then for each extra bit every cluster of every row is split in two by the exact
sensitivity-weighted 2-means of its own members (kmeans.split_runs, exact=True: the best cut of the
sorted members; a 2-means Lloyd split from the cluster mean lost ~2 % more SSE at 4-6 bits on a
random 1536×576 matrix but ~8 % less at 8 bits: greedy per-level optimality is not optimal for
later levels), so the (b+1)-bit code of each
weight starts with its b-bit code. The b-bit table holds the weighted means of the b-bit clusters
(the optimal centroids for the nested assignment). Stored as one anyprec tensor: parent_bits
bitplanes + one LUT per width in seed..parent. Vectorised over rows.

When the C++ extension builds (kmeans_native.py) it does all of this instead: an exact k-means seed,
the same exact splits (upscale="split", the default), or the joint rule (upscale="joint": nested
partitions chosen for a blended SSE of every width; on SmolLM2 4..8 bits lose 5-31 % less SSE for
<= 1 % more at the seed width, scripts/bench_anyprec_cpu.py, but no perplexity: BENCHMARKS.md, issue 5
table, 2026-11-24). Without it the torch path below runs, which knows only "split".
"""

import warnings

from quantkit.errors import QuantkitError
from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.methods.base import Method, register_method
from quantkit.methods.kmeans import split_runs
from quantkit.methods.kmeans_native import check_upscale, native_anyprec
from quantkit.methods.squeezellm import check_sensitivity, seed_clusters, sensitivity_stats, sensitivity_weights


def upscale(sr, starts, centroids, seed_bits, parent_bits):
    """Split the seed clusters bit by bit; returns (parent starts, {bits: centroids [k, 2^bits]})."""
    luts = {seed_bits: centroids}
    for bits in range(seed_bits + 1, parent_bits + 1):
        starts = split_runs(sr, starts, exact=True)
        # an empty child (a cluster of one distinct value) inherits its parent's centroid
        luts[bits] = sr.run_means(starts, luts[bits - 1].repeat_interleave(2, dim=1))
    return starts, luts


@register_method
class AnyPrecision(Method):
    name = "anyprec"
    output_format = "anyprec"
    stats = ("hessian",)
    # upscale: "joint" or "split" (see kmeans_native); level_weights: joint's λ multipliers for bits
    # seed..parent (None: kmeans_native.default_level_weights)
    params = {"seed_bits": 3, "parent_bits": 8, "sensitivity": "activation", "upscale": "split",
              "level_weights": None}

    def validate(self):
        for key in ("seed_bits", "parent_bits"):
            value = getattr(self, key)
            if not isinstance(value, int) or not 1 <= value <= 8:
                raise QuantkitError(f"--{key.replace('_', '-')} must be an integer in 1..8, got {value}")
        if self.parent_bits < self.seed_bits:
            raise QuantkitError(f"--parent-bits {self.parent_bits} is below --seed-bits {self.seed_bits}")
        check_sensitivity(self.sensitivity)
        check_upscale(self.upscale)
        self.stats = sensitivity_stats(self.sensitivity)

    def quantize(self, weight, stats):
        sens = sensitivity_weights(weight, stats, self.sensitivity)
        native = native_anyprec(weight, sens, self.seed_bits, self.parent_bits, self.upscale, self.level_weights)
        if native is not None:
            qt = AnyPrecisionTensor.from_codes(native.codes, native.luts, self.seed_bits, self.parent_bits)
            return qt, {"seed_weighted_sse": native.sse[self.seed_bits].sum().item(),
                        "parent_weighted_sse": native.sse[self.parent_bits].sum().item()}
        if self.upscale != "split":
            warnings.warn(f"anyprec upscale={self.upscale!r} needs the C++ extension; using split")
        sr, starts, centroids = seed_clusters(weight, sens, self.seed_bits)
        seed_sse = sr.run_sse(starts).sum().item()
        starts, luts = upscale(sr, starts, centroids, self.seed_bits, self.parent_bits)
        qt = AnyPrecisionTensor.from_codes(sr.codes(starts), luts, self.seed_bits, self.parent_bits)
        return qt, {"seed_weighted_sse": seed_sse, "parent_weighted_sse": sr.run_sse(starts).sum().item()}
