"""The filesystem under a checkpoint directory, handled as untrusted input.

Everything here assumes that another process may have put anything at any name: a
symbolic link, a FIFO that blocks whoever opens it, a device, a directory, a file of
gigabytes where a few bytes were expected. So every file is opened with `O_NOFOLLOW` and
`O_NONBLOCK` and checked to be a regular file on the descriptor that is then read (no
window between the check and the read), every read has a size cap, and every name in a
step directory is walked one component at a time, refusing a link at any level.

What this module writes gets explicit permissions whatever the umask: directories
`DIR_MODE` (0o755) and files `FILE_MODE` (0o644), so no other user can write into a
checkpoint, even under `umask 000`; a save in progress is `PRIVATE_DIR_MODE` (0o700),
unreachable by any other user until it is published.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

import torch

DIR_MODE = 0o755
FILE_MODE = 0o644
PRIVATE_DIR_MODE = 0o700
# ASCII "step-" and exactly eight ASCII digits. `\d` would accept any Unicode digit
# ("step-٠٠٠٠٠٠٣٠" sorts above every real step), and `$` a trailing newline.
STEP_NAME = re.compile(r"step-([0-9]{8})", re.ASCII)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CheckpointError(RuntimeError):
    """A checkpoint is missing, torn, corrupt, unsafe or cannot be written."""


def need(ok: bool, reason: str) -> None:
    """Raise `CheckpointError(reason)` unless `ok`."""
    if not ok:
        raise CheckpointError(reason)


def step_name(step: int) -> str:
    """The directory name of a published checkpoint of `step`."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step a directory name denotes, or None unless it is exactly `step-NNNNNNNN`."""
    match = STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def open_regular(path: Path) -> int:
    """Open `path` for reading: a regular file, not a link, and never a blocking open.

    Returns:
        A file descriptor; the caller closes it.

    Raises:
        CheckpointError: The file is missing, a link, or not a regular file (a FIFO, a
            device, a directory).
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise CheckpointError(f"{path.name} is missing") from None
    except OSError as exc:  # ELOOP: a symbolic link; others: unreadable
        reason = "is a symbolic link" if os.path.islink(path) else f"cannot be opened ({exc.strerror})"
        raise CheckpointError(f"{path.name} {reason}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{path.name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: Path, cap: int) -> bytes:
    """The whole content of the regular file `path`, refused if it exceeds `cap` bytes.

    Raises:
        CheckpointError: The file is not a regular file, is larger than `cap`, or
            cannot be read.
    """
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        need(size <= cap, f"{path.name} has {size} bytes, more than the {cap} allowed")
        chunks, left = [], cap + 1  # read one byte past the cap: the file may have grown
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise CheckpointError(f"{path.name} cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    need(len(data) <= cap, f"{path.name} has more than the {cap} bytes allowed")
    return data


def member(directory: Path, name: str) -> Path:
    """`directory / name` for a listed name: inside `directory`, no link at any level.

    Every component is checked, not only the last: a link in the middle of the path
    (`dcp -> ../step-00000010/dcp`) would otherwise make the same name read another
    checkpoint's bytes.

    Raises:
        CheckpointError: The name leaves the directory, or a component is a link or is missing.
    """
    check_relative(name)
    current = directory
    for part in PurePosixPath(name).parts:
        current = current / part
        need(not current.is_symlink(), f"{name} is reached through a symbolic link")
    need(current.exists(), f"{name} is missing")
    return current


def check_relative(name: Any) -> None:
    """A listed name must be a plain relative POSIX path that stays inside its directory.

    Raises:
        CheckpointError: It is not a string, is empty, absolute, or has `..`, `.`, an
            empty component or a backslash, or a control character.
    """
    need(isinstance(name, str) and name != "", f"a listed file has a non-string or empty name {name!r:.80}")
    parts = name.split("/")
    need(not name.startswith("/") and "\\" not in name and not any(p in ("", ".", "..") for p in parts)
         and name.isprintable(), f"{name!r:.120} is a path outside the checkpoint directory")


def load_weights_only(path: Path) -> Any:
    """`torch.load` with `weights_only=True` of a regular file: tensors and plain containers, never code.

    Raises:
        CheckpointError: The file is not a regular file, or the weights-only unpickler refuses it.
    """
    fd = open_regular(path)
    # torch reads the inode this descriptor holds, by its /proc name where there is one
    # (torch's own reader; a Python file object is slower for large files).
    proc = Path(f"/proc/self/fd/{fd}")
    try:
        if proc.exists():
            return torch.load(proc, map_location="cpu", weights_only=True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError and friends: refuse, never fall back to full pickle
        raise CheckpointError(f"{path.name} refused by the weights-only loader: "
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a directory tree."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def pinned(directory: Path) -> Iterator[None]:
    """Hold a shared lock on a step directory while reading it: retention leaves it alone.

    A reader outside the run (export) takes it before it reads the first byte; the
    run's retention removes only what it can lock exclusively (`remove_unless_pinned`).
    `flock`, not a record lock: a directory cannot be opened for writing, which a record
    lock's exclusive side needs.

    Raises:
        CheckpointError: The directory is a link, gone, or being removed right now.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        reason = "is a symbolic link" if os.path.islink(directory) else f"cannot be opened ({exc.strerror})"
        raise CheckpointError(f"{directory.name} {reason}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointError(f"{directory.name} is being removed by retention") from None
        # Removed (and perhaps made again) between the open and the lock: not what we hold.
        need(same_file(directory, fd), f"{directory.name} was removed by retention")
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_unless_pinned(path: Path) -> bool:
    """`remove(path)` unless a reader holds it `pinned`; True when it was removed.

    The exclusive lock is held through the removal, so a reader that comes meanwhile
    finds the directory being removed, never half of it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # a link or not a directory: nothing can pin it
        remove(path)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        remove(path)
    finally:
        os.close(fd)
    return True


def lock_lost(directory: Path, evidence: str) -> CheckpointError:
    """The error that stops a run which no longer owns `directory`, with what showed it."""
    return CheckpointError(f"checkpoint_dir {directory} lost its lock: {evidence} (the directory removed or "
                           "moved?); stopping so that no two runs write it")


def vanished(error: BaseException, *under: Path) -> Path | None:
    """The path under one of `under` whose absence raised `error` (or an error it was raised
    from): a file the run was writing there, removed meanwhile by someone else."""
    seen: BaseException | None = error
    for _ in range(8):  # the error and what it was raised from
        if isinstance(seen, FileNotFoundError) and seen.filename is not None:
            gone = Path(os.fsdecode(seen.filename))
            if any(gone.is_relative_to(directory) for directory in under):
                return gone
        seen = seen and (seen.__cause__ or seen.__context__)
    return None


def same_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the file that `fd` holds open."""
    try:
        return os.path.samestat(os.lstat(path), os.fstat(fd))
    except OSError:
        return False


def fsync_dir(path: Path) -> None:
    """fsync a directory, so the names in it (a rename, a new file) are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path, mode: int = DIR_MODE) -> None:
    """Create `path` (and missing parents) with exactly `mode`, whatever the umask.

    Directories that already exist keep their permissions: they are the user's.
    """
    if path.is_dir():  # the common case (every progress note): one stat
        return
    missing = [p for p in (path, *path.parents) if not p.exists() and not p.is_symlink()]
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:
            continue  # another rank made it first
        os.chmod(directory, mode)


def seal(root: Path) -> None:
    """Give a finished save its published permissions: directories 0o755, files 0o644.

    Raises:
        CheckpointError: Something other than a file or a directory sits in the tree
            (a link, a FIFO): nothing this trainer writes.
    """
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        need(stat.S_ISDIR(mode) or stat.S_ISREG(mode), f"{path.name} in a save is neither a file nor a directory")
        os.chmod(path, DIR_MODE if stat.S_ISDIR(mode) else FILE_MODE)  # not a link: lstat said so


def write_private(path: Path, data: bytes, durable: bool = True) -> None:
    """Create `path` (never through a link, never over an existing name) with `FILE_MODE` and write it.

    Args:
        path: The new file.
        data: Its content.
        durable: fsync it before returning.

    Raises:
        OSError: The name exists or the write fails.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
