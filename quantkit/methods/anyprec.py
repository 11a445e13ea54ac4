"""Any-precision quantization by incremental upscaling (Any-Precision LLM §4): one artifact, every width.

A SqueezeLLM seed at `seed_bits`, then for each extra bit every cluster of every row is split in two by
the exact sensitivity-weighted 2-means of its own members (kmeans.split_runs, exact=True: the best cut of
the sorted members), so the (b+1)-bit code of each weight starts with its b-bit code. The b-bit table holds
the weighted means of the b-bit clusters (the optimal centroids for the nested assignment). Stored as one
anyprec tensor: parent_bits bitplanes + one LUT per width in seed..parent. Vectorised over rows.

When the C++ extension builds (kmeans_native.py) it does all of this instead, with an exact k-means seed
and the same exact splits; without it the torch path below runs. With table_refit "output" every width's
table above the seed (the seed's too with refit_seed) is refitted to the calibration output error with its
codes fixed (table_refit.py). That is upscale "split", the paper's rule.

upscale "gptq" (the default) keeps the seed (codes and k-means table: independent SqueezeLLM at seed_bits)
and chooses every extra bit in GPTQ's column sweep on the calibration output error instead
(upscale_gptq.py), each width's table refitted to it, a row keeping the split where that is better.
"""

import torch

from quantkit.formats.anyprec import AnyPrecisionTensor
from quantkit.methods.base import Method, register_method
from quantkit.methods.configs import AnyPrecisionConfig
from quantkit.methods.gptq import ordered_inverse, prepare_hessian
from quantkit.methods.kmeans import split_runs
from quantkit.methods.kmeans_native import native_anyprec
from quantkit.methods.squeezellm import refit_stats, refit_tables, seed_clusters, sensitivity_weights
from quantkit.methods.upscale_gptq import gptq_upscale


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
        stats = refit_stats(self.sensitivity, self.table_refit)
        return stats if self.upscale == "split" or "hessian" in stats else ("hessian", *stats)

    def quantize(self, weight, stats):
        sens = sensitivity_weights(weight, stats, self.sensitivity)
        top = self.parent_bits if self.upscale == "split" else self.seed_bits
        native = native_anyprec(weight, sens, self.seed_bits, top)
        if native is not None:
            codes, luts = native.codes.to(torch.int64), native.luts
            info = {"seed_weighted_sse": native.sse[self.seed_bits].sum().item()}
            if top > self.seed_bits:  # the gptq rule upscales later: its parent's SSE is not known here
                info["parent_weighted_sse"] = native.sse[top].sum().item()
        else:
            sr, starts, centroids = seed_clusters(weight, sens, self.seed_bits)
            info = {"seed_weighted_sse": sr.run_sse(starts).sum().item()}
            starts, luts = upscale(sr, starts, centroids, self.seed_bits, top)
            codes = sr.codes(starts)
            if top > self.seed_bits:
                info["parent_weighted_sse"] = sr.run_sse(starts).sum().item()
        refit = self.table_refit == "output"
        if refit:  # the seed's table only with refit_seed: else the seed is independent SqueezeLLM exactly
            widths = {b: t for b, t in luts.items() if b > self.seed_bits or self.refit_seed}
            refitted, info["table_refit_rows"] = refit_tables(weight, codes, widths, top, stats)
            luts.update(refitted)
        if self.upscale == "gptq":
            codes, luts, info["gptq_rows"] = self._gptq_upscale(weight, sens, stats, codes, luts[self.seed_bits], refit)
        return AnyPrecisionTensor.from_codes(codes, luts, self.seed_bits, self.parent_bits), info

    def _gptq_upscale(self, weight, sens, stats, seed_codes, seed_table, refit):
        """upscale_gptq.py from the seed, with methods/gptq.py's Hessian, act-order and damping."""
        h, _ = prepare_hessian(stats["xtx"], stats["nsamples"], weight.float())
        perm, u, _ = ordered_inverse(h, self.act_order, float(self.damp))
        return gptq_upscale(weight.float(), sens, h, u, perm, seed_codes, seed_table, self.seed_bits,
                            self.parent_bits, refit=refit, sweeps=self.sweeps,
                            band=self.band)
