"""Quantization methods: their typed settings (configs.py) and implementations (one module each), by name."""

from quantkit.methods.base import METHODS, Method, make_method, register_method
from quantkit.methods.configs import CONFIGS
from quantkit.methods.fields import MethodConfig

__all__ = ["CONFIGS", "METHODS", "Method", "MethodConfig", "make_method", "register_method"]
