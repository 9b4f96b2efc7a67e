"""The artifact's output folder: refused when it exists, unless overwriting was asked for (checked before any work,
and again by the staged writer)."""
from pathlib import Path

from llmc.errors import LlmcError


def check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not overwrite:
        raise LlmcError(f"output {output} already exists; remove it, choose --output, or pass --overwrite")
