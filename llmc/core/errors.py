class LlmcError(Exception):
    """A user-facing error: the CLI prints its message (no traceback) and exits non-zero."""

    exit_code = 2
