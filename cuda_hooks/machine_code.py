"""The serial CPU hash as machine code: numba compiles it once, later processes load it with llvmlite alone.

Why: numba's first use in a process costs ~0.45 s on the 2-core dev machine, before a single byte is
hashed: its import (~0.2 s) and, at the first kernel it takes even from its own disk cache, the typing and
lowering registries it loads (~0.23 s, ``numba.np.npyimpl``'s ufunc tables and the like). With
``checksum=1`` that is paid inside the first lend: a 0.6 GiB checkpoint that loads in 0.26 s took 0.82 s,
of which the hashes themselves were ~0.08 s (issue 52). The serial hash is one function of three plain
arguments that touches no Python object and allocates nothing, so its machine code needs nothing of numba
at run time. llvmlite (numba's own LLVM binding, installed with it) loads an object file into its MCJIT
engine in ~3 ms after a ~0.04 s import.

What is stored: the object code of :func:`_hash_at`'s native function (numba's calling convention, no
Python or C wrapper: ``numba.njit(no_cpython_wrapper=True, no_cfunc_wrapper=True)``; every other symbol is
made internal and dropped by global dead-code elimination, so the object has exactly one defined symbol and
no undefined one), in :func:`cuda_hooks.cachedir.cache_dir` under a key of everything that code depends
on: the source of this module, of ``cpu.py`` (the loop it inlines) and of ``hashdef.py``, the host CPU's
name and features (numba compiles for the host CPU, ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` included)
and llvmlite's version. A process that finds no such file uses numba's kernels
(:mod:`cuda_hooks.cpu`), whose warm-up writes it for the next process (:func:`store`). Loaded code must
give :data:`hashdef.GOLDEN`'s answers before its first use, and is run only if its bytes match the SHA-256
stored with them (a damaged file must not run); any failure (no file, a damaged file, llvmlite missing or
refusing it, a wrong answer) means "not available" and numba's kernels run, never a wrong hash.

The call: numba's native calling convention is ``int32 status = f(ret *, excinfo **, args...)``, 0 meaning
success; the kernel has no path that fails (no bounds check, no division by a variable, no allocation),
and a non-zero status would still be refused (``MachineCodeFailed``). ctypes releases the GIL around the
call, as numba's ``nogil=True`` kernels do. Only the serial kernel is stored: the parallel one runs on
numba's thread pool, so an input that wants it imports numba (:mod:`cuda_hooks.bridge` decides, and copies
bytes at an address that is not a multiple of 8 into an aligned buffer of its own first: the code reads whole
words).
Importing this module imports neither numba nor llvmlite.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

from . import hashdef
from .cachedir import cache_dir

__all__ = ["HostHash", "load", "store", "key", "path", "MachineCodeFailed"]

_HERE = Path(__file__).resolve().parent
_SOURCES = ("machine_code.py", "cpu.py", "hashdef.py")
_SUBDIR = "machine_code"
_FORMAT = 2

#: ``int32 f(uint64 *ret, void *excinfo, uint64 *words, uint8 *bytes, uint64 nbytes)``: numba's native convention.
_SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_uint64)


class MachineCodeFailed(RuntimeError):
    """The loaded hash reported a failure status (it has no failing path: the stored code is not ours)."""


class HostHash:
    """The loaded serial hash: ``hash_at(address, nbytes)`` of ``nbytes`` bytes at an 8-byte-aligned address.

    Keeps the llvmlite engine that owns the code alive as long as the function may be called.
    """

    def __init__(self, engine: Any, function: Callable[..., int], seconds: float) -> None:
        self._engine = engine
        self._function = function
        self.seconds = seconds  # import of llvmlite, read, load and the known-answer check

    def hash_at(self, address: int, nbytes: int) -> int:
        """Hash (``hashdef``'s definition) of ``nbytes`` bytes at ``address`` (a multiple of 8)."""
        out = ctypes.c_uint64()
        excinfo = ctypes.c_void_p()
        status = self._function(ctypes.addressof(out), ctypes.addressof(excinfo), address, address, nbytes)
        if status != 0:
            raise MachineCodeFailed(f"the stored CPU hash returned status {status}")
        return out.value


def _llvm() -> Any:
    import llvmlite.binding as ll  # (~0.02 s; numba's own dependency)

    ll.initialize_native_target()
    ll.initialize_native_asmprinter()
    return ll


def key(ll: Any = None) -> str:
    """Everything the stored code depends on, hashed: the sources it is compiled from, the host CPU, llvmlite."""
    import llvmlite

    ll = ll or _llvm()
    digest = hashlib.sha256(f"format {_FORMAT}\n".encode())
    for name in _SOURCES:
        digest.update((_HERE / name).read_bytes())
    cpu = os.environ.get("NUMBA_CPU_NAME") or ll.get_host_cpu_name()
    features = os.environ.get("NUMBA_CPU_FEATURES") or ll.get_host_cpu_features().flatten()
    digest.update(f"\n{ll.get_process_triple()}\n{cpu}\n{features}\n{llvmlite.__version__}\n".encode())
    return digest.hexdigest()[:32]


def path(ll: Any = None) -> Path:
    """The file that holds (or would hold) the code for this process's key."""
    return Path(cache_dir()) / _SUBDIR / f"cpu_hash-{key(ll)}.json"


def load() -> Optional[HostHash]:
    """The stored hash for this process's key, loaded and checked; None when there is none or it is not right.

    Each call loads anew: the caller keeps the result (``bridge._stored_hash``, under ``loading()``).
    """
    t0 = time.perf_counter()
    try:
        return _load(t0)
    except Exception:  # any failure means numba's kernels run: never a wrong hash, never a crash here
        return None


def _load(t0: float) -> Optional[HostHash]:
    ll = _llvm()
    try:
        entry = json.loads(path(ll).read_text())
    except (OSError, ValueError):
        return None
    if entry.get("format") != _FORMAT:
        return None
    obj = bytes.fromhex(entry["object"])
    if hashlib.sha256(obj).hexdigest() != entry.get("sha256"):
        return None  # damaged: never run code whose bytes are not the ones stored
    return _checked(_engine(ll, obj), entry["symbol"], t0)


def _engine(ll: Any, obj: bytes) -> Any:
    target = ll.Target.from_default_triple().create_target_machine()
    engine = ll.create_mcjit_compiler(ll.parse_assembly(""), target)
    engine.add_object_file(ll.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    return engine


def _checked(engine: Any, symbol: str, t0: float) -> Optional[HostHash]:
    address = engine.get_function_address(symbol)
    if not address:
        return None
    found = HostHash(engine, _SIGNATURE(address), 0.0)
    for n, want in hashdef.GOLDEN.items():
        words = (ctypes.c_uint64 * (n // 8 + 1))()  # (8-byte aligned, as the hash needs)
        ctypes.memmove(words, hashdef.golden_input(n), n)
        if found.hash_at(ctypes.addressof(words), n) != want:
            return None
    found.seconds = time.perf_counter() - t0
    return found


def store() -> Optional[Path]:
    """Compile the serial hash with numba and store its object code for later processes (once per key).

    Called by numba's warm-up (``cpu._warm_up``), when numba is loaded anyway. Returns the file written, or
    None when a good one was there already (a damaged one is replaced). One file per key, ~20 KB; deleting
    them is always safe. The code is loaded back and checked before it is written; a file is
    written whole (a temporary file, then renamed), so a process reading at the same time sees the old
    state or the new one.
    """
    ll = _llvm()
    target = path(ll)
    if target.exists() and load() is not None:
        return None
    symbol, obj = _compile(ll)
    if _checked(_engine(ll, obj), symbol, time.perf_counter()) is None:
        raise RuntimeError("the CPU hash compiled for the cache disagrees with hashdef.GOLDEN")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"format": _FORMAT, "symbol": symbol, "sha256": hashlib.sha256(obj).hexdigest(),
                               "object": obj.hex()}))
    os.replace(tmp, target)
    return target


def _compile(ll: Any) -> Tuple[str, bytes]:
    """(symbol, object code) of :func:`_hash_at`, numba's native function alone."""
    import numba
    import numpy as np
    from numba import carray, types

    from . import cpu

    mix, key_of, tail_word, finalize, sum_words = cpu._mix, cpu._position_key, cpu._tail_word, cpu._finalize, \
        cpu._sum_words

    def _hash_at(wptr, bptr, nbytes):  # pragma: no cover - compiled
        """hashdef's hash of ``nbytes`` bytes, read as words through ``wptr`` and the tail through ``bptr``
        (the same address, typed twice: numba casts no pointer)."""
        n = nbytes // np.uint64(8)
        total = sum_words(carray(wptr, (n,)), np.uint64(0), n)
        if nbytes > n * np.uint64(8):
            total += mix(tail_word(carray(bptr, (nbytes,)), n * np.uint64(8), nbytes), key_of(n))
        return finalize(total, nbytes)

    sig = types.uint64(types.CPointer(types.uint64), types.CPointer(types.uint8), types.uint64)
    compiled = numba.njit(sig, nogil=True, no_cpython_wrapper=True, no_cfunc_wrapper=True)(_hash_at)
    result = compiled.overloads[sig.args]
    symbol = result.fndesc.llvm_func_name
    module = ll.parse_assembly(result.library.get_llvm_str())
    for value in list(module.functions) + list(module.global_variables):
        if not value.is_declaration and value.name != symbol:
            value.linkage = "internal"
    machine = result.library._codegen._tm  # numba's host target machine: the code numba itself would run
    passes = ll.ModulePassManager()
    passes.add_global_dead_code_eliminate_pass()
    passes.run(module, ll.create_pass_builder(machine, ll.create_pipeline_tuning_options()))
    return symbol, machine.emit_object(module)
