from quantkit.eval.perplexity import perplexity

__all__ = ["perplexity"]
