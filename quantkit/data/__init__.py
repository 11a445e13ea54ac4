from quantkit.data.protocol import calibration_windows, eval_tokens
from quantkit.data.texts import DATASETS, load_documents

__all__ = ["calibration_windows", "eval_tokens", "DATASETS", "load_documents"]
