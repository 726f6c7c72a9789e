"""Outputs written whole or not at all: a path is checked before any long work starts (`check_output_file`,
`check_output_folder`), and an output is written to a staging path moved into place only when complete
(`staged_output`), so a failed write (a full disk) leaves no partial output. Refusals are `InputError`s naming the
flag (or argument) that gave the path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import InputError, first_line


def check_output_file(path: str | Path, flag: str) -> Path:
    """`path` can be written (its folder is created if missing); checked before any long work."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path}: is a folder; pass a file path.")
    _check_writable_folder(path.parent, flag, path)
    return path


def check_output_folder(path: str | Path, flag: str) -> Path:
    """`path` is a folder that can be written, or one that can be created in a writable folder (created if
    missing; `path` itself is created by the writing, so a run refused later leaves no empty folder behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: is a file; pass a folder (it is created if missing).")
    _check_writable_folder(path if path.is_dir() else path.parent, flag, path)
    return path


def _check_writable_folder(folder: Path, flag: str, shown: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise InputError(f"{flag} {shown}: cannot be written ({first_line(error)}); choose another path.") from None


@contextlib.contextmanager
def staged_output(target: str | Path, flag: str) -> Iterator[Path]:
    """A path to write an output (a file, or a folder the caller creates) into, next to `target`; when the block
    completes, the output is moved onto `target` (`move_into_place`), so a failed or interrupted write (a full disk)
    never leaves a partial output there. On an error the staged output is deleted, and an OSError (or safetensors'
    error for one) becomes an `InputError` naming `flag`."""
    shown, target = target, Path(target).resolve()  # `.` has a parent
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    except OSError as error:
        raise InputError(f"{flag} {shown}: cannot be written ({first_line(error)}); choose another path.") from None
    staged = staging / target.name
    try:
        yield staged
        move_into_place(staged, target)
    except Exception as error:
        from safetensors import SafetensorError  # what safetensors raises for an I/O error (ENOSPC) while writing

        if not isinstance(error, (OSError, SafetensorError)):
            raise
        reason = first_line(error)
        raise InputError(f"{flag} {shown}: writing it failed ({reason}); nothing was written there.") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def move_into_place(staged: Path, target: Path) -> None:
    """Move a complete output (a file or a folder) onto `target`, by renames. A folder's entries replace the
    same-named ones of an existing `target` folder, which stays (it may be the working directory); its other files
    are kept."""
    if staged.is_dir() and target.is_dir():
        for entry in staged.iterdir():
            existing = target / entry.name
            if existing.is_dir() and not existing.is_symlink():
                shutil.rmtree(existing)
            os.replace(entry, existing)
    else:
        os.replace(staged, target)
