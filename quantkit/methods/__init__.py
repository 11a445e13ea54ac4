"""Quantization methods; importing this package registers all of them."""

from quantkit.methods import rtn  # noqa: F401  (registers)
from quantkit.methods import bcq  # noqa: F401  (registers)
from quantkit.methods import gptq  # noqa: F401  (registers)
from quantkit.methods import squeezellm  # noqa: F401  (registers)
from quantkit.methods import anyprec  # noqa: F401  (registers)
from quantkit.methods import ooc  # noqa: F401  (registers)
from quantkit.methods.base import METHODS, Method, make_method, register_method

__all__ = ["METHODS", "Method", "make_method", "register_method"]
