"""Quantization methods: their typed settings (configs.py) and implementations (one module each), by name."""

from quantkit.methods.base import Method, make_method, register_method
from quantkit.methods.configs import CONFIGS
from quantkit.methods.fields import MethodConfig

__all__ = ["CONFIGS", "Method", "MethodConfig", "make_method", "register_method"]
