"""How a rank's process died, read by a peer on the same host after it is gone.

A process killed by a fatal signal leaves its peers nothing: no exception, no snapshot, only
"its process is gone". Yet the signal separates causes that call for different fixes:
SIGKILL is the OOM killer or an operator; SIGSEGV/SIGBUS a crash in native code; SIGABRT
inside a collective is the communication library ending the process itself - gloo when a
peer's message has another size than the one expected (two ranks in different collectives:
its "Is there a distributed collective mismatch in your code?"), NCCL's watchdog on a timeout
or a communicator error. There the dead rank is the messenger, not the cause.

Python's `faulthandler` writes the fatal signal and every Python thread's stack from its C
signal handler, which runs even when a C++ thread aborts the process. When the watchdog arms
and the program has not enabled faulthandler itself, each rank enables it into a file of its
own, named by its pid under a per-user directory of the temp dir (mode 0700); a clean end
disables it and removes the file. A peer that finds the process gone reads the file by pid
(`read`). A program that enabled faulthandler itself keeps it as it is (its stderr then
carries the stacks) and its peers learn only that the process is gone.

A process aborted inside a collective loses its own evidence with it, and one piece decides
between causes: whether its DataLoader pass had ended (uneven data: it went on to the pass's end
collectives while its peers still drew batches). So each time one of its passes ends, a rank
writes its loaders' passes (a few hundred bytes of JSON, once per pass) beside the note
(`note_loaders`), and `read` hands them back with the death.

Only same-host peers can read the file; on other hosts the rank stays "no answer".
"""

from __future__ import annotations

import faulthandler
import os
import re
import stat
import tempfile
import threading
from dataclasses import dataclass, field
from typing import IO, Any

__all__ = ["Death", "arm", "disarm", "read", "parse", "note_path", "note_loaders", "loaders_path"]

_MAX_BYTES = 256 * 1024
"""Bytes read from a note: faulthandler writes 100 frames per thread at most."""

_SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.+)$')

_armed: dict[str, Any] = {}


@dataclass
class Death:
    """A fatal signal as faulthandler wrote it: the signal, its line, and the stack of the
    thread that ran the program's top level (innermost frame first)."""

    signal: str
    line: str
    stack: list[str] = field(default_factory=list)
    collective: str | None = None
    """The torch.distributed function the main thread was in (``all_reduce``, ``wait``, ...)."""
    call_site: str | None = None
    """The innermost frame of the main thread outside torch.distributed, when it was in one."""
    loaders: list[dict[str, Any]] = field(default_factory=list)
    """Its DataLoader passes as it last wrote them (distdiag.watchdog.dataload), when a pass ended
    while it was armed: the loaders' evidence its peers' snapshots hold for them."""

    @property
    def in_collective(self) -> bool:
        return self.collective is not None

    def text(self) -> str:
        where = ""
        if self.collective:
            where = f" while its main thread was in torch.distributed's {self.collective}"
            if self.call_site:
                where += f" called at {self.call_site}"
        elif self.stack:
            where = f" at {self.stack[0]}"
        return f"it died of {self.signal} ({self.line}){where}"

    def to_dict(self) -> dict[str, Any]:
        return {"signal": self.signal, "line": self.line, "stack": self.stack,
                "collective": self.collective, "call_site": self.call_site, "loaders": self.loaders}


def note_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"distdiag-{os.getuid()}")


def note_path(pid: int) -> str:
    return os.path.join(note_dir(), f"fatal-{int(pid)}.txt")


def loaders_path(pid: int) -> str:
    return os.path.join(note_dir(), f"loaders-{int(pid)}.json")


def own_dir(path: str) -> bool:
    """The directory exists (made here if not), is a real directory, ours, and closed to others."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def arm() -> bool:
    """Enable faulthandler into this process's note, unless the program enabled it already.
    True when armed here (now or before). Never raises: the note is evidence, not a duty."""
    if _armed.get("pid") == os.getpid():
        return True
    if faulthandler.is_enabled():
        return False
    path = note_path(os.getpid())
    try:
        if not own_dir(os.path.dirname(path)):
            return False
        _prune(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        f: IO[str] = os.fdopen(fd, "w")
        faulthandler.enable(file=f, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        return False
    _armed.update(pid=os.getpid(), file=f, path=path)  # faulthandler needs the file kept open
    if not _armed.get("fork_hook"):
        # a forked child (a DataLoader worker) inherits the handler and the file: its crash
        # would read as this rank's; it gets the state it had without us
        os.register_at_fork(after_in_child=_forked)
        _armed["fork_hook"] = True
    return True


def _forked() -> None:
    if _armed.get("pid") not in (None, os.getpid()):
        try:
            faulthandler.disable()
        except Exception:  # noqa: BLE001 - never break the child
            pass
        _armed.clear()
        _armed["fork_hook"] = True


_KEEP_S = 7 * 24 * 3600
"""A note with a death in it is kept this long for a late `distdiag` reader; an empty one (a
process ended by SIGTERM or SIGKILL, which faulthandler does not catch) only while its pid lives."""


def _prune(path: str) -> None:
    """Remove the notes of processes that are gone: empty ones at once, the others after _KEEP_S."""
    import time

    now = time.time()
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        m = re.fullmatch(r"(fatal|loaders)-(\d+)\.(txt|json)(\.\d+\.tmp)?", name)
        if m is None:
            continue
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
            if m[1] == "loaders":
                # kept while its process lives or its note does (read with the note)
                if _alive(int(m[2])) or os.path.lexists(note_path(int(m[2]))):
                    continue
            elif st.st_size and now - st.st_mtime < _KEEP_S:
                continue
            elif not st.st_size and _alive(int(m[2])):
                continue
            os.unlink(full)
        except OSError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def disarm() -> None:
    """A clean end: faulthandler off (if enabled here) and the note removed."""
    hook = _armed.get("fork_hook")
    if _armed.get("pid") != os.getpid():
        _armed.clear()
        _armed.update({"fork_hook": True} if hook else {})
        return
    try:
        faulthandler.disable()
    except Exception:  # noqa: BLE001 - interpreter shutting down
        pass
    f, path = _armed.get("file"), _armed.get("path")
    _armed.clear()
    _armed.update({"fork_hook": True} if hook else {})
    try:
        if f is not None:
            f.close()
        if path:
            os.unlink(path)
    except OSError:
        pass
    try:
        os.unlink(loaders_path(os.getpid()))
    except OSError:
        pass


def note_loaders(passes: list[dict[str, Any]]) -> None:
    """Write this rank's DataLoader passes beside its note, replacing the last (atomic: a peer
    reads the old or the new file, never half of one). Only while armed here; never raises."""
    if _armed.get("pid") != os.getpid():
        return
    import orjson

    path = loaders_path(os.getpid())
    tmp = f"{path}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.write(fd, orjson.dumps(passes))
        finally:
            os.close(fd)
        os.replace(tmp, path)  # replaces a link at `path` itself, never writes through it
    except (OSError, TypeError):
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read_loaders(pid: int) -> list[dict[str, Any]]:
    """The passes `note_loaders` wrote for `pid`; [] when none (or unreadable, or not ours)."""
    import orjson

    try:
        fd = os.open(loaders_path(pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return []
        data = os.read(fd, _MAX_BYTES)
    except OSError:
        return []
    finally:
        os.close(fd)
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        return []
    return [p for p in raw if isinstance(p, dict)] if isinstance(raw, list) else []


def read(pid: int) -> Death | None:
    """The death of same-host process `pid` as its note tells it; None when it left none (no
    fatal signal caught: SIGKILL, a plain exit, or faulthandler was not ours)."""
    if pid <= 0:
        return None
    try:
        fd = os.open(note_path(pid), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        data = os.read(fd, _MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    death = parse(data.decode("utf-8", "replace"))
    if death is not None:
        death.loaders = _read_loaders(pid)
    return death


def parse(text: str) -> Death | None:
    """faulthandler's report (``Fatal Python error: <what>`` then one block per thread)."""
    lines = text.splitlines()
    head = next((ln for ln in lines if ln.startswith("Fatal Python error:")), None)
    if head is None:
        return None
    what = head.split(":", 1)[1].strip()
    signal = _SIGNALS.get(what, what or "a fatal signal")
    threads: list[list[tuple[str, str, str]]] = []
    for ln in lines:
        if re.match(r"^(Current thread|Thread) 0x[0-9a-fA-F]+", ln):
            threads.append([])
            continue
        m = _FRAME.match(ln)
        if m and threads:
            threads[-1].append((m["file"], m["line"], m["func"]))
    # the thread that runs the program: a module's top level is among its frames (threads start in threading)
    main = next((t for t in threads if any(fn == "<module>" for _, _, fn in t)), threads[0] if threads else [])
    death = Death(signal=signal, line=head, stack=[f"{f}:{n} in {fn}" for f, n, fn in main])
    dist = [i for i, (f, _, _) in enumerate(main) if _in_torch_distributed(f)]
    if dist:
        # the API called: the outermost frame of distributed_c10d (its helpers and torch's
        # logging wrappers lie inside it), else the outermost torch.distributed frame
        api = [i for i in dist if main[i][0].replace("\\", "/").endswith("distributed/distributed_c10d.py")]
        death.collective = main[(api or dist)[-1]][2]
        # the job's line, chosen as the recorder chooses its entries' (the innermost frame outside
        # torch), so that the two compare: not the frame outside the OUTERMOST torch.distributed
        # one, which inside DDP's forward is torch's own module call
        from distdiag.hang.recorder import job_frame

        outside = next(((f, n, fn) for f, n, fn in main[dist[0] + 1:] if job_frame(f.replace("\\", "/"))), None)
        if outside is not None:
            death.call_site = f"{outside[0]}:{outside[1]} in {outside[2]}"
    return death


def _in_torch_distributed(path: str) -> bool:
    p = path.replace("\\", "/")
    return "/torch/distributed/" in p or "/torch/nn/parallel/" in p
