"""Output paths checked for writability at start-up, before any training: one helper for every entry
point (``pretrain_gpt.py``'s ``--save``, ``--log-json``, ``--plot``, ``--collective-trace``;
``tools/convert_checkpoint.py --format hf OUTDIR``; the fine-tuning scripts' ``--output`` and ``--log-json``).

A path is writable when it is (or will be created as) the kind asked for (a file or a directory) and its
nearest existing ancestor lets this process create entries: probed by creating and removing a temporary
file there (``os.access`` would say yes to root on a read-only or special file system). Missing
directories are not created here; the writers create them. Plain Python: importing this imports no torch.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..config_rules import ConfigurationError

__all__ = ["check_output_path", "output_path_problem"]


def _can_create_in(directory: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(prefix=".fp8lm-write-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def output_path_problem(path: str | os.PathLike | None, *, directory: bool) -> str | None:
    """Why ``path`` cannot be written as a directory (``directory=True``) or a file, or None when it can
    (or when ``path`` is None: the output is off)."""
    if path is None or str(path) == "":
        return None if path is None else "is empty: name a path"
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            return "is a file, not a directory: name a directory (or remove the file)"
        if not directory and path.is_dir():
            return "is a directory: name a file in it"
        if directory:
            return None if _can_create_in(path) else "is not writable by this user: choose another directory"
        try:
            with open(path, "a"):
                pass
        except OSError as error:
            return f"cannot be written ({error.strerror or error}): choose another path"
        return None
    for ancestor in path.absolute().parents:
        if ancestor.is_dir():
            if _can_create_in(ancestor):
                return None
            return (f"cannot be created: {ancestor} is not writable by this user: choose a path in a writable "
                    f"directory")
        if ancestor.exists() or ancestor.is_symlink():
            return f"cannot be created: {ancestor} is a file, not a directory: choose a path in a directory"
    return "cannot be created: choose a path in a writable directory"


def check_output_path(path: str | os.PathLike | None, flag: str, *, directory: bool) -> None:
    """:class:`~megatron.training.config_rules.ConfigurationError` (a ``ValueError``) naming ``flag``,
    ``path`` and the fix unless ``path`` can be written (:func:`output_path_problem`)."""
    problem = output_path_problem(path, directory=directory)
    if problem is not None:
        raise ConfigurationError(f"{flag} {path}: {problem}")
