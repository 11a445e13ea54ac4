"""How a method setting is declared: a dataclass field that carries its default, allowed values and help.

A method's settings are one frozen dataclass (configs.py). Each field is made by one of the functions
below, which put into the field's metadata everything the rest of quantkit needs about it:

    help         one sentence for `quantkit quantize --help` and `quantkit methods`
    allowed      the allowed values, short ("2..8", "(0, 1]", "activation, fisher, none")
    requirement  the same as a phrase for errors ("an integer in 2..8")
    got          what joins the requirement to the value in an error (", got" unless the phrase has a comma)
    check        value -> bool
    choices      choice settings only: the allowed strings (a click.Choice on the command line)
    negative     bool settings only: the name of the off flag ("asym" for --sym/--asym)
    fixed        a recorded constant rather than a setting (see `fixed`)

MethodConfig.__post_init__ checks every field, then the config's own cross-setting rules (check()),
so a config that exists is valid. Nothing here imports torch: the CLI builds its options from these
declarations without loading any method.
"""

from dataclasses import MISSING, dataclass, field, fields

from quantkit.errors import QuantkitError


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(default, help, low, high=None, per_channel=False):
    """An int in low..high (high None: no upper bound); per_channel also allows -1."""
    if high is not None:
        requirement, allowed = f"an integer in {low}..{high}", f"{low}..{high}"
    else:
        requirement = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
        allowed = f">= {low}"
    if per_channel:
        requirement, allowed = f"{requirement}, or -1 for per-channel", f"{allowed} or -1"

    def check(value):
        return _is_int(value) and ((low <= value and (high is None or value <= high)) or (per_channel and value == -1))

    return field(default=default, metadata={"help": help, "allowed": allowed, "requirement": requirement,
                                            "check": check, "got": "; got" if per_channel else ", got"})


def number(default, help, low, high, low_open):
    """A number in (low, high] (low_open) or [low, high]."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def check(value):
        return _is_number(value) and (low < value if low_open else low <= value) and value <= high

    return field(default=default, metadata={"help": help, "allowed": interval, "requirement": f"a number in {interval}",
                                            "check": check})


def flag(default, help, negative=None):
    """On or off; on the command line --NAME / --no-NAME, or --NAME / --NEGATIVE."""
    return field(default=default, metadata={"help": help, "allowed": "on, off", "requirement": "true or false",
                                            "check": lambda value: isinstance(value, bool), "negative": negative})


def choice(default, help, choices):
    """One of `choices` (strings)."""
    choices = tuple(choices)
    return field(default=default, metadata={"help": help, "allowed": ", ".join(choices), "choices": choices,
                                            "requirement": f"one of {', '.join(choices)}",
                                            "check": lambda value: value in choices})


def fixed(value):
    """A value every artifact of the method records but nobody chooses (not an option, not an argument)."""
    return field(default=value, init=False, metadata={"fixed": True})


def options(config_class):
    """The fields of `config_class` a user sets (every field but the fixed ones), in declaration order."""
    return [f for f in fields(config_class) if not f.metadata.get("fixed")]


def option_name(f):
    """The command-line spelling of a setting: group_size -> --group-size."""
    return "--" + f.name.replace("_", "-")


def flag_names(f):
    """(on, off) flag names of a bool setting: ("--act-order", "--no-act-order"), ("--sym", "--asym")."""
    on = option_name(f)
    negative = f.metadata.get("negative")
    return on, "--" + (negative or "no-" + on[2:])


def show(f, value):
    """A value of setting f as help and tables print it: on/off for flags (or the flag in force, sym/asym)."""
    if f.type is bool and isinstance(value, bool):
        if f.metadata.get("negative"):
            return flag_names(f)[0 if value else 1][2:]
        return "on" if value else "off"
    return "-" if value is None else str(value)


def problem(f, value):
    """One line saying why `value` is not allowed for setting f, or None when it is."""
    if f.metadata["check"](value):
        return None
    if f.type is bool:  # only a Python caller can pass a non-bool here: name the keyword and the flags
        return f"{f.name} ({'/'.join(flag_names(f))}) must be true or false, got {value!r}"
    return f"{option_name(f)} must be {f.metadata['requirement']}{f.metadata.get('got', ', got')} {value!r}"


@dataclass(frozen=True)
class MethodConfig:
    """Base of the method configs: checks every setting on construction (QuantkitError, one line)."""

    method = None  # the method's name, set by configs.register_config

    def __post_init__(self):
        for f in options(type(self)):
            message = problem(f, getattr(self, f.name))
            if message:
                raise QuantkitError(message)
        self.check()

    def check(self):
        """Rules between settings; raise QuantkitError naming both sides."""

    def as_dict(self) -> dict:
        """Every field, fixed ones included, in declaration order: the settings an artifact records."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def describe(cls) -> list:
        """[{name, option, type, default, allowed, help}] of every field (option None for fixed ones)."""
        rows = []
        for f in fields(cls):
            default = None if f.default is MISSING else f.default
            if f.metadata.get("fixed"):
                rows.append({"name": f.name, "option": None, "type": f.type.__name__, "default": default,
                             "allowed": None, "help": "recorded in every artifact of the method; not a setting"})
                continue
            rows.append({"name": f.name, "option": option_name(f), "type": f.type.__name__, "default": default,
                         "allowed": f.metadata["allowed"], "help": f.metadata["help"]})
        return rows


def shared_options(configs):
    """{setting name: [(method, field)]} over the config classes `configs`, in first-declared order. A setting
    several methods take (bits, group_size, ...) is one option: they must agree on its type, help and flag
    names; defaults and allowed values are per method."""
    table = {}
    for cls in configs:
        for f in options(cls):
            uses = table.setdefault(f.name, [])
            if uses:
                first = uses[0][1]
                differ = [key for key in ("help", "negative", "choices")
                          if first.metadata.get(key) != f.metadata.get(key)]
                if differ or first.type is not f.type:
                    raise TypeError(f"setting {f.name}: {cls.method} declares it unlike {uses[0][0]} "
                                    f"({', '.join(differ) or 'type'})")
            uses.append((cls.method, f))
    return table
