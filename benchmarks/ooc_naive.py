"""p-OOC-Naive: the OOC method with its candidates run one after another, as the k-OOC paper's baseline.

quantkit's OOC runs the candidates batched (p-OOC-Batch: one column loop over the stacked copies
[c, k, d]); running ooc_gptq once per candidate gives the same codes and measures what batching saves
(scripts/bench_ooc_cpu.py). Artifacts never use it, so it records impl "naive" only in benchmark rows.
"""

import torch

from quantkit.methods.ooc import OOC, ooc_gptq


class NaiveOOC(OOC):
    """OOC(...) with run_candidates one candidate at a time; settings and results as OOC's."""

    def run_candidates(self, w, h_inv, g, clear_mask):
        parts = [ooc_gptq(w[None], h_inv, self.low_bits, self.high_bits, g, self.sym, clear_mask[m : m + 1],
                          self.block_size) for m in range(clear_mask.shape[0])]
        return tuple(torch.cat(items) for items in zip(*parts))

    def config(self):
        return {**super().config(), "impl": "naive"}
