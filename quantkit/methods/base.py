"""The method contract and registry.

A method turns one weight matrix plus the statistics it asked for into a QuantizedTensor.
Methods never walk the model, never touch files and never print: the engine walks, the
artifact writes. A new method is a new module with a @register_method class.
"""

from abc import ABC, abstractmethod

import torch

from quantkit.errors import QuantkitError

METHODS = {}


def register_method(cls):
    METHODS[cls.name] = cls
    return cls


class Method(ABC):
    name = None
    # statistics the engine gathers per linear before calling quantize(): "hessian" gives
    # stats["xtx"] = Σ xᵀx (fp32, [d, d]), stats["nsamples"] and stats["ntokens"]. The same
    # stats object serves every linear that reads the same input: treat it as read-only.
    stats = ()
    # constructor parameters and their defaults; the CLI passes exactly these
    params = {}

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self.params)
        if unknown:
            raise QuantkitError(f"--method {self.name} does not take {', '.join(sorted(unknown))}")
        for key, default in self.params.items():
            setattr(self, key, kwargs.get(key, default))
        self.validate()

    def validate(self):
        """Raise QuantkitError for out-of-range settings."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor, stats: dict):
        """weight: fp32 [out, in] on the working device -> (QuantizedTensor, info dict)."""

    def config(self) -> dict:
        """Settings recorded in the artifact's quantization_config."""
        return {key: getattr(self, key) for key in self.params}


def make_method(name, **kwargs) -> Method:
    if name not in METHODS:
        raise QuantkitError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name](**kwargs)


def check_bits(bits, low=2, high=8):
    if not isinstance(bits, int) or not low <= bits <= high:
        raise QuantkitError(f"--bits must be an integer in {low}..{high}, got {bits}")


def check_group_size(group_size):
    # 0 is refused rather than read as per-channel: it is more often a typo or an unset variable than a choice
    if isinstance(group_size, bool) or not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise QuantkitError(f"--group-size must be a positive integer, or -1 for per-channel; got {group_size}")


def effective_group_size(group_size, in_features):
    """-1 means per-channel: one group spanning the whole row."""
    return in_features if group_size == -1 or group_size >= in_features else group_size
