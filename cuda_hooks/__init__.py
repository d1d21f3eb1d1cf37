"""Thin numba kernels for the borrowed-tensor sanitizer: checksum, verify, poison.

Why a package of its own: the sanitizer needs to hash and poison tensor bytes
at memory speed on CPU and on CUDA, with one hash definition
(:mod:`cuda_hooks.hashdef`) shared by both so a hash taken on one device can
be checked on the other.  Importing this package does not import numba; the
kernels are compiled (or loaded from numba's disk cache) on first use, or
ahead of it with :func:`warm`; the serial CPU hash, once numba compiled it, is
stored as machine code that later processes load without numba
(:mod:`cuda_hooks.machine_code`).

Public API (see :mod:`cuda_hooks.bridge`): :func:`checksum`,
:func:`checksum_host` (a host numpy byte array), :func:`checksum_host_tensor`,
:func:`checksum_into`,
:func:`verify_into`, :func:`poison`, :func:`warm`, :func:`warm_host`,
:func:`kernel_info`, :func:`compile_seconds`, the slot conversions
:func:`to_signed` / :func:`to_unsigned`, and :class:`KernelsUnavailable`.
Which tensors are CUDA tensors, and where device memory comes from, is
:mod:`cuda_hooks.devices`.
"""

from __future__ import annotations

from . import devices
from .bridge import (checksum, checksum_host, checksum_host_tensor, checksum_into, compile_seconds, kernel_info, poison,
                     reset_device_state, to_signed, to_unsigned, verify_into, warm, warm_host)
from .errors import KernelsUnavailable
from .hashdef import HASH_VERSION

__all__ = [
    "HASH_VERSION",
    "KernelsUnavailable",
    "checksum",
    "checksum_host",
    "checksum_host_tensor",
    "checksum_into",
    "compile_seconds",
    "devices",
    "kernel_info",
    "poison",
    "reset_device_state",
    "to_signed",
    "to_unsigned",
    "verify_into",
    "warm",
    "warm_host",
]
