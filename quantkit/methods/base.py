"""The method contract and the registry that maps a method's name and config class to its implementation.

A method turns one weight matrix plus the statistics it asked for into a QuantizedTensor.
Methods never walk the model, never touch files and never print: the engine walks, the
artifact writes. A new method is a config in configs.py plus a module methods/NAME.py holding a
class decorated with @register_method(ItsConfig).
"""

from abc import ABC, abstractmethod
from importlib import import_module

from quantkit.errors import QuantkitError
from quantkit.methods.configs import CONFIGS
from quantkit.methods.fields import MethodConfig, options

METHODS = {}  # name -> Method class, filled as the method modules are imported
_BY_CONFIG = {}  # config class -> Method class


def register_method(config_class):
    """Class decorator: `cls` implements the method whose settings are `config_class` (registered in configs.py)."""

    def register(cls):
        cls.name = config_class.method
        cls.config_class = config_class
        cls.params = {f.name: f.default for f in options(config_class)}
        METHODS[cls.name] = cls
        _BY_CONFIG[config_class] = cls
        return cls

    return register


class Method(ABC):
    name = None
    config_class = None
    # {setting: default} of what the constructor takes (config_class's fields less the fixed ones)
    params = {}
    # statistics the engine gathers per linear before calling quantize(): "hessian" gives
    # stats["xtx"] = Σ xᵀx (fp32, [d, d]), stats["nsamples"] and stats["ntokens"]. The same
    # stats object serves every linear that reads the same input: treat it as read-only.
    stats = ()

    def __init__(self, settings=None, /, **kwargs):
        """Method(config) or Method(setting=value, ...): the settings not given keep their defaults."""
        if settings is None:
            unknown = set(kwargs) - set(self.params)
            if unknown:
                raise QuantkitError(f"--method {self.name} does not take {', '.join(sorted(unknown))}")
            settings = self.config_class(**kwargs)
        elif kwargs or type(settings) is not self.config_class:
            raise TypeError(f"{type(self).__name__} takes a {self.config_class.__name__} or keyword settings, not both")
        self.settings = settings

    def __getattr__(self, key):
        # the settings read as attributes of the method: method.bits is method.settings.bits
        settings = self.__dict__.get("settings")
        if settings is not None and key in settings.__dataclass_fields__:
            return getattr(settings, key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    @abstractmethod
    def quantize(self, weight, stats: dict):
        """weight: fp32 [out, in] on the working device -> (QuantizedTensor, info dict)."""

    def config(self) -> dict:
        """Settings recorded in the artifact's quantization_config."""
        return self.settings.as_dict()


def make_method(method, **kwargs) -> Method:
    """A method from its name and settings, make_method("gptq", bits=3), or from its config,
    make_method(GPTQConfig(bits=3)). Imports the implementing module (methods/NAME.py) on first use."""
    name = method.method if isinstance(method, MethodConfig) else method
    if name not in CONFIGS:
        raise QuantkitError(f"unknown method {name!r}; available: {', '.join(sorted(CONFIGS))}")
    import_module(f"quantkit.methods.{name}")  # registers its class
    if isinstance(method, MethodConfig):
        if kwargs:
            raise TypeError("make_method takes a config or a name with keyword settings, not both")
        return _BY_CONFIG[type(method)](method)
    return METHODS[name](**kwargs)


def effective_group_size(group_size, in_features):
    """-1 means per-channel: one group spanning the whole row."""
    return in_features if group_size == -1 or group_size >= in_features else group_size
