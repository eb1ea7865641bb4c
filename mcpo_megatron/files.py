"""Outputs that colleagues can read: ordinary (umask-based) permissions on what is written atomically.

Atomic writes go through a private temporary directory (``tempfile.mkdtemp`` makes it 0700) and some writers
make private files (safetensors writes 0600). On a shared cluster that hides exports and checkpoints from
everyone but their owner, so before the final rename every directory and file under the temporary root gets
the mode a plain ``mkdir`` / ``open`` would have given it under the process umask.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    with _UMASK_LOCK:  # reading the umask means setting it; restore at once
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def apply_umask(root: str | os.PathLike) -> None:
    """``chmod`` ``root`` and everything under it to the umask defaults: directories and executable files
    ``0o777 & ~umask``, other files ``0o666 & ~umask``. Links are left alone."""
    mask = current_umask()
    root = Path(root)
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_mode & 0o111):
            os.chmod(path, 0o777 & ~mask)
        elif stat.S_ISREG(st.st_mode):
            os.chmod(path, 0o666 & ~mask)
