"""Output folders: refused when they exist, unless overwriting was asked for (checked before any work, and again
when the finished folder is moved into place), and the unique temporary names work is staged under."""
import errno
import os
import secrets
import shutil
import sys
from pathlib import Path

from llmc.core.errors import LlmcError

# what rename(2) says when its target is a folder that is not empty, or not a folder
TARGET_TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)


def check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not overwrite:
        raise LlmcError(f"output {output} already exists; remove it, choose --output, or pass --overwrite")


def unique_sibling(path: Path, tag: str = "partial") -> Path:
    """A hidden name beside path that no other run uses: `.NAME.TAG-PID-RANDOM`."""
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}")


class OutputTaken(LlmcError):
    """The target appeared while the work was staged, and replacing it was not asked for."""


def move_into_place(staging: Path, target: Path, replace: bool) -> None:
    """Rename the finished staging folder to target. An existing target is replaced only with replace: renamed aside,
    the staging folder renamed into place, then the old one removed, so target always names a whole folder.
    OutputTaken (the staging folder left as it is) when target exists and replace is False."""
    aside = None
    if replace and (target.exists() or target.is_symlink()):
        aside = unique_sibling(target, "replaced")
        target.rename(aside)
    elif target.exists() or target.is_symlink():
        raise OutputTaken(f"{target} exists")
    try:
        # rename(2) puts a folder in place of an empty folder only: one made since the check holds nothing
        staging.rename(target)
    except OSError as error:
        if aside is not None and not target.exists():
            aside.rename(target)
        if error.errno in TARGET_TAKEN:
            raise OutputTaken(f"{target} appeared meanwhile") from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
        if aside.exists():
            print(f"could not remove the replaced {target}, now at {aside}", file=sys.stderr)
