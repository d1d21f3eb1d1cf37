"""The one hash definition shared by the CPU and CUDA kernels.

Why this module exists: a borrowed tensor is checksummed where it lives (CPU
or GPU) and the two results must be comparable bit for bit.  So the per-word
mix, the tail handling and the finalisation are written here exactly once as
plain Python functions over ``np.uint64`` values; ``cpu.py`` compiles them with
``numba.njit`` and ``gpu.py`` with ``numba.cuda.jit(device=True)``.  This
module imports only numpy, never numba.

Definition (version 1), for a region of ``n`` bytes:

* the bytes are read as little-endian uint64 words ``w[0..ceil(n/8))``; a
  trailing partial word is zero-padded (see :func:`tail_word`);
* every word is mixed with its index, ``mix(w, position_key(i))``:
  ``w ^ (i * K_POS)`` then a bijection (two odd multiplies, two xorshifts);
* the terms are SUMMED mod 2**64.  Addition is associative, so any split into
  per-thread partial sums gives the same total; since ``mix`` is bijective, a
  change to any single word always changes the sum, and position keying plus
  the non-linear mix make swapped words and multi-word damage change it with
  probability ~1 - 2**-64 (an XOR fold would cancel equal terms);
* ``finalize(total, n)`` folds in the byte length (so trailing zero bytes
  count) through the murmur3 ``fmix64`` avalanche, which is also bijective.

Arithmetic rules, so both compilers type everything as uint64 and no signed
/ unsigned mix ever promotes to float64: every constant, shift count and index
is an ``np.uint64``.  Running these functions on numpy scalars (which only the
CUDA simulator does) wraps correctly but makes numpy emit "overflow
encountered in scalar ..." RuntimeWarnings; compiled code never warns.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

__all__ = [
    "HASH_VERSION",
    "K_POS",
    "K_LEN",
    "SEED",
    "position_key",
    "mix",
    "tail_word",
    "finalize",
    "GOLDEN",
    "golden_input",
    "definition_digest",
]

HASH_VERSION = 1

#: Position key multiplier (2**64 / golden ratio, odd).
K_POS = np.uint64(0x9E3779B97F4A7C15)
#: splitmix64 multipliers used by :func:`mix` (odd, so multiplication is a bijection).
M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)
#: murmur3 fmix64 multipliers used by :func:`finalize`.
F1 = np.uint64(0xFF51AFD7ED558CCD)
F2 = np.uint64(0xC4CEB9FE1A85EC53)
#: Length key multiplier (odd) and seed, so the empty region does not hash to 0.
K_LEN = np.uint64(0xD6E8FEB86659FD93)
SEED = np.uint64(0x2545F4914F6CDD1D)

_S8 = np.uint64(8)
_S29 = np.uint64(29)
_S32 = np.uint64(32)
_S33 = np.uint64(33)
_ZERO = np.uint64(0)


def position_key(index: np.uint64) -> np.uint64:
    """Key of word ``index``: ``index * K_POS``.

    Linear in the index, so kernels step it by addition
    (``key(i + d) = key(i) + key(d)`` mod 2**64) instead of multiplying per word.
    """
    return index * K_POS


def mix(word: np.uint64, key: np.uint64) -> np.uint64:
    """Position-keyed bijective scramble of one word; the hash sums these.

    ``key`` is :func:`position_key` of the word's index.  Two multiplies and
    two xorshifts: enough to make swapped or damaged words change the sum,
    cheap enough that the CPU loop stays memory-bound.  The final xorshift
    matters: a multiply is linear mod 2**64, so without it two swapped words
    that differ only in bit 63 leave the sum unchanged half the time (tested).
    Calls no other function so each target compiles it standalone.
    """
    x = (word ^ key) * M1
    x = x ^ (x >> _S32)
    x = x * M2
    return x ^ (x >> _S29)


def tail_word(buf: np.ndarray, start: int, stop: int) -> np.uint64:
    """Little-endian word from ``buf[start:stop]`` (at most 8 bytes), zero-padded.

    Used for the trailing partial word, and by the CUDA kernel for every word
    when the buffer is not 8-byte aligned (a misaligned 8-byte load faults).
    """
    w = _ZERO
    sh = _ZERO
    for k in range(start, stop):
        w = w | (np.uint64(buf[k]) << sh)
        sh = sh + _S8
    return w


def finalize(total: np.uint64, nbytes: np.uint64) -> np.uint64:
    """Fold the byte length into the sum, then avalanche (murmur3 fmix64)."""
    x = total ^ (nbytes * K_LEN) ^ SEED
    x = x ^ (x >> _S33)
    x = x * F1
    x = x ^ (x >> _S33)
    x = x * F2
    return x ^ (x >> _S33)


def golden_input(n: int) -> bytes:
    """Deterministic test bytes for :data:`GOLDEN` (byte k is ``(k * 37 + 11) % 256``)."""
    return bytes((k * 37 + 11) % 256 for k in range(n))


#: Known answers ``{n: hash(golden_input(n))}`` pinning the definition: the
#: CPU kernel checks them on first use (catching a stale on-disk cache) and the
#: tests check them against an independent pure-Python implementation.
GOLDEN: dict[int, int] = {
    0: 0xB800BD6C02472607,
    1: 0x04F7647958F13BEB,
    7: 0x8669EBB6645E52F1,
    8: 0xD4DCD1A0D889F227,
    9: 0x820D3A2B0EF41C0C,
    100: 0x743063DCC2A3072C,
    4099: 0x707F8FA6061976E7,
}


def definition_digest() -> str:
    """SHA-256 of this file's source.

    numba's on-disk cache only tracks the file that defines a kernel, not the
    files of functions it inlines; the kernels close over this digest, which
    numba puts in the cache key, so editing this file invalidates their cache.
    """
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
