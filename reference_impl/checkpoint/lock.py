"""One writer per checkpoint directory: an exclusive lock that never writes through a link."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
from pathlib import Path
from types import TracebackType

from reference_impl.checkpoint.files import FILE_MODE, lock_lost, make_dir, same_file
from reference_impl.config import ConfigError

LOCK_FILE = ".lock"
_HOLDER_CAP = 4096  # a host name and a pid
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# --8<-- [start:directory_lock]
class DirectoryLock:
    """An exclusive lock on a checkpoint directory, held for the life of the process.

    A POSIX record lock (`fcntl.lockf`) rather than `flock`: the kernel drops it when the
    holder dies, however it dies, and a forked child (a DataLoader worker) does not
    inherit it, so a dead rank's lingering workers cannot keep a relaunch out.

    The lock file is opened with `O_NOFOLLOW`: a planted `.lock -> ../victim` link is
    removed and replaced by a file of our own, never opened, so its target is never
    truncated or written.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def check(self) -> None:
        """Raise `CheckpointError` unless `.lock` is still the file this holder locked.

        Deleting the lock file (or the whole directory) does not release a lock, it
        orphans it: a second run creates a new `.lock`, locks that, and both would write.
        So the holder compares the name's inode with its descriptor's before it writes.
        """
        if self._fd is not None and not same_file(self.path, self._fd):
            raise lock_lost(self.path.parent, f"{LOCK_FILE} was deleted or replaced while this run held it")

    def __enter__(self) -> DirectoryLock:
        """Take the lock, or raise `ConfigError` naming the holder's host and pid."""
        try:
            make_dir(self.path.parent)
            fd = self._open()
        except OSError as exc:
            raise ConfigError(f"cannot lock checkpoint_dir {self.path.parent}: {exc}") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, _HOLDER_CAP, 0).decode(errors="replace")
            os.close(fd)
            raise ConfigError(f"checkpoint_dir {self.path.parent} is in use by another run "
                              f"({_describe(holder)}); one run writes a directory at a time") from None
        if not _ours(fd):  # a file of the user's that happens to be named .lock: never truncated
            os.close(fd)
            raise ConfigError(f"checkpoint_dir {self.path.parent} holds a {LOCK_FILE} that this trainer did not "
                              "write; move it away or choose another directory")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
        self._fd = fd
        _HELD[_key(self.path.parent)] = self
        return self

    def _open(self) -> int:
        """A descriptor of the regular lock file, created with `FILE_MODE` when missing."""
        try:
            fd = os.open(self.path, _OPEN_FLAGS)
        except FileNotFoundError:
            fd = None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            self.path.unlink()  # a link: it goes, its target stays as it was
            fd = None
        if fd is None:
            try:
                fd = os.open(self.path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, FILE_MODE)
                os.fchmod(fd, FILE_MODE)
            except FileExistsError:  # another process created it first: use theirs
                fd = os.open(self.path, _OPEN_FLAGS)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device named .lock
            os.close(fd)
            raise OSError(errno.EINVAL, f"{LOCK_FILE} is not a regular file")
        return fd

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._fd is not None:
            _HELD.pop(_key(self.path.parent), None)
            os.close(self._fd)  # releases the lock
            self._fd = None
# --8<-- [end:directory_lock]


_HELD: dict[str, DirectoryLock] = {}  # this process's locks, by absolute directory


def _key(directory: Path) -> str:
    return os.path.abspath(directory)


def held_lock(directory: Path) -> DirectoryLock | None:
    """The lock this process holds on `directory`, if it holds one (global rank 0 of a run)."""
    return _HELD.get(_key(directory))


def _ours(fd: int) -> bool:
    """Whether the lock file holds what a holder writes: its name, or nothing yet (a holder
    between create and write, or one whose write a crash lost)."""
    if os.fstat(fd).st_size > _HOLDER_CAP:
        return False
    try:
        info = json.loads(os.pread(fd, _HOLDER_CAP, 0) or b"{}")
    except ValueError:
        return False
    return isinstance(info, dict) and set(info) <= {"host", "pid"}


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"host {info['host']}, pid {info['pid']}"
    except (ValueError, TypeError, KeyError):
        return "holder unknown: it has not written its name yet"
