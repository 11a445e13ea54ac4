"""QuantLinear: a linear layer backed by a QuantizedTensor.

The reference path (any device) dequantizes the weight and calls F.linear. On CUDA inputs the
kernels registered in quantkit.kernels.dispatch serve the formats they know (set
`use_kernels = False` to force the reference); tests hold them to the reference. Unpacking the
codes on every call dominates CPU evaluation, so the dequantized weight is cached per
(device, dtype, bits) unless cache_weight=False (memory then stays at the packed size).

Any-precision tensors (format "anyprec") serve any stored bit-width from the same buffers:
`bits` picks it at construction (None = the parent width) and `set_bits(k)` switches it later
without a reload; other formats accept only bits=None.
"""

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.formats.base import quantized_tensor_from_state_dict
from quantkit.kernels.dispatch import kernel_accumulate, kernel_forward


class QuantLinear(torch.nn.Module):
    def __init__(self, qtensor, bias=None, compute_dtype=torch.float32, cache_weight=True, bits=None):
        super().__init__()
        self.cache_weight = cache_weight
        self.use_kernels = True  # CUDA inputs go through quantkit.kernels.dispatch when a kernel serves the format
        self._cached = None
        self.out_features, self.in_features = qtensor.shape
        self.meta = qtensor.meta()
        self.compute_dtype = compute_dtype
        # register the stored tensors as buffers so .to(device) and state_dict() see them
        self._tensor_names = []
        for name, value in qtensor.state_dict().items():
            self.register_buffer(name, value)
            self._tensor_names.append(name)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(compute_dtype), requires_grad=False)
        self.bits = None
        self.set_bits(bits)

    def set_bits(self, bits):
        """Serve `bits` (anyprec only; None = the stored default). Drops the cached weight."""
        if bits is not None:
            if self.meta["format"] != "anyprec":
                raise QuantkitError(f"bits={bits} can only be chosen for any-precision tensors, "
                                    f"not {self.meta['format']}")
            self.qtensor().check_bits(bits)
        self.bits = bits
        self._cached = None
        return self

    def qtensor(self):
        return quantized_tensor_from_state_dict(self.meta, {n: getattr(self, n) for n in self._tensor_names})

    def dequantized_weight(self, dtype=None):
        if self.bits is None:
            return self.qtensor().dequantize(dtype or self.compute_dtype)
        return self.qtensor().dequantize(dtype or self.compute_dtype, bits=self.bits)

    def _apply(self, fn, *args, **kwargs):
        self._cached = None  # moved or cast: the cached weight no longer matches the buffers
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x):
        out = kernel_forward(self, x)
        if out is not None:
            return out
        key = (x.device, x.dtype, self.bits)
        if self._cached is not None and self._cached[0] == key:
            weight = self._cached[1]
        else:
            weight = self.dequantized_weight(x.dtype).to(x.device)
            if self.cache_weight:
                self._cached = (key, weight)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def accumulate(self, x):
        """x @ weightᵀ (bias-free layers) as the kernel's fp32 partial sums, without the step that finishes
        them, or None where no kernel offers it (nothing ran then). The returned [..., out_features] view
        of the module's workspace rounds to what forward returns in fp16. The caller must read it and zero
        it before this module runs again (the fast decoder's consuming operators do both in one kernel)."""
        return kernel_accumulate(self, x)

    @staticmethod
    def finish(sums, dtype):
        """What forward would have returned, in `dtype`, from accumulate's `sums` (the kernels' fp16
        rounding of them), which it zeroes: the PyTorch form of a consumer's job."""
        out = sums.to(torch.float16).to(dtype)
        sums.zero_()
        return out

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.meta['format']}, bits={self.bits or self.meta.get('bits')}")
