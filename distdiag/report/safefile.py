"""Files opened as what they claim to be (issue 24): outputs written without following a link,
inputs read as regular files of bounded size.

An output path that is a symbolic link is refused, not written through: on a shared /tmp a
link planted where a report will go would otherwise make distdiag overwrite (or, dangling,
create) a file of the attacker's choosing. A FIFO, device, socket or directory there is
refused too (a rename would replace a pipe someone reads, or a device node, with a file).
Writes go to a temporary file created with O_EXCL|O_NOFOLLOW beside the target and renamed
over it (readers see the old file or the new one, never half).

Inputs follow links (a config that is a link into a dotfiles repository is normal) but must
turn out to be regular files once opened (fstat, so no race with a swap between check and
open): a FIFO would block the reader forever, /dev/zero would fill memory. They are opened
non-blocking for that reason, and read up to a size limit.

A leaf of the report package: it imports only distdiag.errors (for the common base class), so
the check, the watchdog, the monitor and analyze may all use it.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from pathlib import Path
from typing import IO

from distdiag.errors import DistDiagError

__all__ = [
    "RefusedFile",
    "non_regular_kind",
    "check_output_path",
    "write_atomic",
    "open_append",
    "read_bytes_limited",
    "printable",
    "MAX_CONFIG_BYTES",
    "MAX_REPORT_BYTES",
    "MAX_LOG_BYTES",
]

MAX_CONFIG_BYTES = 16 << 20
"""A TOML config larger than 16 MiB is not a config (the shipped profiles are under 4 KiB)."""
MAX_REPORT_BYTES = 512 << 20
"""A report or flight-recorder dump larger than 512 MiB is refused rather than read into memory
(a 4096-rank hang report with every rank's recorder entries stays well under 100 MiB)."""
MAX_LOG_BYTES = 4 << 30
"""A metrics log (JSON lines, CSV, trainer_state.json, TensorBoard events) is read whole; past
4 GiB it is refused with a line rather than ending in MemoryError."""

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class RefusedFile(DistDiagError, OSError):
    """A path that is not what it must be: a link where an output goes, a FIFO or device where
    an input is read, a file over its size limit. str() is the one line that says so."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _kind(mode: int) -> str:
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def non_regular_kind(path: str | os.PathLike[str]) -> str | None:
    """What stands at `path` (symlinks followed) when it is not a regular file: 'a FIFO
    (named pipe)', 'a directory', ...; None when it is a regular file or nothing."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        raise
    return None if stat.S_ISREG(mode) else _kind(mode)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def _file_on_the_way(path: str) -> str:
    """The first folder on `path` that exists and is not a directory (what ENOTDIR was about)."""
    for parent in reversed(Path(path).parents):
        if os.path.exists(parent) and not os.path.isdir(parent):
            return str(parent)
    return str(Path(path).parent)  # pragma: no cover - it changed since


def check_output_path(path: str | os.PathLike[str], hint: str = "pick a file path") -> None:
    """Raise RefusedFile (one line naming `path` and what stands there) unless `path` is a
    regular file or nothing: a symbolic link (to a file, dangling or a loop), a FIFO, device,
    socket or directory, or a parent that is a file. `hint` ends the line (the fix)."""
    given = str(path)
    try:
        mode = os.lstat(given).st_mode
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise RefusedFile(errno.ENOTDIR, f"{given}: {_file_on_the_way(given)} is not a directory; {hint}") from None
    if stat.S_ISLNK(mode):
        try:
            os.stat(given)
            what = f"a symbolic link (to {os.readlink(given)})"
        except FileNotFoundError:
            what = f"a dangling symbolic link (to {os.readlink(given)})"
        except OSError:
            what = "a symbolic link loop"
        raise RefusedFile(errno.ELOOP, f"{given} is {what}; refusing to write through it ({hint})")
    if not stat.S_ISREG(mode):
        code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
        raise RefusedFile(code, f"{given} is {_kind(mode)}, not a regular file; refusing to replace it ({hint})")


def _checked_with_parent(given: Path, hint: str) -> None:
    """check_output_path, then the folder made if missing (one that is a file: refused)."""
    check_output_path(given, hint)
    try:
        given.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise RefusedFile(errno.ENOTDIR, f"{given}: {given.parent} is not a directory; {hint}") from None


def write_atomic(path: str | os.PathLike[str], data: str | bytes, hint: str = "pick a file path") -> Path:
    """Write `data` to `path` atomically (temp file beside it, then rename), refusing what
    check_output_path refuses. The file is 0644 minus the umask, like any file the user writes.
    Its folder is made if missing."""
    given = Path(path)
    _checked_with_parent(given, hint)
    blob = data.encode("utf-8") if isinstance(data, str) else data
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = given.parent / f".{given.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o644)  # the kernel applies the umask
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - 100 collisions of 48 random bits
        raise RefusedFile(errno.EEXIST, f"{given}: could not create a temporary file beside it")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
            handle.flush()
            os.fsync(handle.fileno())
        # os.replace renames over the final component without following a link there; the
        # check above already refused one, this keeps a link planted since then untouched too
        os.replace(tmp, given)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return given


def open_append(path: str | os.PathLike[str], hint: str = "pick a file path") -> IO[str]:
    """A text file opened for appending (created 0644 minus the umask, its folder made), refusing
    what check_output_path refuses; O_NOFOLLOW|O_NONBLOCK and an fstat close the race with a
    link or FIFO swapped in after the check (a FIFO without a reader would block the open)."""
    given = Path(path)
    _checked_with_parent(given, hint)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(given, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            check_output_path(given, hint)  # says what it is now
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RefusedFile(errno.EINVAL, f"{given} is {_kind(mode)}, not a regular file; refusing to write to it ({hint})")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


def read_bytes_limited(path: str | os.PathLike[str], max_bytes: int, what: str) -> bytes:
    """The bytes of the regular file at `path` (links followed), at most `max_bytes`.

    Raises RefusedFile naming `what` the file should be for a FIFO, device, socket or
    directory (found by fstat on the open file: opening is non-blocking, so a FIFO without a
    writer does not hang here), a link loop, or a file over the limit; FileNotFoundError and
    other OSErrors as they come.
    """
    given = str(path)
    try:
        fd = os.open(given, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedFile(errno.ELOOP, f"{given} is a symbolic link loop, not {what}") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RefusedFile(errno.EINVAL, f"{given} is {_kind(info.st_mode)}, not {what}")
        if info.st_size > max_bytes:
            raise RefusedFile(errno.EFBIG, f"{given} is {_size(info.st_size)}, over the {_size(max_bytes)} limit for {what}")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= max_bytes:  # the file may grow after fstat: read one byte past the limit at most
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise RefusedFile(errno.EFBIG, f"{given} is over the {_size(max_bytes)} limit for {what}")
        return b"".join(chunks)
    finally:
        os.close(fd)


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides: what
a terminal acts on (ESC starts colour, cursor, title and hyperlink sequences; CR rewrites the
line; U+202E reverses it) rather than shows."""
_UNPRINTABLE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""The same, with tab and newline."""


def printable(text: str, *, one_line: bool = False) -> str:
    """`text` safe to print on a terminal: every control character but tab and newline is
    shown escaped (ESC as \\x1b), so strings read from a report or log are seen, never acted
    on. `one_line`: newlines and tabs escaped too (an error line stays one line)."""
    pattern = _UNPRINTABLE_LINE if one_line else _UNPRINTABLE
    return pattern.sub(lambda m: ascii(m.group())[1:-1], text)
