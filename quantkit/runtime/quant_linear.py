"""QuantLinear: a linear layer backed by a QuantizedTensor.

The reference path (any device) dequantizes the weight and calls F.linear; the CUDA kernel
paths of later issues plug in here and are held to this reference by the tests. Unpacking the
codes on every call dominates CPU evaluation, so the dequantized weight is cached per
(device, dtype) unless cache_weight=False (memory then stays at the packed size).
"""

import torch
import torch.nn.functional as F

from quantkit.formats.base import quantized_tensor_from_state_dict


class QuantLinear(torch.nn.Module):
    def __init__(self, qtensor, bias=None, compute_dtype=torch.float32, cache_weight=True):
        super().__init__()
        self.cache_weight = cache_weight
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

    def qtensor(self):
        return quantized_tensor_from_state_dict(self.meta, {n: getattr(self, n) for n in self._tensor_names})

    def dequantized_weight(self, dtype=None):
        return self.qtensor().dequantize(dtype or self.compute_dtype)

    def _apply(self, fn, *args, **kwargs):
        self._cached = None  # moved or cast: the cached weight no longer matches the buffers
        return super()._apply(fn, *args, **kwargs)

    def forward(self, x):
        key = (x.device, x.dtype)
        if self._cached is not None and self._cached[0] == key:
            weight = self._cached[1]
        else:
            weight = self.dequantized_weight(x.dtype).to(x.device)
            if self.cache_weight:
                self._cached = (key, weight)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight, bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.meta['format']}, bits={self.meta.get('bits')}"
