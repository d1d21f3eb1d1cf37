"""CPU twin of the CUDA checksum kernel (numba, parallel, cached on disk).

Why: the sanitizer checksums borrowed CPU tensors on hot paths, so hashing
must run at memory bandwidth.  What makes it fast (measured, see
``bench/checksum.py``):

* the word index is an unsigned ``range``; with a signed index numba emits
  negative-index wraparound code and LLVM falls back to gather loads (a 6x
  slowdown);
* the position key is stepped by addition (``hashdef.position_key`` is
  linear), leaving two multiplies per word (~10% faster in cache);
* the words go in blocks of :data:`BLOCK_WORDS`, each summed by a fixed-length
  loop LLVM vectorises (the mix is integer-only, so no fastmath is needed),
  and before each block the cache lines :data:`PREFETCH_WORDS` ahead are
  prefetched.  The hash does ~2x the ALU work of a sum per word, so the
  out-of-order window holds fewer loads in flight than a sum's and the plain
  loop reads DRAM at ~0.8x of a plain sum's rate per thread; with the
  prefetch it reads at the sum's rate (in cache it costs ~5%).  Splitting a
  chunk into 2-8 interleaved streams instead gained less and not reliably
  (streams a power of two apart meet in the same cache sets);
* a few large chunks per thread (at least :data:`MIN_CHUNK_WORDS`), each
  summed into one partial;
* inputs below :data:`PARALLEL_MIN_BYTES` take a serial kernel, skipping the
  thread-pool dispatch that dominates for small tensors; above it the kernel
  that hashed faster lately runs (:mod:`cuda_hooks.kernel_choice`): on an
  oversubscribed machine the parallel kernel's fork-join stalls for tens of
  milliseconds.

The sum of mixed words is associative, so any split into blocks, chunks and
threads gives the same total: every variant is bit-identical to the
definition in :mod:`cuda_hooks.hashdef`.

Fork safety: numba's default (GNU OpenMP) thread pool cannot be used in a
child forked after the parent started it (numba aborts the child:
"fork() called from a process already using GNU OpenMP").  DataLoader
workers are such children, so after a fork this module only uses the serial
kernel.

Importing this module imports numba; ``cuda_hooks.bridge`` imports it lazily.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import llvmlite.ir as llvm_ir
import numba
import numpy as np
from numba import prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import hashdef, machine_code
from .cachedir import kernel_cache
from .loading import loading
from .kernel_choice import PARALLEL, PARALLEL_MIN_BYTES, KernelChoice

__all__ = [
    "hash_bytes",
    "compile_seconds",
    "kernel_runs",
    "MIN_CHUNK_WORDS",
    "CHUNKS_PER_THREAD",
    "PARALLEL_MIN_BYTES",
    "BLOCK_WORDS",
    "PREFETCH_WORDS",
]

#: Smallest parallel work item in words (256 KiB); above that, each thread
#: gets :data:`CHUNKS_PER_THREAD` items summed into one partial each.
MIN_CHUNK_WORDS = 1 << 15
CHUNKS_PER_THREAD = 4
#: Words per block (1 KiB): one vectorised fixed-length loop between two prefetch groups.
BLOCK_WORDS = 128
#: Prefetch distance in words (4 KiB ahead of the block being hashed).
PREFETCH_WORDS = 512
_LINE_WORDS = 8  # 64-byte cache lines: one prefetch per line

_njit_inline = numba.njit(inline="always")
_mix = _njit_inline(hashdef.mix)
_position_key = _njit_inline(hashdef.position_key)
_tail_word = _njit_inline(hashdef.tail_word)
_finalize = _njit_inline(hashdef.finalize)


@intrinsic
def _prefetch(typingctx: Any, arr: Any, index: Any) -> Any:
    """Hint the CPU to fetch the cache line of ``arr[index]`` (``llvm.prefetch``: read, keep in all levels).

    A prefetch never faults and never changes a result; callers still keep ``index`` in bounds.
    """
    if not isinstance(arr, types.Array) or not isinstance(index, types.Integer):
        return None
    sig = types.void(arr, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        # rw=0 (read), locality=3 (keep in every cache level), cache type=1 (data)
        builder.call(fn, [ptr, llvm_ir.Constant(i32, 0), llvm_ir.Constant(i32, 3), llvm_ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@_njit_inline
def _sum_words(words, lo, hi):  # pragma: no cover - compiled
    """Sum of ``mix(words[i], position_key(i))`` for ``i`` in ``[lo, hi)`` (uint64 bounds), mod 2**64.

    Blocks of ``BLOCK_WORDS``; before each, the lines ``PREFETCH_WORDS`` ahead are prefetched
    while they stay inside ``[lo, hi)``; the last partial block goes word by word.
    """
    block = np.uint64(BLOCK_WORDS)
    ahead = np.uint64(PREFETCH_WORDS)
    line = np.uint64(_LINE_WORDS)
    nblocks = (hi - lo) // block
    # blocks whose prefetch target [i + ahead, i + ahead + block) lies inside [lo, hi)
    prefetched = (hi - lo - ahead) // block if hi - lo >= ahead + block else np.uint64(0)
    total = np.uint64(0)
    key = _position_key(lo)
    i = lo
    for b in range(np.uint64(0), nblocks):
        if b < prefetched:
            for q in range(np.uint64(0), block, line):
                _prefetch(words, i + ahead + q)
        s = np.uint64(0)
        for j in range(np.uint64(0), block):
            s += _mix(words[i + j], key)
            key += hashdef.K_POS
        total += s
        i += block
    for k in range(i, hi):
        total += _mix(words[k], key)
        key += hashdef.K_POS
    return total


def _build(defn: str) -> tuple[Any, Any]:
    """Create the kernels; closing over ``defn`` keys numba's cache to hashdef.py."""

    @numba.njit(nogil=True, cache=True)
    def hash_serial(words, tail, nbytes):
        defn  # noqa: B018  (cache key only, see hashdef.definition_digest)
        n = np.uint64(words.size)
        total = _sum_words(words, np.uint64(0), n)
        if tail.size > 0:
            total += _mix(_tail_word(tail, 0, tail.size), _position_key(n))
        return _finalize(total, np.uint64(nbytes))

    @numba.njit(parallel=True, nogil=True, cache=True)
    def hash_parallel(words, tail, nbytes, chunk):
        defn  # noqa: B018
        n = words.size
        nchunks = (n + chunk - 1) // chunk
        parts = np.zeros(nchunks, dtype=np.uint64)
        for c in prange(nchunks):
            parts[c] = _sum_words(words, np.uint64(c * chunk), np.uint64(min((c + 1) * chunk, n)))
        total = np.uint64(0)
        for c in range(nchunks):
            total += parts[c]
        if tail.size > 0:
            total += _mix(_tail_word(tail, 0, tail.size), _position_key(np.uint64(n)))
        return _finalize(total, np.uint64(nbytes))

    return hash_serial, hash_parallel


with kernel_cache():  # the on-disk cache goes to the user cache directory, not next to this file
    _hash_serial, _hash_parallel = _build(hashdef.definition_digest())
_compile_seconds: dict[str, float] = {}
_variants: set = set()  # (kernel, (aligned, writeable)) compiled past the warm-up's, each under loading() once


_NOTHING = nullcontext()


def _compiling(kernel: str, variant: tuple) -> Any:
    """Around a kernel call: nothing for a variant already compiled (the aligned, writable one of the warm-up: the
    per-lend path), else :func:`loading` until one such call has returned (a thread calling it meanwhile waits on
    the same lock, not on numba's)."""
    if variant == (True, True) or (kernel, variant) in _variants:
        return _NOTHING
    return _loading_variant(kernel, variant)


@contextmanager
def _loading_variant(kernel: str, variant: tuple) -> Iterator[None]:
    with loading():
        yield
        _variants.add((kernel, variant))
_forked = False
_choice = KernelChoice()  # serial or parallel above PARALLEL_MIN_BYTES: see kernel_choice.py


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _split(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Whole little-endian words (a zero-copy view) and the trailing bytes."""
    nwords = buf.size // 8
    return buf[: nwords * 8].view("<u8"), buf[nwords * 8 :]


def hash_bytes(buf: np.ndarray) -> int:
    """Hash of a C-contiguous 1-D uint8 array, as a Python int in [0, 2**64).

    A buffer that is not 8-byte aligned is still read in place (numba then
    compiles an unaligned-load variant once).
    """
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"hash_bytes needs a contiguous 1-D uint8 array, got {buf.dtype} {buf.shape}")
    if not _compile_seconds:
        with loading():  # (a fork waits for the compile: see loading.py)
            if not _compile_seconds:
                _warm_up()
    words, tail = _split(buf)
    # numba types an array by its alignment and writability too: the warm-up compiled the aligned, writable
    # variant; another is compiled at its first use, under loading() (a fork must not copy numba's compiler lock)
    variant = (words.flags.aligned, words.flags.writeable)
    if buf.size < PARALLEL_MIN_BYTES or _forked:
        with _compiling("serial", variant):
            return int(_hash_serial(words, tail, buf.size))
    kernel, probe = _choice.pick()
    t0 = time.perf_counter()
    if kernel == PARALLEL:
        with _compiling("parallel", variant):
            h = _hash_parallel(words, tail, buf.size, _chunk_words(words.size))
    else:
        with _compiling("serial", variant):
            h = _hash_serial(words, tail, buf.size)
    _choice.record(kernel, (time.perf_counter() - t0) / buf.size, probe)
    return int(h)


def kernel_runs() -> dict[str, int]:
    """How many inputs of :data:`PARALLEL_MIN_BYTES` or more each kernel hashed in this process."""
    return dict(_choice.runs)


def _chunk_words(nwords: int) -> int:
    """Words per parallel work item for the current numba thread count."""
    return max(MIN_CHUNK_WORDS, -(-nwords // (CHUNKS_PER_THREAD * numba.get_num_threads())))


@contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """Around the first parallel call: keep torch's intra-op thread count as the user set it.

    numba's OpenMP pool sets the OpenMP thread count once, when it starts; where that reaches
    the runtime torch uses (seen here once torch had run parallel work), a program's
    ``torch.set_num_threads(1)`` silently became numba's thread count at the sanitizer's first
    hash.  torch is only looked up, never imported.
    """
    torch = sys.modules.get("torch")
    saved = torch.get_num_threads() if torch is not None else None
    try:
        yield
    finally:
        if torch is not None and torch.get_num_threads() != saved:
            torch.set_num_threads(saved)


def _warm_up() -> None:
    """Compile or load both kernels, timing each, then check the known answers.

    A known-answer mismatch means a stale on-disk cache (e.g. hashdef edited in
    a way the cache key missed): recompile once, and if it persists the
    definition and :data:`hashdef.GOLDEN` disagree, which is a bug.
    """
    probe = np.frombuffer(hashdef.golden_input(64), dtype=np.uint8).copy()  # aligned, writable
    t0 = time.perf_counter()
    _first_call(_hash_serial, *_split(probe), probe.size)
    _compile_seconds["cpu_hash_serial"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with _torch_threads_kept():
        _first_call(_hash_parallel, *_split(probe), probe.size, MIN_CHUNK_WORDS)
    _compile_seconds["cpu_hash_parallel"] = time.perf_counter() - t0
    for attempt in range(2):
        bad = [n for n, want in hashdef.GOLDEN.items() if _known_answer(n) != want]
        if not bad:
            _store_machine_code()
            return
        if attempt == 0:
            _hash_serial.recompile()
            _hash_parallel.recompile()
    raise RuntimeError(f"cuda_hooks CPU hash disagrees with hashdef.GOLDEN for lengths {bad}")


def _first_call(kernel: Any, *args: Any) -> Any:
    """The kernel's first call, which loads it from numba's disk cache. A damaged cache entry (a truncated or
    overwritten ``.nbc``) makes numba raise its unpickling error instead of compiling, in every later process
    too (a blind user's test: every checksummed run then failed at its first lend). So on any error the
    kernel's cache index is emptied (``Cache.flush``, numba's own reset) and the call made again: numba then
    compiles and saves a good entry."""
    try:
        return kernel(*args)
    except Exception:
        cache = getattr(kernel, "_cache", None)
        if cache is None:
            raise
        cache.flush()
        return kernel(*args)


def _store_machine_code() -> None:
    """Leave the serial hash as machine code for later processes, which then start without numba (see
    machine_code.py): once per machine and key, timed here. A failure only means they start numba too."""
    t0 = time.perf_counter()
    try:
        written = machine_code.store()
    except Exception:  # (an unwritable cache, NUMBA_DISABLE_JIT, an llvmlite that refuses: numba's kernels serve)
        return
    if written is not None:
        _compile_seconds["cpu_hash_machine_code_store"] = time.perf_counter() - t0


def _known_answer(n: int) -> int:
    buf = np.frombuffer(hashdef.golden_input(n), dtype=np.uint8).copy()
    words, tail = _split(buf)
    a, b = int(_hash_serial(words, tail, n)), int(_hash_parallel(words, tail, n, 1))
    return a if a == b else -1


def compile_seconds() -> dict[str, float]:
    """First-use compile-or-load seconds per CPU kernel (empty before first use)."""
    return dict(_compile_seconds)
