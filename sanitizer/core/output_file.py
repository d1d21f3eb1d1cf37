"""Writing an output file (a report, a page, a trace) without touching what is not ours.

Torch-free, shared by every writer of a report or an output file (``report=PATH``, ``ownsan run
--report``, ``ownsan triage --html/--trace``, ray's ``collect(out=...)``).

A regular file, or a path that does not exist yet, is written atomically: to a temporary file beside
it, renamed over it only once complete, so a reader (or a run killed mid-write) never sees half of it
and a failure leaves the previous file as it was. Anything else is written *through*, never replaced:
``/dev/null`` must stay a device (as root, a rename over it turns it into a regular file for every
process on the machine), a FIFO must reach its reader, ``/dev/stdout`` must print. A symlink keeps its
link: its target is written (atomically when that is a regular file).
"""
from __future__ import annotations

import errno
import os
import re
import stat
import sys
import uuid
from typing import Optional

_FD_LINKS = ("/proc/", "/dev/fd/")  # a file descriptor's link (/dev/stdout -> /proc/self/fd/1): write through
_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` with every lone surrogate written as an escape, so it can be encoded as UTF-8.

    A non-UTF-8 file name reaches us as surrogate escapes (``'\\udcff'`` for the byte 0xff); a page that
    shows it must still be valid UTF-8. The byte a surrogate escape stands for is shown as ``\\xff``,
    any other lone surrogate (only a hand-made JSON file holds one) as ``\\udxxx``."""
    def escape(m: "re.Match[str]") -> str:
        code = ord(m.group())
        return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"

    return _SURROGATE.sub(escape, text)


def _resolve(path: str) -> Optional[str]:
    """Where the symlinks of ``path`` end (``path`` itself when it is none), or None when they go through a
    file descriptor's link (/dev/stdout, /dev/fd/N, /proc/self/fd/N): that is written through, as it is."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on a chain of links
        current = os.path.join(os.path.realpath(os.path.dirname(current)), os.path.basename(current))
        if current.startswith(_FD_LINKS):
            return None
        if not os.path.islink(current):
            return current
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)


def written_at(path: str) -> str:
    """The file a write to ``path`` replaces: a symlink's target (its chain followed), else ``path`` made
    absolute. A file beside a report (its journal) goes beside this one, where the report itself lands.
    For a path that :func:`replaced_whole` accepts."""
    try:
        return _resolve(path) or os.path.abspath(path)
    except OSError:
        return os.path.abspath(path)


def replaced_whole(path: str) -> bool:
    """Is ``path`` written as a file of its own (a regular file, or a new path outside /dev and /proc),
    not through (a device, a FIFO, a file descriptor's link)? Only such a path may get a sibling (a
    journal beside it, a forked child's ``.<pid>`` copy): /dev/null.journal, /dev/stdout.<pid> are not ours
    to make."""
    try:
        target = _resolve(path)
    except OSError:
        return False
    if target is None or target.startswith(("/dev/", "/proc/")) or os.path.abspath(path).startswith(("/dev/", "/proc/")):
        return False
    try:
        return stat.S_ISREG(os.stat(target).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _write_through(path: str, data: bytes) -> None:
    """Write ``data`` into what ``path`` names, as it is: no create, no truncation, no rename (appending,
    so a stdout redirected to a file keeps what was printed before)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def write_bytes(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` (atomically for a regular file or a new path, through for a device, a
    FIFO or a file descriptor's link; a symlink's target is written, the link kept). Returns ``path``.
    The directory must exist."""
    target = _resolve(path)
    if target is None:  # /dev/stdout and the like: what this process printed so far comes first
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # None, closed, or a broken pipe
                pass
        _write_through(path, data)
        return path
    try:
        st: Optional[os.stat_result] = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if st is not None and not stat.S_ISREG(st.st_mode):  # a device, a FIFO, a socket: never replaced
        _write_through(target, data)
        return path
    directory, name = os.path.split(target)
    tmp = os.path.join(directory, f".{name[:160]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)  # umask applies
    except PermissionError:
        if st is None:
            raise
        _write_through_truncating(target, data)  # a writable file in a directory we may not create in
        return path
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))  # the file keeps its permissions
        os.replace(tmp, target)  # a reader never sees half of it
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def _write_through_truncating(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def write_text(path: str, text: str, encoding: str = "utf-8") -> str:
    """:func:`write_bytes` of ``text`` encoded first: a text that cannot be encoded raises before any file
    is touched (the previous file stays whole). Returns ``path``."""
    return write_bytes(path, text.encode(encoding))


__all__ = ["printable", "replaced_whole", "written_at", "write_bytes", "write_text"]
