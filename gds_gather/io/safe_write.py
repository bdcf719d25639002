"""Output files written safely: a temporary file beside the target, fsync, then an atomic rename.

`atomic_output(path)` is the one way gds_gather writes a file a user named (make-model, convert, ...):

- the target is checked first (`check_output`): its directory must exist, and the target itself must be absent
  or a regular file. A symbolic link, directory, FIFO, socket or device node at the target is refused with an
  `OutputPathError` that names the user's path, and is left untouched (os.lstat: a link is never followed);
- the data goes to a uniquely named temporary file in the SAME directory (tempfile.mkstemp), so the final
  os.replace is a rename within one filesystem (atomic) and never a copy;
- on success the file is fsync'ed, the target is checked again (something may have appeared meanwhile) and the
  temporary file is renamed over it; on any error, Ctrl-C included, the temporary file is removed;
- `check_free_space(path, nbytes)` refuses before anything is written when the filesystem has less room.

    with atomic_output("model.gguf") as tmp:      # tmp: a pathlib.Path of an empty file, mode 0644 (umask)
        write_everything_to(tmp)
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

from ..errors import OutputPathError


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a non-regular st_mode is, in words ('a directory', 'a FIFO', ...)."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def check_output(path) -> Path:
    """`path` as a Path when a file may be written there (absent or a regular file, in an existing directory)."""
    path = Path(path)
    if path.name in ("", ".", ".."):
        raise OutputPathError(f"{path}: not a file name")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputPathError(f"{path}: {e.strerror}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputPathError(f"{path} is {file_kind(st.st_mode)}; refusing to replace it (give a regular file name)")
    parent = path.parent
    if not parent.is_dir():
        raise OutputPathError(f"{path}: the directory {parent} does not exist")
    return path


def free_bytes(path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem that holds `path`'s directory."""
    st = os.statvfs(Path(path).parent)
    return st.f_bavail * st.f_frsize


def check_free_space(path, nbytes: int) -> None:
    """Refuse (OutputPathError) when writing `nbytes` at `path` would not fit, counting a file it replaces."""
    path = Path(path)
    free = free_bytes(path)       # a file it replaces stays until the rename: its space does not count
    if nbytes > free:
        raise OutputPathError(f"{path}: needs {nbytes:,} bytes but {path.parent} has {free:,} bytes free")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path) -> Iterator[Path]:
    """Yield a temporary file beside `path`; on success fsync it and rename it over `path` (see the module doc)."""
    path = check_output(path)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OutputPathError(f"{path}: cannot create a file in {path.parent} ({e.strerror})") from None
    tmp = Path(tmp_name)
    try:
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a model file is as readable as any other
        finally:
            os.close(fd)
        yield tmp
        _fsync(tmp)
        check_output(path)                    # again: a link or FIFO may have appeared while writing
        os.replace(tmp, path)
        with contextlib.suppress(OSError):    # make the rename durable (not possible on every filesystem)
            _fsync(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process umask, read without changing it (os.umask would race with other threads)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022
