"""Any-precision quantization by incremental upscaling (Any-Precision LLM §4): one artifact, every width.

A SqueezeLLM seed at `seed_bits`, then for each extra bit every cluster of every row is split in two by
the exact sensitivity-weighted 2-means of its own members (kmeans.split_runs, exact=True: the best cut of
the sorted members), so the (b+1)-bit code of each weight starts with its b-bit code. The b-bit table holds
the weighted means of the b-bit clusters (the optimal centroids for the nested assignment). Stored as one
anyprec tensor: parent_bits bitplanes + one LUT per width in seed..parent. Vectorised over rows.

When the C++ extension builds (kmeans_native.py) it does all of this instead, with an exact k-means seed
and the same exact splits; without it the torch path below runs. Then, by default (table_refit "output"),
every width's table is refitted to the calibration output error with its codes fixed (table_refit.py):
the splits cannot move the coarser cuts, but each width's table can follow the output error for free.
"""

from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.methods.base import Method, register_method
from quantkit.methods.configs import AnyPrecisionConfig
from quantkit.methods.kmeans import split_runs
from quantkit.methods.kmeans_native import native_anyprec
from quantkit.methods.squeezellm import refit_stats, refit_tables, seed_clusters, sensitivity_weights


def upscale(sr, starts, centroids, seed_bits, parent_bits):
    """Split the seed clusters bit by bit; returns (parent starts, {bits: centroids [k, 2^bits]})."""
    luts = {seed_bits: centroids}
    for bits in range(seed_bits + 1, parent_bits + 1):
        starts = split_runs(sr, starts, exact=True)
        # an empty child (a cluster of one distinct value) inherits its parent's centroid
        luts[bits] = sr.run_means(starts, luts[bits - 1].repeat_interleave(2, dim=1))
    return starts, luts


@register_method(AnyPrecisionConfig)
class AnyPrecision(Method):
    output_format = "anyprec"

    @property
    def stats(self):
        return refit_stats(self.sensitivity, self.table_refit)

    def quantize(self, weight, stats):
        sens = sensitivity_weights(weight, stats, self.sensitivity)
        native = native_anyprec(weight, sens, self.seed_bits, self.parent_bits)
        if native is not None:
            codes, luts = native.codes, native.luts
            info = {"seed_weighted_sse": native.sse[self.seed_bits].sum().item(),
                    "parent_weighted_sse": native.sse[self.parent_bits].sum().item()}
        else:
            sr, starts, centroids = seed_clusters(weight, sens, self.seed_bits)
            seed_sse = sr.run_sse(starts).sum().item()
            starts, luts = upscale(sr, starts, centroids, self.seed_bits, self.parent_bits)
            codes = sr.codes(starts)
            info = {"seed_weighted_sse": seed_sse, "parent_weighted_sse": sr.run_sse(starts).sum().item()}
        if self.table_refit == "output":
            luts, rows = refit_tables(weight, codes, luts, self.parent_bits, stats)
            info["table_refit_rows"] = rows
        return AnyPrecisionTensor.from_codes(codes, luts, self.seed_bits, self.parent_bits), info
