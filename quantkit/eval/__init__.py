"""Model evaluation: perplexity with the GPTQ protocol."""

from quantkit.eval.perplexity import perplexity

__all__ = ["perplexity"]
