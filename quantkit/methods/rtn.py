"""Round-to-nearest uniform quantization, group-wise or per-channel, symmetric or asymmetric."""

import torch

from quantkit.formats.uniform import UniformQuantizedTensor, grouped_uniform_params, quantize_codes
from quantkit.kernels import gptq_cuda
from quantkit.methods.base import Method, effective_group_size, register_method
from quantkit.methods.configs import RTNConfig


def group_params(weight, g, bits, sym, clip_search=False):
    """Scale and zero [k, G] of every group of g columns of `weight`, from the weights as they are (RTN, and GPTQ's
    static groups): one CUDA kernel on the GPU (kernels/gptq_cuda.group_params), else
    formats.uniform.grouped_uniform_params (the same values as one uniform_params call per group)."""
    params = gptq_cuda.group_params(weight, g, bits, sym, clip_search) if weight.is_cuda else None
    return params if params is not None else grouped_uniform_params(weight, g, bits, sym, clip_search)


def rtn_quantize(weight, bits, group_size, sym, clip_search=False):
    """Quantize every group of `weight` independently; returns codes [k, d], scales and zeros [k, G] (fp32)."""
    g = effective_group_size(group_size, weight.shape[1])
    scales, zeros = group_params(weight, g, bits, sym, clip_search)
    group = torch.arange(weight.shape[1], device=weight.device) // g  # elementwise, as one call per group
    codes = quantize_codes(weight, scales[:, group], zeros[:, group], bits).to(torch.int64)
    return codes, scales.to(torch.float32), zeros.to(torch.float32), g


@register_method(RTNConfig)
class RTN(Method):
    def quantize(self, weight, stats):
        codes, scales, zeros, g = rtn_quantize(weight, self.bits, self.group_size, self.sym, self.clip_search)
        qt = UniformQuantizedTensor.from_codes(codes, scales, zeros, self.bits, g, self.sym)
        return qt, {}
