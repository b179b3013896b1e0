"""Writing files so that nothing is lost: every file tqgen writes goes through `write_atomic`.

A write goes to a temporary file in the same folder, is flushed to disk, then renamed over the
target: a killed build, tune or bench leaves the old file or the new one, never a partial one.

Files that belong together (an arch-auto module's dispatcher and its variants) go through
`write_atomic_group`: every file's temporary is written and flushed before any is renamed, so a
failed write (a full disk, a read-only folder) renames nothing and leaves the earlier files as they
were. The renames follow the given order (the dispatcher last); only a process killed between two
of them leaves a mix, which the dispatcher detects (it checks each variant's hash when loading it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import TqgenError


def write_failure_reason(exc: OSError) -> str:
    """Why a file or folder could not be written, in words: the system's reason, except 'No such file or
    directory', what /proc and the like answer for a name they do not take, which would point at the wrong thing."""
    if isinstance(exc, FileNotFoundError) or not exc.strerror:
        return "the file system does not allow it"
    return exc.strerror


def make_folder(out: Path) -> None:
    """Create a folder to write into (and its parents), or say in one line why it cannot be (TqgenError)."""
    if out.exists() and not out.is_dir():
        raise TqgenError(f"the folder {out} cannot be written: it is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TqgenError(f"the folder {out} cannot be written: it cannot be created "
                         f"({write_failure_reason(exc)})") from None


class GroupWriteError(OSError):
    """A file of a group could not be written: `path` names it, `cause` is the system's error."""

    def __init__(self, path: Path, cause: OSError):
        super().__init__(cause.errno, cause.strerror)
        self.path, self.cause = path, cause


def write_atomic(path: Path, data: bytes) -> bool:
    """Replace `path` with `data` atomically; returns False (and writes nothing) if unchanged."""
    if _unchanged(path, data):
        return False
    tmp = _write_temporary(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise
    return True


def write_atomic_group(files: list[tuple[Path, bytes]]) -> list[bool]:
    """Replace each path with its data, all files' temporaries written before the first rename (the
    module docstring says why); unchanged files are left alone. Returns, per file, whether it was written.
    Raises GroupWriteError naming the file that failed: no file has been replaced, unless a rename other
    than the first failed (a rename within one folder fails only when the folder itself does)."""
    changed = []
    for path, data in files:
        try:
            changed.append(not _unchanged(path, data))
        except OSError as exc:  # a folder where the file goes, a file that cannot be read
            raise GroupWriteError(path, exc) from None
    temporaries: list[tuple[str, Path]] = []
    try:
        for (path, data), write in zip(files, changed):
            if write:
                try:
                    temporaries.append((_write_temporary(path, data), path))
                except OSError as exc:
                    raise GroupWriteError(path, exc) from None
        for tmp, path in temporaries:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise GroupWriteError(path, exc) from None
    except BaseException:
        for tmp, _ in temporaries:
            _unlink(tmp)
        raise
    return changed


def _unchanged(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except FileNotFoundError:
        return False


def _write_temporary(path: Path, data: bytes) -> str:
    """`data` in a new, flushed temporary file beside `path`; returns its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
