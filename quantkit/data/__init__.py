"""Evaluation and calibration text: readers of WikiText-2 / C4 / PTB and the GPTQ protocol."""

from quantkit.data.protocol import calibration_windows, eval_tokens
from quantkit.data.texts import DATASETS, check_available, load_documents
from quantkit.data.validation import validation_windows

__all__ = ["calibration_windows", "check_available", "eval_tokens", "DATASETS", "load_documents", "validation_windows"]
