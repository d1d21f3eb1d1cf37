"""Raw page mappings (``mmap``/``munmap``/``mprotect`` through ctypes), for trap mode only.

Why this exists: trap mode (``trap=poison|fault``) gives each lease its own mapping of the staging
buffer's pages and, when the lease is retired, replaces that mapping *in place* so every alias of it
(numpy arrays, memoryviews, DLPack tensors, ctypes pointers) reads poison or faults. Replacing a
mapping in place needs ``MAP_FIXED``, which Python's :mod:`mmap` module cannot do, and Python's
``mmap.mmap(fd, ...)`` also keeps one duplicated descriptor per mapping. So the few calls are made
here, through libc, and nowhere else.

The rules every call here keeps:

* every argument is validated first (a page-aligned address for fixed mappings and ``mprotect``, a
  length > 0, a descriptor >= 0, a page-aligned file offset) and a bad one raises ``ValueError``
  naming it, before the kernel sees it;
* a mapping is only ever *replaced* (``MAP_FIXED`` over the same range, which the kernel does
  atomically: no other thread can see a hole or get the range handed out in between) or unmapped
  by the object that owns it; nothing here unmaps a range it did not map;
* a failed call raises ``OSError`` with ``errno`` (the previous mapping then stays as it was).

Linux, 64-bit only (``off_t`` is a C long there); :data:`AVAILABLE` says so, and
:data:`UNAVAILABLE_REASON` says why not. torch-free.
"""
from __future__ import annotations

import ctypes
import mmap as _mmap
import os
import sys
from typing import Any, Optional

PAGE: int = _mmap.PAGESIZE
PROT_NONE = 0
PROT_READ = getattr(_mmap, "PROT_READ", 1)
PROT_WRITE = getattr(_mmap, "PROT_WRITE", 2)
MAP_SHARED = getattr(_mmap, "MAP_SHARED", 1)
MAP_PRIVATE = getattr(_mmap, "MAP_PRIVATE", 2)
MAP_FIXED = 0x10  # Linux, every architecture this project runs on
MAP_POPULATE = 0x8000  # Linux: fill the page tables now (one call) instead of one fault per page later
_MAP_FAILED = ctypes.c_void_p(-1).value

_LINUX = sys.platform.startswith("linux") and sys.maxsize > 2**32
AVAILABLE: bool = _LINUX and hasattr(os, "memfd_create")
UNAVAILABLE_REASON: Optional[str] = None if AVAILABLE else (
    f"needs 64-bit Linux (memfd_create, mmap with MAP_FIXED); this is {sys.platform}"
    + ("" if sys.maxsize > 2**32 else ", 32-bit"))

_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        if not AVAILABLE:
            raise OSError(UNAVAILABLE_REASON)
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mprotect.restype = ctypes.c_int
        lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


def round_up(n: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return -(-n // PAGE) * PAGE


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {value!r}")
    return value


def _check_range(address: int, length: int) -> None:
    _int(address, "address")
    _int(length, "length")
    if address <= 0 or address % PAGE:
        raise ValueError(f"address must be a non-null multiple of the page size {PAGE}, got {address:#x}")
    if length <= 0 or length % PAGE:
        raise ValueError(f"length must be a positive multiple of the page size {PAGE}, got {length}")


def _check_prot(prot: int) -> None:
    _int(prot, "prot")
    if prot & ~(PROT_READ | PROT_WRITE):
        raise ValueError(f"prot must combine PROT_READ and PROT_WRITE only, got {prot:#x}")


def map_file(fd: int, offset: int, length: int, prot: int, *, shared: bool = True,
             at: Optional[int] = None, populate: bool = False) -> int:
    """Map ``length`` bytes of file ``fd`` from ``offset``; returns the address.

    ``at``: replace the pages ``[at, at+length)``, which the caller must own (a mapping it made),
    atomically (``MAP_FIXED``); None lets the kernel choose a free range. ``shared``: writes reach
    the file (``MAP_SHARED``); else copy-on-write (``MAP_PRIVATE``)."""
    _int(fd, "fd")
    _int(offset, "offset")
    _check_prot(prot)
    if fd < 0:
        raise ValueError(f"fd must be >= 0, got {fd}")
    if offset < 0 or offset % PAGE:
        raise ValueError(f"offset must be a non-negative multiple of the page size {PAGE}, got {offset}")
    if at is None:
        _int(length, "length")
        if length <= 0:
            raise ValueError(f"length must be > 0, got {length}")
        flags = MAP_SHARED if shared else MAP_PRIVATE
    else:
        _check_range(at, length)
        flags = (MAP_SHARED if shared else MAP_PRIVATE) | MAP_FIXED
    if populate:
        flags |= MAP_POPULATE
    address = _lib().mmap(at, length, prot, flags, fd, offset)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap({length} bytes of fd {fd} at offset {offset}): {os.strerror(err)}")
    if at is not None and address != at:  # cannot happen with MAP_FIXED; never use a wrong range
        raise OSError(f"mmap(MAP_FIXED) returned {address:#x}, not {at:#x}")
    return address


def protect(address: int, length: int, prot: int) -> None:
    """``mprotect`` the pages ``[address, address+length)`` (a mapping the caller owns)."""
    _check_range(address, length)
    _check_prot(prot)
    if _lib().mprotect(address, length, prot):
        err = ctypes.get_errno()
        raise OSError(err, f"mprotect({address:#x}, {length}): {os.strerror(err)}")


def unmap(address: int, length: int) -> None:
    """``munmap`` a mapping the caller made (its whole range)."""
    _check_range(address, length)
    if _lib().munmap(address, length):
        err = ctypes.get_errno()
        raise OSError(err, f"munmap({address:#x}, {length}): {os.strerror(err)}")


def read_max_map_count() -> int:
    """The kernel's limit on this process's memory maps (``vm.max_map_count``; 65530 by default)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 65530


__all__ = ["PAGE", "AVAILABLE", "UNAVAILABLE_REASON", "PROT_NONE", "PROT_READ", "PROT_WRITE", "round_up",
           "map_file", "protect", "unmap", "read_max_map_count"]
