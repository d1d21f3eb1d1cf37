"""fastsafetensors: the file buffer's zero-copy views, and ParallelLoader's borrowed mode.

fastsafetensors (fastsafetensors), read from versions 0.2.0 to 0.5.x; outside them: the 0.5 contract (a file buffer lends views when it has no `borrowed_tensors` attribute or has it set, a ParallelLoader with `borrowed_tensors=True` lends for one advance).

| versions | entry point | borrows when | valid until | checked |
| --- | --- | --- | --- | --- |
| 0.2.x-0.4.x | `SafeTensorsFileLoader.copy_files_to_device()` -> `FilesBufferOnDevice.get_tensor`, `get_sharded`, `get_tensor_wrapped`, `get_sharded_wrapped`, `push_tensor`, `as_dict`; `fastsafe_open.get_tensor` | single-process group (`pg.size() == 1`): a zero-copy view of the file's buffer (multi-rank results, and `device=`/`dtype=` conversions, are copies) | `fb.close()` (`free_dev_ptrs`: `cpu_free` / the CUDA caching allocator); `fastsafe_open.__exit__` | a lease per view, ended by `fb.close()` before the buffer is freed |
| 0.2.x | `ParallelLoader.iterate_weights()` | single-process group: yields `fb.get_tensor` views | the batch's `fb.close()`, once the iterator moves past the batch's last tensor | the file buffer's leases (row above) |
| 0.3.x-0.4.x | `ParallelLoader.iterate_weights()` | never (single-process yields are clones; multi-rank ones copies) | - | nothing to check (the inner views it clones are leased and dropped) |
| 0.5.x | `copy_files_to_device(borrowed_tensors=True)` -> `get_tensor`, `get_sharded`, `get_tensor_wrapped`, `get_sharded_wrapped`, `push_tensor`, `as_dict`, `iter_local_tensors` | `borrowed_tensors=True` (the default, False, gives tensors that share ownership of the buffer and stay valid) | `fb.close()` | a lease per view, ended by `fb.close()` |
| 0.5.x | `ParallelLoader(..., borrowed_tensors=True, accumulate_resident=False).iterate_weights()` | `borrowed_tensors=True` (default: clones) | the next advance (documented: "complete all use before advancing or closing the iterator") | lifetime 1, then the batch's `fb.close()` |

Which results are borrowed is decided per call by address: a result whose bytes lie in one of the
file buffer's device buffers (``LazyTensorFactory.gbuf``) is a view of it; a copy (another rank's
broadcast, a ``dtype=`` conversion, a concatenation) lies elsewhere and is left alone. With
``borrowed_tensors=False`` on 0.5, views of the buffer share its ownership and are left alone too.
Borrowed views are leased by a :class:`~sanitizer.torch_layer.iterators.BorrowedLoans` kept on the
buffer object; ``close()`` ends them (verified, rescued, tomb-stoned as the options say) while the
bytes are still there, then frees.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Iterator, List, Optional, Tuple

import torch

from sanitizer.adapters import replace
from sanitizer.adapters.contracts import Contract, LoaderContracts
from sanitizer.torch_layer.aliasing import byte_extent
from sanitizer.torch_layer.iterators import BorrowedLoans, borrowed_iterator
from sanitizer.torch_layer.state import state

NAME = "fastsafetensors"
_LOW_LEVEL = ("`FilesBufferOnDevice.get_tensor`, `get_sharded`, `get_tensor_wrapped`, `get_sharded_wrapped`, "
              "`push_tensor`, `as_dict`")
CONTRACTS = LoaderContracts(
    loader="fastsafetensors", distribution="fastsafetensors", low="0.2.0", high="0.6.0",
    assumed="the 0.5 contract (a file buffer lends views when it has no `borrowed_tensors` attribute or has it "
            "set, a ParallelLoader with `borrowed_tensors=True` lends for one advance)",
    rows=(
        Contract("0.2.x-0.4.x", f"`SafeTensorsFileLoader.copy_files_to_device()` -> {_LOW_LEVEL}; "
                 "`fastsafe_open.get_tensor`",
                 "single-process group (`pg.size() == 1`): a zero-copy view of the file's buffer (multi-rank "
                 "results, and `device=`/`dtype=` conversions, are copies)",
                 "`fb.close()` (`free_dev_ptrs`: `cpu_free` / the CUDA caching allocator); `fastsafe_open.__exit__`",
                 "a lease per view, ended by `fb.close()` before the buffer is freed"),
        Contract("0.2.x", "`ParallelLoader.iterate_weights()`", "single-process group: yields `fb.get_tensor` views",
                 "the batch's `fb.close()`, once the iterator moves past the batch's last tensor",
                 "the file buffer's leases (row above)"),
        Contract("0.3.x-0.4.x", "`ParallelLoader.iterate_weights()`",
                 "never (single-process yields are clones; multi-rank ones copies)", "-",
                 "nothing to check (the inner views it clones are leased and dropped)"),
        Contract("0.5.x", "`copy_files_to_device(borrowed_tensors=True)` -> `get_tensor`, `get_sharded`, "
                 "`get_tensor_wrapped`, `get_sharded_wrapped`, `push_tensor`, `as_dict`, `iter_local_tensors`",
                 "`borrowed_tensors=True` (the default, False, gives tensors that share ownership of the buffer "
                 "and stay valid)", "`fb.close()`", "a lease per view, ended by `fb.close()`"),
        Contract("0.5.x", "`ParallelLoader(..., borrowed_tensors=True, accumulate_resident=False).iterate_weights()`",
                 "`borrowed_tensors=True` (default: clones)",
                 "the next advance (documented: \"complete all use before advancing or closing the iterator\")",
                 "lifetime 1, then the batch's `fb.close()`"),
    ),
    matrix=("0.2.2", "0.3.3", "0.4.0", "0.5.0"),
)
_LOANS = "_ownsan_loans"
_inside = threading.local()  # depth of patched file-buffer calls on this thread: only the outermost lends


def wanted() -> bool:
    return True


def _buffer_spans(fb: Any) -> List[Tuple[int, int]]:
    """``[start, end)`` address of every device buffer the file buffer holds (its factories' ``gbuf``)."""
    spans = []
    for factories in getattr(fb, "rank_loaders", {}).values():
        for factory in factories:
            gbuf = getattr(factory, "gbuf", None)
            try:
                base, length = gbuf.get_base_address(), gbuf.get_length()
            except Exception:
                continue
            if base and length:
                spans.append((base, base + length))
    return spans


def lends(fb: Any) -> bool:
    """Does this file buffer hand out borrowed views? 0.2-0.4 always (no ``borrowed_tensors``); 0.5 when set."""
    return bool(getattr(fb, "borrowed_tensors", True))


def _loans(fb: Any, device: Any, spans: List[Tuple[int, int]]) -> BorrowedLoans:
    """The file buffer's loans: one region per device buffer (its tensors are DLPack exports, a storage each)."""
    loans = fb.__dict__.get(_LOANS)
    if loans is None or loans.closed:
        loans = fb.__dict__[_LOANS] = BorrowedLoans(f"{NAME}:file-buffer")
        for start, end in spans:
            try:
                loans.adopt(device, start, end - start)
            except (ValueError, RuntimeError, TypeError):
                pass  # a buffer we cannot alias: its tensors get a region each instead
    return loans


def _lend(fb: Any, name: Any, tensor: Any, spans: Optional[List[Tuple[int, int]]] = None) -> Any:
    """``tensor`` as a lease when it is a view of ``fb``'s buffers; as it is otherwise (a copy)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
        return tensor
    address, nbytes = byte_extent(tensor)
    if not nbytes:
        return tensor
    spans = spans if spans is not None else _buffer_spans(fb)
    for start, end in spans:
        if start <= address and address + nbytes <= end:
            return _loans(fb, tensor.device, spans).lend(name, tensor)
    return tensor


def _rewrap(wrapper: Any, raw: Any) -> Any:
    """A fastsafetensors ``TorchTensor`` (a dataclass around ``real_tensor``) around the lease."""
    if raw is getattr(wrapper, "real_tensor", None):
        return wrapper
    return dataclasses.replace(wrapper, real_tensor=raw)


def _active(fb: Any) -> bool:
    return state.enabled and lends(fb) and getattr(_inside, "depth", 0) == 1


def _outermost(method: Any) -> Any:
    """Count nesting so that ``get_tensor`` -> ``get_tensor_wrapped`` -> ``get_sharded_wrapped`` lends once."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _inside.depth -= 1
    return wrapper


def _patch_file_buffer(cls: Any) -> None:
    def raw_getter(attr: str) -> None:  # get_tensor, get_sharded, push_tensor: (name, ...) -> raw tensor
        original = getattr(cls, attr)

        @_outermost
        @functools.wraps(original)
        def patched(self: Any, tensor_name: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, tensor_name, *args, **kwargs)
            return _lend(self, tensor_name, out) if out is not None and _active(self) else out

        replace(cls, attr, patched)

    def wrapped_getter(attr: str) -> None:  # get_tensor_wrapped, get_sharded_wrapped: -> TorchTensor
        original = getattr(cls, attr)

        @_outermost
        @functools.wraps(original)
        def patched(self: Any, tensor_name: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, tensor_name, *args, **kwargs)
            if out is None or not _active(self) or not hasattr(out, "real_tensor"):
                return out
            return _rewrap(out, _lend(self, tensor_name, out.real_tensor))

        replace(cls, attr, patched)

    for attr in ("get_tensor", "get_sharded", "push_tensor"):
        if hasattr(cls, attr):
            raw_getter(attr)
    for attr in ("get_tensor_wrapped", "get_sharded_wrapped"):
        if hasattr(cls, attr):
            wrapped_getter(attr)

    if hasattr(cls, "as_dict"):
        as_dict = cls.as_dict

        @_outermost
        @functools.wraps(as_dict)
        def patched_as_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = as_dict(self, *args, **kwargs)
            if not _active(self):
                return out
            spans = _buffer_spans(self)
            return {k: (_rewrap(v, _lend(self, k, v.real_tensor, spans)) if hasattr(v, "real_tensor") else v)
                    for k, v in out.items()}

        replace(cls, "as_dict", patched_as_dict)

    if hasattr(cls, "iter_local_tensors"):  # 0.5: the borrowed ParallelLoader's own path
        iter_local = cls.iter_local_tensors

        @functools.wraps(iter_local)
        def patched_iter_local(self: Any, *args: Any, **kwargs: Any) -> Iterator:
            spans = None
            for name, tensor in iter_local(self, *args, **kwargs):
                if state.enabled and lends(self):
                    spans = spans if spans is not None else _buffer_spans(self)
                    tensor = _lend(self, name, tensor, spans)
                yield name, tensor

        replace(cls, "iter_local_tensors", patched_iter_local)

    close = cls.close

    @functools.wraps(close)
    def patched_close(self: Any, *args: Any, **kwargs: Any) -> Any:
        loans = self.__dict__.pop(_LOANS, None)
        if loans is not None:
            loans.close()  # every lease ends, checked, while the buffer is still there
        return close(self, *args, **kwargs)

    replace(cls, "close", patched_close)


def _patch_parallel_loader(cls: Any) -> None:
    """0.5 ``borrowed_tensors=True``: the documented lifetime 1 on top of the file buffer's leases."""
    original = cls.iterate_weights

    @functools.wraps(original)
    def iterate_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        iterator = original(self, *args, **kwargs)
        if getattr(self, "borrowed_tensors", False) and state.enabled:
            return borrowed_iterator(iterator, lifetime=1, name=NAME)
        return iterator

    replace(cls, "iterate_weights", iterate_weights)


def patch(module: Any) -> None:
    """``module`` is ``fastsafetensors.file_buffer`` or ``fastsafetensors.parallel_loader``."""
    if hasattr(module, "FilesBufferOnDevice") and module.__name__.endswith("file_buffer"):
        _patch_file_buffer(module.FilesBufferOnDevice)
    if hasattr(module, "PipelineParallel"):  # ParallelLoader subclasses it
        _patch_parallel_loader(module.PipelineParallel)
    elif module.__name__.endswith("parallel_loader"):
        raise AttributeError(f"{module.__name__} has no PipelineParallel")
