"""User-facing errors: the CLI prints these as one line and exits non-zero."""

# Messages wrap errors from other libraries, some of which span paragraphs; keep the line readable.
MAX_MESSAGE_CHARS = 600


def one_line(message) -> str:
    """`message` with every run of whitespace (newlines included) collapsed to one space, capped."""
    text = " ".join(str(message).split())
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 1] + "…"
    return text


class QuantkitError(Exception):
    """An error caused by the user's input or environment, reported without a traceback.

    The message is normalised to a single line here, so every raiser gets the CLI contract
    (one line on stderr, exit code 2) even when it embeds another library's multi-line message."""

    def __init__(self, message=""):
        super().__init__(one_line(message))


class StorageError(QuantkitError):
    """Writing failed (disk full, permissions, quota) although the input was fine: retrying after
    freeing space can succeed, so work already saved (layer checkpoints) is kept."""


class CheckpointError(QuantkitError):
    """A layer checkpoint cannot be used (damaged, other settings): it is left for the user to
    inspect, remove or replace with --overwrite."""
