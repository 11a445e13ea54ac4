"""The settings of every quantization method: one frozen dataclass each, registered under the method's name.

Each field is declared once (fields.py helpers: default, allowed values, help); from these declarations come
the method options of `quantkit quantize`, the `quantkit methods` table, the checks of configs/*.yaml presets
and the settings an artifact records in its quantization_config (MethodConfig.as_dict: every field, in
declaration order). The method named NAME is implemented in quantkit/methods/NAME.py, whose class registers
itself for the config (base.register_method). A setting several methods take is declared by one helper
below, so its help is the same everywhere; its default is the method's own.
"""

from dataclasses import dataclass

from quantkit.errors import QuantkitError
from quantkit.methods.fields import MethodConfig, choice, fixed, flag, integer, number

CONFIGS = {}  # method name -> config class, in declaration order (the order of the CLI options)

SENSITIVITIES = ("activation", "fisher", "none")


def register_config(name):
    """Class decorator: `cls` is the settings dataclass of the method `name`."""

    def register(cls):
        cls.method = name
        CONFIGS[name] = cls
        return cls

    return register


# ---- settings several methods take ---------------------------------------------------------------------

def _bits(default, low=2):
    return integer(default, "Bits per weight code.", low, 8)


def _group_size():
    # 0 is refused rather than read as per-channel: it is more often a typo or an unset variable than a choice
    return integer(128, "Input weights per group (own scale/zero, or own α for bcq); -1 for per-channel. A "
                        "partial last group is kept.", 1, per_channel=True)


def _sym():
    return flag(False, "Symmetric (no stored zero) or asymmetric.", negative="asym")


def _clip_search(default):
    return flag(default, "Search a shrunk clipping range per group, min Σ|w-q|^2.4 as the GPTQ reference's mse option.")


def _damp():
    return number(0.01, "Dampening: fraction of the mean Hessian diagonal added to it, raised x10 while Cholesky "
                        "fails.", 0, 1, low_open=True)


def _act_order():
    return flag(True, "Quantize columns in order of descending Hessian diagonal.")


def _static_groups():
    return flag(True, "Group scales/zeros from the original weights up front; no g_idx with --act-order.")


def _block_size():
    return integer(128, "Columns per lazy-update block.", 1)


def _sensitivity():
    return choice("activation", "k-means weight of each weight: diag of XᵀX of its input (activation), Σ grad² of "
                                "the LM loss over the calibration windows (fisher, one whole-model backward per "
                                "window), or none.", SENSITIVITIES)


def _table_refit(default):
    return choice(default, "Refit every width's lookup table, codes fixed, to the calibration output error ‖(W-Ŵ)X‖² "
                           "(output; needs calibration data) or keep the k-means tables (none).", ("output", "none"))


# ---- the methods ---------------------------------------------------------------------------------------

@register_config("rtn")
@dataclass(frozen=True)
class RTNConfig(MethodConfig):
    """Round-to-nearest uniform quantization, group-wise or per-channel."""

    bits: int = _bits(4)
    group_size: int = _group_size()
    sym: bool = _sym()
    clip_search: bool = _clip_search(False)


@register_config("gptq")
@dataclass(frozen=True)
class GPTQConfig(MethodConfig):
    """GPTQ: column-by-column uniform quantization with Hessian-based error feedback."""

    bits: int = _bits(4)
    group_size: int = _group_size()
    sym: bool = _sym()
    damp: float = _damp()
    # act-order + static groups + clipping search by default: on SmolLM2 this is the setting that beats RTN
    # at 4 bits and wins most at 3 (RESULTS.md, GPTQ); turn them off for the textbook algorithm
    act_order: bool = _act_order()
    static_groups: bool = _static_groups()
    block_size: int = _block_size()
    clip_search: bool = _clip_search(True)


@register_config("bcq")
@dataclass(frozen=True)
class BCQConfig(MethodConfig):
    """Binary-coding quantization (nuQmm, LUT-GEMM): w ≈ Σ αᵢbᵢ (+ z) per group."""

    bits: int = _bits(3, low=1)
    group_size: int = _group_size()
    offset: bool = flag(False, "Also fit an fp16 offset z per group (w ≈ Σ αᵢbᵢ + z).")
    # output by default: the weight-error fit clips the group extremes SmolLM2 depends on (docs/quality-methods.md)
    solver: str = choice("output", "Objective of the fit: the calibration output error ‖(W-Ŵ)X‖² (output: codes "
                                   "chosen in GPTQ's column sweep, α/z refitted by least squares; needs calibration "
                                   "data) or the weight error ‖W-Ŵ‖² (weight: alternating least squares).",
                         ("output", "weight"))
    rounds: int = integer(15, "Alternating least-squares rounds of the weight-error fit after the greedy start; stops "
                              "early once the error stops falling.", 0)
    refits: int = integer(4, "Output solver: rounds of (refit α/z on the output error, re-sweep the codes), each "
                             "kept per row only where it lowers the error.", 0)
    init: str = choice("best", "Output solver start: the clip-searched uniform grid of the default GPTQ "
                                  "(uniform), the weight-error fit (weight), or both with the better kept per row "
                                  "(best).", ("uniform", "weight", "best"))
    damp: float = _damp()
    act_order: bool = _act_order()
    block_size: int = _block_size()
    clip_search: bool = _clip_search(True)


@register_config("squeezellm")
@dataclass(frozen=True)
class SqueezeLLMConfig(MethodConfig):
    """SqueezeLLM: per-row sensitivity-weighted k-means with 2^bits centroids."""

    bits: int = _bits(3)
    sensitivity: str = _sensitivity()
    table_refit: str = _table_refit("none")  # off: the independent k-means baseline any-precision is held to


@register_config("anyprec")
@dataclass(frozen=True)
class AnyPrecisionConfig(MethodConfig):
    """Any-precision: a SqueezeLLM seed upscaled bit by bit; one artifact serves seed..parent bits."""

    seed_bits: int = integer(3, "Bits of the SqueezeLLM seed model.", 1, 8)
    parent_bits: int = integer(8, "Bits of the parent model, upscaled from the seed.", 1, 8)
    sensitivity: str = _sensitivity()
    table_refit: str = _table_refit("output")
    upscale: str = choice("gptq", "How each extra bit is chosen: the exact weighted 2-means cut of every cluster "
                                  "(split, the paper's rule) or per weight in GPTQ's column sweep on the calibration "
                                  "output error, kept per row where it beats split (gptq; needs calibration data).",
                          ("gptq", "split"))
    refit_seed: bool = flag(False, "With --table-refit output, refit the seed width's table too; off keeps the seed "
                                   "exactly independent SqueezeLLM at --seed-bits.")
    damp: float = _damp()
    act_order: bool = _act_order()
    sweeps: int = integer(1, "gptq upscaling: column sweeps per width (the first on the split's table, each later "
                             "one on the table refitted to the previous sweep's codes).", 1)
    band: float = number(0.5, "gptq upscaling: a weight may take the child its error-updated value is nearer to only "
                              "within band x half the children's gap of their midpoint (0: the split's child "
                              "always, 1: anywhere between the two).", 0, 1, low_open=False)
    # recorded, not chosen: a parameter of a dropped rule, kept so that the quantization_config keeps its keys
    level_weights: object = fixed(None)

    def check(self):
        if self.parent_bits < self.seed_bits:
            raise QuantkitError(f"--parent-bits {self.parent_bits} is below --seed-bits {self.seed_bits}")


@register_config("ooc")
@dataclass(frozen=True)
class OOCConfig(MethodConfig):
    """OOC, GPTQ(h, l, p, s): GPTQ at l bits with one odd group whose most salient columns get h bits."""

    low_bits: int = integer(2, "Bits l of the low tier.", 2, 8)
    high_bits: int = integer(2, "Bits h of the clear columns of the odd group.", 2, 8)
    clear_fraction: float = number(0.1, "Fraction p of the odd group's columns kept clear.", 0, 1, low_open=True)
    scan: float = number(0.1, "Fraction s of the groups (most salient first) tried as the odd group; 0 = GPTQ(l).",
                         0, 1, low_open=False)
    group_size: int = _group_size()
    sym: bool = _sym()
    damp: float = _damp()
    per_row: bool = flag(False, "Choose the odd group per output row instead of per matrix.")
    block_size: int = _block_size()
    # the inner GPTQ is quantkit's default GPTQ (act-order, static groups, clip search; RESULTS.md, GPTQ): the
    # textbook one it was first built on leaves every 2-bit SmolLM2 model unusable (docs/quality-methods.md)
    act_order: bool = _act_order()
    static_groups: bool = _static_groups()
    clip_search: bool = _clip_search(True)
    # recorded, not chosen: every ooc artifact stores how its candidates ran, so the key stays to keep the
    # quantization_config unchanged; they always run batched (p-OOC-Batch; one after another gives the same
    # codes and is only measured, benchmarks/ooc_naive.py)
    impl: str = fixed("batch")

    def check(self):
        if self.high_bits < self.low_bits:
            raise QuantkitError(f"--high-bits ({self.high_bits}) must be at least --low-bits ({self.low_bits})")
        if self.act_order and not self.static_groups:
            raise QuantkitError("--act-order needs --static-groups for ooc (its format has no g_idx); "
                                "add --static-groups or --no-act-order")
