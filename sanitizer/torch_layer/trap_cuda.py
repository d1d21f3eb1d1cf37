"""Trap mode on CUDA: a lease on a virtual alias of its own, retired in place (see :mod:`cuda_hooks.vmm`).

The CPU trap (:mod:`sanitizer.torch_layer.trap`) maps a memfd's pages once more per lease; here the
same is done with the driver's virtual memory management, at the device's allocation granularity:

* the buffer is one physical allocation (``cuMemCreate``) mapped at a virtual range where the loader
  writes (``data``);
* a lend reserves a virtual range for the lease and maps onto it the granules of the physical
  allocation that hold the lease (no copy: the same bytes at a second address); the lease's tensor,
  and every alias made from it (DLPack, CuPy, a raw pointer), points there;
* a retire waits for the device (work queued before the reuse may still read the lease, correctly),
  then unmaps the alias and maps a shared read-only poison granule at each of its granules
  (``trap=poison``: reads give ``poison_byte``, NaN in fp16/bf16/fp32), or leaves it reserved with
  nothing mapped (``trap=fault``: the next access is an illegal address, which ends the CUDA context:
  run under ``compute-sanitizer`` to see which kernel); the loader keeps writing through ``data``;
* a rescue maps a private copy of the lease's granules at the alias instead, so every alias keeps
  reading the rescued bytes.

Unmapping needs the device idle over that range, and a lease's storage may die while a kernel that
reads it is still queued: a dead alias goes to a graveyard, emptied after the next device wait (every
retire that traps waits anyway), or after one of its own when the graveyard is full. Costs: a lend
makes three driver calls and reserves whole granules of virtual space (no physical memory); a rescue
copies whole granules; one poison granule per device and fill. ``docs/cuda.md`` has the figures.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from cuda_hooks import devices, vmm
from sanitizer.core import fault_report
from sanitizer.torch_layer.aliasing import device_region
from sanitizer.torch_layer.trap_windows import WindowsByLease

MAX_GRAVEYARD = 64  # dead aliases kept mapped until a device wait lets them go


class _Graveyard:
    """Dead aliases (address, length) waiting for a device wait before they are unmapped and freed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: List[Tuple[int, int, int]] = []  # (address, length, device)

    def bury(self, address: int, length: int, device: int) -> None:
        with self._lock:
            self._dead.append((address, length, device))
            full = len(self._dead) >= MAX_GRAVEYARD
        if full:
            self.empty(wait=True)

    def empty(self, wait: bool) -> int:
        """Unmap and free every dead alias (after waiting for their devices when ``wait``); how many."""
        with self._lock:
            dead, self._dead = self._dead, []
        if not dead:
            return 0
        if wait:
            for device in sorted({d for _, _, d in dead}):
                torch.cuda.synchronize(device)
        drv = vmm.driver()
        for address, length, _ in dead:
            try:
                drv.unmap(address, length)
            except vmm.VmmError:
                pass  # already unmapped (a fault-mode alias has nothing mapped)
            try:
                drv.free(address, length)
            except vmm.VmmError:
                pass
        return len(dead)

    def __len__(self) -> int:
        return len(self._dead)


GRAVEYARD = _Graveyard()


class CudaWindow:
    """One lease's virtual alias of the granules that hold it. States: fresh, trapped, rescued."""

    __slots__ = ("address", "length", "offset", "device", "state", "__weakref__")

    def __init__(self, address: int, length: int, offset: int, device: int):
        self.address, self.length, self.offset, self.device = address, length, offset, device
        self.state = "fresh"

    def __del__(self) -> None:  # may run in the GC, on any thread: bookkeeping, then the graveyard
        try:
            _on_window_death(self.address)
            GRAVEYARD.bury(self.address, self.length, self.device)
        except Exception:  # interpreter shutdown: the process's address space goes with it
            pass


class _Writer:
    """The buffer's own virtual range (the loader writes here); buried when its last view dies."""

    __slots__ = ("address", "length", "device", "__weakref__")

    def __init__(self, address: int, length: int, device: int):
        self.address, self.length, self.device = address, length, device

    def __del__(self) -> None:
        try:
            GRAVEYARD.bury(self.address, self.length, self.device)
        except Exception:
            pass


_on_window_death: Any = lambda address: None  # set by trap.py: forget the window's address index entry


class _Poison:
    """One physical granule per (device, fill), filled once, mapped read-only at every trapped granule."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: Dict[Tuple[int, int], int] = {}

    def handle(self, device: int, fill: int, granule: int) -> int:
        with self._lock:
            h = self._handles.get((device, fill))
            if h is None:
                drv = vmm.driver()
                h = drv.create(granule, device)
                at = drv.reserve(granule, granule, device)
                try:
                    drv.map(at, granule, h, 0)
                    drv.set_access(at, granule, device, True)
                    drv.memset(at, fill, granule, device)
                    drv.unmap(at, granule)
                finally:
                    drv.free(at, granule)
                self._handles[(device, fill)] = h
            return h


POISON = _Poison()


def unavailable(device: torch.device) -> Optional[str]:
    """None when trap mode can cover a CUDA buffer on ``device``, else why not (one line)."""
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return vmm.driver().unavailable(index)
    except Exception as exc:  # no CUDA, or a driver that cannot even be asked: say so, never fail the buffer
        return f"the CUDA driver could not be asked ({exc})"


class CudaTrapMemory(WindowsByLease):
    """A CUDA trap buffer's memory: the physical allocation, the loader's range, the aliases lent."""

    def __init__(self, nbytes: int, device: torch.device, mode: str, fill: int, name: str,
                 describe: Callable[[Any, Any, str], str]):
        self.mode, self.fill, self.name = mode, fill, name
        self.describe = describe  # the fault report's text of a lease (trap.py renders it, as for the CPU)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.index)
        drv = vmm.driver()
        self.granule = drv.granularity(self.index)
        self.length = vmm.round_up(nbytes, self.granule)
        self._handle: Optional[int] = drv.create(self.length, self.index)
        self._release = weakref.finalize(self, _release, self._handle)
        address = drv.reserve(self.length, self.granule, self.index)
        drv.map(address, self.length, self._handle, 0)
        drv.set_access(address, self.length, self.index, True)
        writer = _Writer(address, self.length, self.index)
        self.data = devices.from_interface(device_region(writer, address, self.length), self.device)[:nbytes]
        super().__init__()
        self._waited_for: Any = None  # the reuse event this memory last waited for the device at

    def close(self) -> None:
        """No more lends: the physical handle goes (the mappings keep the memory)."""
        self._handle = None
        self._release()

    def lend_view(self, offset: int, nbytes: int, shape: tuple, dtype: torch.dtype
                  ) -> Optional[Tuple[torch.Tensor, Any, CudaWindow]]:
        """``(tensor, piece, window)`` of a lease on an alias of its own; None when it cannot have one."""
        if self._handle is None or nbytes == 0:
            return None
        g = self.granule
        first = offset // g * g
        length = vmm.round_up(offset + nbytes, g) - first
        drv = vmm.driver()
        address = drv.reserve(length, g, self.index)
        try:
            drv.map(address, length, self._handle, first)
            drv.set_access(address, length, self.index, True)
        except BaseException:
            try:
                drv.unmap(address, length)
            except vmm.VmmError:
                pass
            drv.free(address, length)
            raise
        window = CudaWindow(address, length, first, self.index)
        piece = device_region(window, address + offset - first, nbytes)
        view = devices.from_interface(piece, self.device).view(dtype).view(shape)
        return view, piece, window

    def _wait(self, event: Any) -> None:
        """Once per reuse: let the work queued before it finish (it may read the lease, rightly), and the
        graveyard go with it."""
        if self._waited_for is not event:
            torch.cuda.synchronize(self.index)
            GRAVEYARD.empty(wait=False)
            self._waited_for = event

    def trap(self, lease: Any, window: CudaWindow, event: Any) -> None:
        """Unmap the alias, then map poison (read-only) or nothing there."""
        self._wait(event)
        drv = vmm.driver()
        drv.unmap(window.address, window.length)
        if self.mode == "poison":
            h = POISON.handle(self.index, self.fill, self.granule)
            for at in vmm.ranges(window.length, self.granule):
                drv.map(window.address + at, self.granule, h, 0)
            drv.set_access(window.address, window.length, self.index, False)
        else:  # the range stays reserved with nothing mapped: a device access is an illegal address; a host
            # read through a raw pointer (unified addressing) faults, and the host report says which lease
            fault_report.install()
            fault_report.add(window.address, window.address + window.length, self.describe(lease, event, self.name))
        window.state = "trapped"

    def rescue(self, lease: Any, window: CudaWindow, event: Any = None) -> None:
        """Map a private copy of the alias's granules in its place (before the reuse writes)."""
        self._wait(event)
        drv = vmm.driver()
        h = drv.create(window.length, self.index)
        try:
            scratch = drv.reserve(window.length, self.granule, self.index)
            try:
                drv.map(scratch, window.length, h, 0)
                drv.set_access(scratch, window.length, self.index, True)
                drv.copy(scratch, window.address, window.length, self.index)
                drv.unmap(scratch, window.length)
            finally:
                drv.free(scratch, window.length)
            drv.unmap(window.address, window.length)
            drv.map(window.address, window.length, h, 0)
            drv.set_access(window.address, window.length, self.index, True)
        finally:
            drv.release(h)  # the alias's mapping keeps the copy alive
        window.state = "rescued"

    def after_fork_in_child(self) -> None:
        """Nothing: CUDA cannot be used in a forked child (the parent's mappings are not the child's)."""


def reset_device_state() -> None:
    """Forget the poison allocations and let the graveyard go (a test harness's fresh start; the driver
    they belong to is about to be replaced)."""
    GRAVEYARD.empty(wait=False)
    with POISON._lock:
        POISON._handles.clear()


def _release(handle: int) -> None:
    try:
        vmm.driver().release(handle)
    except Exception:  # shutdown, or a driver already gone
        pass


__all__ = ["CudaTrapMemory", "CudaWindow", "GRAVEYARD", "POISON", "unavailable", "MAX_GRAVEYARD",
           "reset_device_state"]
