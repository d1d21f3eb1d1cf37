"""Trap mode on CUDA: a lease on a virtual alias of its own, retired in place (see :mod:`cuda_hooks.vmm`).

The CPU trap (:mod:`sanitizer.torch_layer.trap`) maps a memfd's pages once more per lease; here the
same is done with the driver's virtual memory management, at the device's allocation granularity:

* the buffer is one physical allocation *per granule* (``cuMemCreate``), mapped side by side at offset
  0 at a virtual range where the loader writes (``data``): ``cuMemMap``'s offset "currently must be
  zero" (cuda.h), so a lease past the first granule could not be mapped out of one big allocation;
* a lend reserves a virtual range for the lease and maps onto it, granule by granule, the allocations
  that hold the lease (no copy: the same bytes at a second address); the lease's tensor, and every
  alias made from it (DLPack, CuPy, a raw pointer), points there; every device that can access the
  owner's memory as a peer gets access too, so a peer's copy from a lease does not fault;
* a retire waits for the devices that can reach the alias (work queued before the reuse may still read
  the lease, correctly), then unmaps it and maps a shared read-only poison granule at each of its
  granules (read-write where the device refuses read-only: an alias never stays without access)
  (``trap=poison``: reads give ``poison_byte``, NaN in fp16/bf16/fp32), or leaves it reserved with
  nothing mapped (``trap=fault``: the next access is an illegal address, which ends the CUDA context:
  run under ``compute-sanitizer`` to see which kernel); the loader keeps writing through ``data``;
* a rescue maps a private copy of the lease's granules at the alias instead, so every alias keeps
  reading the rescued bytes.

Graph capture: a synchronisation, an unmap or a driver call that may synchronise would invalidate the
user's capture, so a lend during one gets a plain view (the guard's), and a retire or rescue during one
keeps the old mapping alive and is queued (:func:`flush_deferred`), done at the first trap-mode call
outside the capture. Unmapping needs the device idle over that range, and a lease's storage may die
while a kernel that reads it is still queued: a dead alias goes to a graveyard, emptied per device after
a wait on every device that could reach it (a wait never lets another device's aliases go). Nothing
here synchronises from ``__del__``. ``cuMemCreate`` out of memory empties torch's cache and retries
once, then falls back to the guard with one warning; a lost context (``CUDA_ERROR_ILLEGAL_ADDRESS``)
is always raised. ``docs/cuda.md`` has the figures.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from cuda_hooks import devices, vmm
from sanitizer.core import fault_report
from sanitizer.torch_layer import graph_capture, trap_memory
from sanitizer.torch_layer.aliasing import device_region
from sanitizer.torch_layer.trap_windows import WindowsByLease

MAX_GRAVEYARD = 64  # dead aliases kept mapped until a device wait lets them go

Mapped = List[Tuple[int, int]]  # (address, size) of each mapping made on a range, one per granule


# -- the driver calls, each error path releasing what it took -----------------------------------------------
def _unmap(drv: vmm.Driver, mapped: Mapped) -> None:
    """Unmap every mapping (one ``cuMemUnmap`` each: a call "cannot unmap a sub-range", nor span two)."""
    for address, size in mapped:
        drv.unmap(address, size)


def _map_granules(drv: vmm.Driver, address: int, handles: Sequence[int], granule: int, access: Sequence[int],
                  writable: bool = True) -> Mapped:
    """Map one granule allocation after the other at ``address`` (offset 0 each), then grant ``access``.
    On any failure the mappings made are unmapped again before the error goes on (the caller frees the
    reservation)."""
    mapped: Mapped = []
    try:
        for i, handle in enumerate(handles):
            drv.map(address + i * granule, granule, handle, 0)
            mapped.append((address + i * granule, granule))
        drv.set_access(address, len(handles) * granule, access, writable)
    except BaseException:
        _unmap(drv, mapped)
        raise
    return mapped


def _release_all(handles: Sequence[int]) -> None:
    drv = vmm.driver()
    for handle in handles:
        drv.release(handle)


def _release_finally(handles: Sequence[int]) -> None:
    """The buffer's handles at its close or death (a finalizer: the driver may be gone, at shutdown or
    after a test harness replaced it; the mappings keep the memory anyway)."""
    try:
        _release_all(handles)
    except Exception:
        pass


def _create_granules(count: int, granule: int, device: int) -> List[int]:
    """``count`` physical allocations of one granule on ``device``. Out of memory (torch's cache holds the
    GPU): ``torch.cuda.empty_cache()`` and one retry, then :class:`vmm.OutOfMemory`; nothing is kept
    from a failed try."""
    for attempt in (0, 1):
        drv = vmm.driver()
        made: List[int] = []
        try:
            for _ in range(count):
                made.append(drv.create(granule, device))
            return made
        except vmm.OutOfMemory:
            _release_all(made)
            if attempt:
                raise
            torch.cuda.empty_cache()
        except BaseException:
            _release_all(made)
            raise
    raise AssertionError("unreachable")


def _access_devices(index: int) -> Tuple[int, ...]:
    """The owner first, then every device that can access its memory as a peer: a peer GPU's copy into or
    read of a lease must not fault (``cuMemSetAccess`` grants access per device)."""
    peers = []
    for d in range(torch.cuda.device_count()):
        if d != index and torch.cuda.can_device_access_peer(d, index):
            peers.append(d)
    return (index, *peers)


def _capturing(index: int) -> bool:
    """Is a graph being captured on the current stream of the current device or of ``index``? Then no
    synchronisation, unmap or map may run (the capture would be invalidated)."""
    return graph_capture.capturing() or graph_capture.capturing(torch.device("cuda", index))


def _fall_back(why: str, key: str) -> None:
    """One warning per kind of reason, counted with trap mode's other fallbacks (the guard covers the lease)."""
    trap_memory.fall_back(why, key=key)



# -- the graveyard --------------------------------------------------------------------------------------------
class _Dead:
    """A dead range: its reservation, what is mapped on it, and the devices that could reach it, with the
    number of waits each had when it died (it goes once each has been waited for since)."""

    __slots__ = ("address", "length", "mapped", "devices", "epochs")

    def __init__(self, address: int, length: int, mapped: Mapped, devices: Sequence[int], epochs: Dict[int, int]):
        self.address, self.length, self.mapped, self.devices = address, length, list(mapped), tuple(devices)
        self.epochs = {d: epochs.get(d, 0) for d in self.devices}


class _Graveyard:
    """Dead aliases waiting for a wait on each device that could reach them before they are unmapped and
    freed. Burying makes no device call (it runs in ``__del__``, on any thread, maybe during a capture)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: List[_Dead] = []
        self._epochs: Dict[int, int] = {}  # device -> host waits for it so far

    def bury(self, address: int, length: int, mapped: Mapped, devices: Sequence[int]) -> None:
        with self._lock:
            self._dead.append(_Dead(address, length, mapped, devices, self._epochs))

    def waited(self, devices: Sequence[int]) -> None:
        """The host just waited for each of ``devices``: work queued on them before is done."""
        with self._lock:
            for d in devices:
                self._epochs[d] = self._epochs.get(d, 0) + 1

    def empty(self) -> int:
        """Unmap and free the dead that every device able to reach them has been waited for since; how many.
        A lost context is raised; any other failure leaves that range (a leak, never a fault)."""
        with self._lock:
            ready = [d for d in self._dead if all(self._epochs.get(k, 0) > e for k, e in d.epochs.items())]
            self._dead = [d for d in self._dead if d not in ready]
        drv = vmm.driver()
        for dead in ready:
            try:
                _unmap(drv, dead.mapped)
                drv.free(dead.address, dead.length)
            except vmm.ContextLost:
                raise
            except vmm.VmmError as exc:
                _fall_back(f"a dead alias could not be unmapped ({exc})", key="graveyard")
        return len(ready)

    def collect_if_full(self, capturing: bool) -> None:
        """When ``MAX_GRAVEYARD`` are waiting (never during a capture): :meth:`collect`."""
        if len(self._dead) >= MAX_GRAVEYARD and not capturing:
            self.collect()

    def collect(self) -> int:
        """Wait for every device a dead alias could be reached from, then empty (never during a capture,
        never from ``__del__``); how many went."""
        with self._lock:
            wanted = sorted({k for d in self._dead for k in d.devices})
        for d in wanted:
            torch.cuda.synchronize(d)
        self.waited(wanted)
        return self.empty()

    def forget(self) -> None:
        """Drop every entry without a driver call (the driver they belong to is being replaced)."""
        with self._lock:
            self._dead = []
            self._epochs = {}

    def __len__(self) -> int:
        return len(self._dead)


GRAVEYARD = _Graveyard()


class CudaWindow:
    """One lease's virtual alias of the granules that hold it. States: fresh, deferred (retired during a
    capture, still mapped), trapped, rescued."""

    __slots__ = ("address", "length", "offset", "device", "state", "mapped", "access", "__weakref__")

    def __init__(self, address: int, length: int, offset: int, device: int, mapped: Mapped,
                 access: Sequence[int]):
        self.address, self.length, self.offset, self.device = address, length, offset, device
        self.mapped, self.access = mapped, tuple(access)
        self.state = "fresh"

    def __del__(self) -> None:  # may run in the GC, on any thread: bookkeeping, then the graveyard (no device call)
        try:
            trap_memory.window_died(self.address)  # out of the address index and the count
            GRAVEYARD.bury(self.address, self.length, self.mapped, self.access)
        except Exception:  # interpreter shutdown: the process's address space goes with it
            pass


class _Writer:
    """The buffer's own virtual range (the loader writes here); buried when its last view dies."""

    __slots__ = ("address", "length", "mapped", "access", "__weakref__")

    def __init__(self, address: int, length: int, mapped: Mapped, access: Sequence[int]):
        self.address, self.length, self.mapped, self.access = address, length, mapped, tuple(access)

    def __del__(self) -> None:
        try:
            GRAVEYARD.bury(self.address, self.length, self.mapped, self.access)
        except Exception:
            pass


class _Poison:
    """One physical granule per (device, fill), filled once, mapped read-only at every trapped granule
    (read-write on a device that refuses read-only mappings: remembered per device)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: Dict[Tuple[int, int], int] = {}
        self.read_only: Dict[int, bool] = {}  # device -> does cuMemSetAccess accept PROT_READ there?

    def handle(self, device: int, fill: int, granule: int) -> int:
        """The poison granule (made on first use; :class:`vmm.OutOfMemory` after a retry)."""
        with self._lock:
            h = self._handles.get((device, fill))
            if h is None:
                h = self._fill(_create_granules(1, granule, device)[0], device, fill, granule)
                self._handles[(device, fill)] = h
            return h

    @staticmethod
    def _fill(h: int, device: int, fill: int, granule: int) -> int:
        drv = vmm.driver()
        try:
            at = drv.reserve(granule, granule, device)
            try:
                mapped = _map_granules(drv, at, [h], granule, [device])
                try:
                    drv.memset(at, fill, granule, device)
                finally:
                    _unmap(drv, mapped)
            finally:
                drv.free(at, granule)
        except BaseException:
            drv.release(h)
            raise
        return h

    def grant(self, drv: vmm.Driver, address: int, length: int, access: Sequence[int], device: int) -> None:
        """Read-only access for ``access`` to a poison-mapped range; read-write where the device refused
        read-only (a stale write then lands in the poison granule: never a live tensor's bytes)."""
        if self.read_only.get(device, True):
            try:
                drv.set_access(address, length, access, False)
                self.read_only[device] = True
                return
            except vmm.ContextLost:
                raise
            except vmm.VmmError:
                self.read_only[device] = False
        drv.set_access(address, length, access, True)


POISON = _Poison()


def unavailable(device: torch.device) -> Optional[str]:
    """None when trap mode can cover a CUDA buffer on ``device``, else why not (one line)."""
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return vmm.driver().unavailable(index)
    except vmm.ContextLost:
        raise  # a lost context is never a reason to fall back quietly
    except Exception as exc:  # no CUDA, or a driver that cannot even be asked: say so, never fail the buffer
        return f"the CUDA driver could not be asked ({exc})"


# -- retires that came during a capture ------------------------------------------------------------------------
_DEFERRED: List[Tuple[str, "CudaTrapMemory", Any, CudaWindow, Any]] = []
_deferred_lock = threading.Lock()


def flush_deferred() -> int:
    """Do the device work of the retires and rescues queued during a graph capture (their windows kept the
    lease's mapping meanwhile); how many. Nothing while this thread still captures."""
    with _deferred_lock:
        if not _DEFERRED:
            return 0
        indices = {m.index for _, m, _, _, _ in _DEFERRED}
    if any(_capturing(i) for i in indices):
        return 0
    with _deferred_lock:
        work, _DEFERRED[:] = list(_DEFERRED), []
    for kind, memory, lease, window, event in work:
        if kind == "trap":
            memory._trap_now(lease, window, event)
        else:
            memory._rescue_now(lease, window, event)
    return len(work)


def _defer(kind: str, memory: "CudaTrapMemory", lease: Any, window: CudaWindow, event: Any) -> None:
    graph_capture.skipped(f"{'trapping' if kind == 'trap' else 'rescuing'} '{getattr(lease, 'name', '?')}' "
                          f"(done after the capture)")
    window.state = "deferred"
    with _deferred_lock:
        _DEFERRED.append((kind, memory, lease, window, event))


class CudaTrapMemory(WindowsByLease):
    """A CUDA trap buffer's memory: a physical allocation per granule, the loader's range, the aliases lent."""

    def __init__(self, nbytes: int, device: torch.device, mode: str, fill: int, name: str,
                 describe: Callable[[Any, Any, str], str]):
        self.mode, self.fill, self.name = mode, fill, name
        self.describe = describe  # the fault report's text of a lease (trap.py renders it, as for the CPU)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        super().__init__()
        self._waited_for: Any = None  # the reuse event this memory last waited for the devices at
        self._handles: Optional[List[int]] = None
        drv = vmm.driver()
        self.granule = drv.granularity(self.index)
        self.length = vmm.round_up(nbytes, self.granule)
        self.access = _access_devices(self.index)
        why = "a graph capture is under way" if _capturing(self.index) else None
        if why is None:
            flush_deferred()
            try:
                self._handles = _create_granules(self.length // self.granule, self.granule, self.index)
            except vmm.OutOfMemory as exc:
                why = f"cuMemCreate is out of memory on cuda:{self.index} after emptying torch's cache ({exc})"
        if self._handles is None:  # ordinary memory, lends get plain views: the guard covers them
            _fall_back(f"CUDA staging buffer '{name}' cannot be trapped: {why}", key=f"cuda-oom:{self.index}")
            self.data = devices.empty(nbytes, self.device)
            return
        self._release = weakref.finalize(self, _release_finally, list(self._handles))
        self.data = self._map_writer(drv, nbytes)

    def _map_writer(self, drv: vmm.Driver, nbytes: int) -> torch.Tensor:
        """The loader's range: every granule mapped in order, read-write for the owner and its peers."""
        address = drv.reserve(self.length, self.granule, self.index)
        try:
            mapped = _map_granules(drv, address, self._handles or [], self.granule, self.access)
        except BaseException:
            drv.free(address, self.length)
            self.close()
            raise
        writer = _Writer(address, self.length, mapped, self.access)
        return devices.from_interface(device_region(writer, address, self.length), self.device)[:nbytes]

    def close(self) -> None:
        """No more lends: the physical handles go (the mappings keep the memory)."""
        if self._handles is not None:
            self._handles = None
            self._release()

    def lend_view(self, offset: int, nbytes: int, shape: tuple, dtype: torch.dtype
                  ) -> Optional[Tuple[torch.Tensor, Any, CudaWindow]]:
        """``(tensor, piece, window)`` of a lease on an alias of its own; None when it cannot have one (no
        memory of its own, a capture under way, out of virtual memory)."""
        if self._handles is None or nbytes == 0:
            return None
        capturing = _capturing(self.index)
        if capturing:
            graph_capture.skipped("mapping a trap alias for a lease lent during the capture")
            return None
        flush_deferred()
        GRAVEYARD.collect_if_full(capturing)
        g = self.granule
        first, end = offset // g, -(-(offset + nbytes) // g)
        try:
            address, mapped = self._alias(self._handles[first:end])
        except vmm.OutOfMemory as exc:
            _fall_back(f"a lease alias could not be reserved or mapped ({exc})", key=f"cuda-oom:{self.index}")
            return None
        window = CudaWindow(address, (end - first) * g, first * g, self.index, mapped, self.access)
        piece = device_region(window, address + offset - first * g, nbytes)
        view = devices.from_interface(piece, self.device).view(dtype).view(shape)
        return view, piece, window

    def _alias(self, handles: Sequence[int]) -> Tuple[int, Mapped]:
        """A reservation with ``handles`` mapped on it in order; a failure frees the reservation."""
        drv = vmm.driver()
        length = len(handles) * self.granule
        address = drv.reserve(length, self.granule, self.index)
        try:
            return address, _map_granules(drv, address, handles, self.granule, self.access)
        except BaseException:
            drv.free(address, length)
            raise

    def _wait(self, event: Any) -> None:
        """Once per reuse: let the work queued before it on every device that can reach the buffer finish
        (it may read the lease, rightly); then the dead aliases those waits cover go."""
        if self._waited_for is not event:
            for d in self.access:
                torch.cuda.synchronize(d)
            GRAVEYARD.waited(self.access)
            self._waited_for = event
        GRAVEYARD.empty()

    def trap(self, lease: Any, window: CudaWindow, event: Any) -> None:
        """Unmap the alias, then map poison (read-only) or nothing there; during a capture, later."""
        if _capturing(self.index):
            _defer("trap", self, lease, window, event)
            return
        flush_deferred()
        self._trap_now(lease, window, event)

    def _trap_now(self, lease: Any, window: CudaWindow, event: Any) -> None:
        poison = None
        if self.mode == "poison":
            try:  # before anything is unmapped: out of memory leaves the alias as it is, for the guard
                poison = POISON.handle(self.index, self.fill, self.granule)
            except vmm.OutOfMemory as exc:
                _fall_back(f"the poison granule could not be allocated on cuda:{self.index} ({exc})",
                           key=f"cuda-oom:{self.index}")
                window.state = "fresh"
                return
        self._wait(event)
        drv = vmm.driver()
        _unmap(drv, window.mapped)
        window.mapped = []
        if poison is not None:
            window.mapped = _map_granules_only(drv, window.address, window.length, self.granule, poison)
            POISON.grant(drv, window.address, window.length, window.access, self.index)
        else:  # the range stays reserved with nothing mapped: a device access is an illegal address; a host
            # read through a raw pointer (unified addressing) faults, and the host report says which lease
            fault_report.install()
            fault_report.add(window.address, window.address + window.length, self.describe(lease, event, self.name))
        window.state = "trapped"

    def rescue(self, lease: Any, window: CudaWindow, event: Any = None) -> bool:
        """Map a private copy of the alias's granules in its place (before the reuse writes); during a
        capture, later (the captured writes have not run yet). False: no memory for the copy (one warning;
        the window is left as it was)."""
        if _capturing(self.index):
            _defer("rescue", self, lease, window, event)
            return True
        flush_deferred()
        return self._rescue_now(lease, window, event)

    def _rescue_now(self, lease: Any, window: CudaWindow, event: Any) -> bool:
        g = self.granule
        try:
            handles = _create_granules(window.length // g, g, self.index)
        except vmm.OutOfMemory as exc:
            _fall_back(f"a rescue copy could not be allocated on cuda:{self.index} ({exc})",
                       key=f"cuda-oom:{self.index}")
            window.state = "fresh"
            return False
        self._wait(event)
        drv = vmm.driver()
        try:
            scratch = drv.reserve(window.length, g, self.index)
            try:
                mapped = _map_granules(drv, scratch, handles, g, [self.index])
                try:
                    drv.copy(scratch, window.address, window.length, self.index)
                finally:
                    _unmap(drv, mapped)
            finally:
                drv.free(scratch, window.length)
            _unmap(drv, window.mapped)
            window.mapped = []
            window.mapped = _map_granules(drv, window.address, handles, g, window.access)
        finally:
            _release_all(handles)  # the alias's mappings keep the copy alive
        window.state = "rescued"
        return True

    def after_fork_in_child(self) -> None:
        """Nothing: CUDA cannot be used in a forked child (the parent's mappings are not the child's)."""


def _map_granules_only(drv: vmm.Driver, address: int, length: int, granule: int, handle: int) -> Mapped:
    """Map one granule allocation at every granule of a range (no access yet); undone on failure."""
    mapped: Mapped = []
    try:
        for at in vmm.ranges(length, granule):
            drv.map(address + at, granule, handle, 0)
            mapped.append((address + at, granule))
    except BaseException:
        _unmap(drv, mapped)
        raise
    return mapped


def reset_device_state() -> None:
    """Forget the poison allocations, the graveyard and the deferred retires, without a driver call (a test
    harness's fresh start; the driver they belong to is about to be replaced)."""
    GRAVEYARD.forget()
    with _deferred_lock:
        _DEFERRED.clear()
    with POISON._lock:
        POISON._handles.clear()
        POISON.read_only.clear()


__all__ = ["CudaTrapMemory", "CudaWindow", "GRAVEYARD", "POISON", "unavailable", "MAX_GRAVEYARD",
           "reset_device_state", "flush_deferred"]
