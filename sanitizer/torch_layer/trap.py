"""``trap=poison|fault``: every alias of a retired lease hits the tombstone, not the next tensor.

The guard re-points a retired lease's *storage* to poison; an alias made while the lease was fresh
(``w.numpy()``, a memoryview of it, ``torch.from_dlpack(w)``, ``torch.frombuffer``, a ctypes pointer,
a C extension's pointer) does not follow a storage, it points at the memory. So in trap mode the
memory itself moves, as Electric Fence and GWP-ASan do for heap chunks:

* **A mapping per lease.** A trap buffer's bytes are a ``memfd``; the loader writes through one
  shared mapping of it (the buffer's ``tensor``); each lease's tensor is built on a second mapping of
  the pages that hold it, its *window* (:class:`_Window`), and every alias made from the lease points
  there. Windows are ranges of *mirrors* (:class:`_Mirror`, whole mappings of the file): leases that
  share no page share a mirror, so a correct program (each lease dead before the next one over its
  pages) lends with no system call; two live leases that share a page are in two mirrors, so each has
  a mapping of its own that the other's retire never touches.
* **Retire remaps in place** (``MAP_FIXED``, atomic: no hole). ``trap=poison``: the window becomes a
  read-only private mapping of a shared poison file (``poison_byte``, 0xFF: NaN in fp16/bf16/fp32);
  ``trap=fault``: ``PROT_NONE``, and the first access from any path ends the process with one report
  (:mod:`sanitizer.core.fault_report`). The loader's writes go through the buffer's own mapping and
  never see any of this.
* **Rescue at page level.** With ``rescue=1`` a held lease's window is replaced by a private copy of
  its pages (a memfd of its own), so the tensor *and every alias* keep reading the right bytes.
* **Torch aliases the mode sees.** ``from_dlpack``/``from_numpy``/``frombuffer`` of a lease make a
  storage of their own; while a trapped lease exists the dispatch mode looks a storage it does not
  know up by address among the trapped windows (:func:`lease_at`) and reports the lease.
* **Limits.** A window's range goes back to its mirror (the file's pages mapped there again, when it
  was trapped or rescued) when its lease's storage (the last alias with it) dies. Live windows count
  against ``vm.max_map_count`` (a trapped one splits its mirror's mapping): past half of it a lend
  falls back to a plain view (the guard covers it), with one warning naming the limit and the count.

Where each part lives: this module is the buffer (what a trap buffer lends, and what it does to a
lease's pages when asked); :mod:`~sanitizer.torch_layer.trap_memory` the page mechanics on the CPU and
:mod:`~sanitizer.torch_layer.trap_cuda` on CUDA (``docs/cuda.md``); :mod:`sanitizer.features.trap_mode`
the policy (retire what is still alive, at ``RetireOrder.TRAP``) and the registration, through declared
doors (a retire hook, a buffer factory, an address look-up), at an enable that asks for trap mode. Other
features ask the lease's buffer (:func:`sanitizer.torch_layer.runtime.buffer_of`), never this module.
Memory the sanitizer allocates only (adopted loader memory is never remapped). A buffer made in trap
mode keeps it for its life.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any, Optional

import torch

from sanitizer.core import forking, pages
from sanitizer.core.ledger import Lease, ReuseEvent
from sanitizer.torch_layer import runtime, trap_memory
from sanitizer.torch_layer.staging import StagingBuffer, _index
from sanitizer.torch_layer.state import state
from sanitizer.torch_layer.trap_memory import MODES, TrapMemory, lease_at, stats

AVAILABLE = pages.AVAILABLE
UNAVAILABLE_REASON = pages.UNAVAILABLE_REASON

_MEMORY: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
"""Each trap buffer's memory by region id, for a forked child (which moves every one onto a copy)."""


class TrapStagingBuffer(StagingBuffer):
    """A :class:`StagingBuffer` whose leases live on windows of their own (``StagingBuffer(...)`` makes
    one when ``trap`` is on, for memory it allocates). It shares the plain buffer's lend tail and only
    says where a lease's view lives (:meth:`_lend_view`) and what happens to its pages."""

    def __init__(self, nbytes: int, device: Any = "cpu", name: Optional[str] = None, *, pin_memory: bool = False):
        nbytes = _index(nbytes, "nbytes")
        if nbytes < 0:
            raise ValueError(f"staging buffer size must be >= 0, got {nbytes}")
        opts = state.options
        dev = torch.device(device)
        try:
            if dev.type == "cuda":  # buffer_class checked that the driver can (virtual memory management)
                self._memory: Any = _cuda_memory(nbytes, dev, opts["trap"], opts["poison_byte"], name or "staging")
            else:
                self._memory = TrapMemory(nbytes, opts["trap"], opts["poison_byte"], name or "staging")
        except OSError as exc:  # EMFILE (a descriptor per trap buffer), ENOMEM (maps or memory): the guard's
            self._memory = None  # buffer instead, with one warning, never an error out of StagingBuffer()
            trap_memory.fall_back(f"a trap buffer could not be made ({exc})", key=f"os:{exc.errno}")
            StagingBuffer.__init__(self, nbytes, device, name, pin_memory=pin_memory)
            return
        self._setup(self._memory.data, name, owns_memory=True)
        self._memory.name = self.name
        _MEMORY[self._region.region_id] = self._memory

    # -- lending --------------------------------------------------------------------
    def _lend_view(self, data: torch.Tensor, offset: int, nbytes: int, shape: tuple, dtype: torch.dtype):
        """The view on a window of its own; a plain one past the map budget or when a mapping failed."""
        memory = self._memory
        made = memory.lend_view(offset, nbytes, tuple(shape), dtype) \
            if memory is not None and trap_memory.room() else None
        if made is None:
            return super()._lend_view(data, offset, nbytes, shape, dtype)
        trap_memory.count_window()
        view, _, window = made
        return view, window

    def _attach(self, lease: Lease, memory: Any) -> None:
        self._memory.attach(lease, memory)

    def _window(self, lease: Lease) -> Any:
        return None if self._memory is None else self._memory.window(lease)

    # -- what happens to a lease's pages ----------------------------------------------
    def lends_own_mapping(self, lease: Lease) -> bool:
        return self._window(lease) is not None

    def retire_pages(self, lease: Lease, event: ReuseEvent) -> bool:
        """Trap the lease's window in place (poison, or no access). A mapping that fails (no memory or maps
        left to split the mirror) leaves the window fresh, with one warning: the guard then re-points the
        lease's own tensor (:meth:`pages_replaced` is False)."""
        window = self._window(lease)
        if window is None or window.state != "fresh":
            return False
        try:
            self._memory.trap(lease, window, event)
        except OSError as exc:
            trap_memory.fall_back(f"a retired lease could not be trapped ({exc})", key=f"os:{exc.errno}")
            return False
        trap_memory.index_trapped(window.address, window.address + window.length, lease)
        return True

    def pages_replaced(self, lease: Lease) -> bool:
        window = self._window(lease)
        return window is not None and window.state != "fresh"

    def rescue_pages(self, lease: Lease, event: Optional[ReuseEvent] = None) -> bool:
        """A private copy of the lease's pages mapped over its window, in place (every alias keeps the
        bytes); False when it has no window, or (CUDA) no memory for the copy (the window stays fresh)."""
        window = self._window(lease)
        if window is None or window.state != "fresh":
            return False
        if self._memory.rescue(lease, window, event) is False:
            return False
        trap_memory.count_rescue(window.length)
        return True

    def _payload(self, offset: int, src: Any, nbytes: int) -> Any:
        """A lease of this buffer written back lives on its own window, at another address than the
        bytes it will be copied to: copy it out before the reuse traps that window."""
        payload = src.payload
        if isinstance(payload, torch.Tensor) and nbytes and self._memory is not None:
            lease = runtime.lease_of(payload)
            if lease is not None and lease.region_id == self._region.region_id:
                return src._replace(payload=payload.clone())
        return super()._payload(offset, src, nbytes)

    def close(self) -> None:
        super().close()
        if self._memory is not None:
            self._memory.close()


def buffer_class(args: tuple, kwargs: dict) -> Optional[type]:
    """The class ``StagingBuffer(*args, **kwargs)`` makes in trap mode (a buffer factory, declared by the
    trap feature): ours for memory the sanitizer allocates itself (CPU, not pinned; CUDA where the driver
    has virtual memory management), None otherwise (a CUDA device without it falls back to the guard,
    with one warning saying why)."""
    if not AVAILABLE or state.options.trap == "0" or not args and "nbytes" not in kwargs:
        return None
    device = args[1] if len(args) > 1 else kwargs.get("device", "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        return None  # the parent's __init__ reports the bad device
    if dev.type == "cuda":
        from sanitizer.torch_layer import trap_cuda

        why = trap_cuda.unavailable(dev)
        if why is not None:
            trap_memory.fall_back(f"CUDA staging buffers cannot be trapped on {dev} ({why})", key=f"cuda:{dev}")
            return None
        return TrapStagingBuffer
    if dev.type != "cpu" or kwargs.get("pin_memory"):
        return None
    return TrapStagingBuffer


def _cuda_memory(nbytes: int, device: torch.device, mode: str, fill: int, name: str) -> Any:
    from sanitizer.torch_layer import trap_cuda

    return trap_cuda.CudaTrapMemory(nbytes, device, mode, fill, name, trap_memory.describe)


def _before_fork() -> None:
    """(The parent.) Each trap buffer's bytes as they are at the fork, for the child (see
    ``TrapMemory.snapshot_for_fork``); one that cannot be copied (no memory or descriptor) is copied by the
    child instead."""
    for memory in list(_MEMORY.values()):
        snapshot = getattr(memory, "snapshot_for_fork", None)
        if snapshot is not None:
            try:
                snapshot()
            except OSError:
                pass


def _after_fork_in_parent() -> None:
    for memory in list(_MEMORY.values()):
        drop = getattr(memory, "drop_fork_snapshot", None)
        if drop is not None:
            drop()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)


@forking.in_child
def _after_fork() -> None:
    """A forked child moves every trap buffer's memory onto a copy (``MAP_SHARED`` survives a fork)."""
    for memory in list(_MEMORY.values()):
        try:
            memory.after_fork_in_child()
        except OSError as exc:  # no descriptor or memory left: say so, never fail the fork
            warnings.warn(f"ownership-sanitizer: trap buffer '{memory.name}' could not be copied into the forked "
                          f"child ({exc}); its writes there reach the parent's buffer", RuntimeWarning)


__all__ = ["TrapMemory", "TrapStagingBuffer", "lease_at", "stats", "buffer_class", "AVAILABLE",
           "UNAVAILABLE_REASON", "MODES"]
