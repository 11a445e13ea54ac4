"""Loading checkpoints and finding their decoder layers and linears."""

from quantkit.models.adapters import ArchAdapter, adapter_for
from quantkit.models.loading import check_architecture, checkpoint_dtype, load_model, load_tokenizer, resolve_source

__all__ = ["ArchAdapter", "adapter_for", "check_architecture", "checkpoint_dtype", "load_model", "load_tokenizer",
           "resolve_source"]
