"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class QuantkitError(Exception):
    """An error caused by the user's input or environment, reported without a traceback."""
