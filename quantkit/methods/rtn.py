"""Round-to-nearest uniform quantization, group-wise or per-channel, symmetric or asymmetric."""

import torch

from quantkit.formats.uniform import UniformQuantizedTensor, num_groups, quantize_codes, uniform_params
from quantkit.kernels import gptq_cuda
from quantkit.methods.base import Method, effective_group_size, register_method
from quantkit.methods.configs import RTNConfig


def rtn_quantize(weight, bits, group_size, sym, clip_search=False):
    """Quantize every group of `weight` independently; returns codes [k, d], scales and zeros [k, G]."""
    k, d = weight.shape
    g = effective_group_size(group_size, d)
    groups = num_groups(d, g)
    codes = torch.empty(k, d, dtype=torch.int64, device=weight.device)
    scales = torch.empty(k, groups, dtype=torch.float32, device=weight.device)
    zeros = torch.empty_like(scales)
    # on CUDA one kernel finds every group's params (the clip search alone is ~800 small kernels a group here)
    params = gptq_cuda.group_params(weight, g, bits, sym, clip_search) if weight.is_cuda else None
    for j in range(groups):
        cols = slice(j * g, min(d, (j + 1) * g))
        if params is None:
            scale, zero = uniform_params(weight[:, cols], bits, sym, clip_search)
        else:
            scale, zero = params[0][:, j], params[1][:, j]
        codes[:, cols] = quantize_codes(weight[:, cols], scale[:, None], zero[:, None], bits).to(torch.int64)
        scales[:, j], zeros[:, j] = scale, zero
    return codes, scales, zeros, g


@register_method(RTNConfig)
class RTN(Method):
    def quantize(self, weight, stats):
        codes, scales, zeros, g = rtn_quantize(weight, self.bits, self.group_size, self.sym, self.clip_search)
        qt = UniformQuantizedTensor.from_codes(codes, scales, zeros, self.bits, g, self.sym)
        return qt, {}
