"""safetensors: emulated borrowing for a loader that owns its tensors.

``safe_open`` hands out tensors that are safe to retain, so nothing is wrong
with a consumer that keeps them. To test that consumer against the borrowed
contract anyway (before pointing it at fastsafetensors, runai or InstantTensor)
its tensors are served through a :class:`~sanitizer.torch_layer.ring.StagingRing`:

* :func:`iterate` yields ``(name, view)`` for every tensor of some files;
* with ``OWNERSHIP_SANITIZE=1`` and option ``safetensors_ring=N`` (bytes), the
  import hook makes ``safe_open(...).get_tensor`` return ring views (freed at
  the ``with`` block's end). ``safetensors.torch.load_file`` keeps returning
  owned tensors: its contract is a whole-checkpoint dict, not a stream.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Iterable, Iterator, Optional, Sequence, Tuple, Union

import torch

from sanitizer.core.safetensors_header import read_header
from sanitizer.torch_layer import runtime
from sanitizer.torch_layer.iterators import EmulatedBorrowing, emulate_borrowed
from sanitizer.torch_layer.ring import StagingRing
from sanitizer.adapters import replace

NAME = "safetensors"
_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")
_bypass = threading.local()
_original_safe_open: Any = None


def wanted() -> bool:
    return runtime.state.options["safetensors_ring"] > 0


def _safe_open() -> Any:
    if _original_safe_open is not None:
        return _original_safe_open
    from safetensors import safe_open

    return getattr(safe_open, "_ownsan_original", safe_open)


def header(path: str) -> dict:
    """The safetensors JSON header of ``path`` (tensor name -> dtype, shape, data_offsets)."""
    return read_header(path)[0]


def largest_tensor_bytes(paths: Sequence[str]) -> int:
    sizes = [v["data_offsets"][1] - v["data_offsets"][0] for p in paths for v in header(p).values()]
    return max(sizes, default=0)


def _tensors(paths: Sequence[str], device: str) -> Iterator[Tuple[str, torch.Tensor]]:
    safe_open = _safe_open()
    for path in paths:
        with safe_open(path, framework="pt", device=device) as f:
            keys = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
            for name in keys:
                yield name, f.get_tensor(name)


def iterate(paths: Union[str, Iterable[str]], ring_bytes: Optional[int] = None, *, device: str = "cpu",
            lifetime: Optional[int] = None) -> EmulatedBorrowing:
    """Every tensor of ``paths`` (file order), as views of a staging ring of ``ring_bytes``.

    ``ring_bytes`` defaults to the largest tensor: the strictest ring, where
    almost every advance reuses the previous tensor's bytes.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if ring_bytes is None:
        ring_bytes = max(largest_tensor_bytes(paths), 1)
    return emulate_borrowed(_tensors(paths, device), ring_bytes, lifetime=lifetime, name=NAME)


class EmulatedSafeOpen:
    """``safe_open`` whose ``get_tensor`` lends views of a staging ring (option ``safetensors_ring``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if getattr(_bypass, "on", False):
            return _safe_open()(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        self._inner = _safe_open()(*args, **kwargs)
        framework = kwargs.get("framework", args[1] if len(args) > 1 else None)
        filename = kwargs.get("filename", args[0] if args else "?")
        self._emulate = framework in _TORCH_FRAMEWORKS
        self._label = f"{NAME}:{os.path.basename(os.fspath(filename))}"
        self._ring: Optional[StagingRing] = None

    def get_tensor(self, name: str) -> Any:
        tensor = self._inner.get_tensor(name)
        if not (self._emulate and runtime.state.enabled):
            return tensor
        ring_bytes = runtime.state.options["safetensors_ring"]
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > ring_bytes:
            raise ValueError(f"{self._label}: tensor '{name}' ({nbytes} bytes) does not fit the emulation ring "
                             f"of safetensors_ring={ring_bytes} bytes; raise the option to >= the largest tensor")
        if self._ring is None or self._ring.buffer.closed:
            self._ring = StagingRing(ring_bytes, device=tensor.device, name=self._label)
        return self._ring.put(name, tensor)

    def close(self) -> None:
        """Free the ring: every view still held goes stale (the borrowed loader's end of iteration)."""
        if self._ring is not None:
            self._ring.close()
            self._ring = None

    def __enter__(self) -> "EmulatedSafeOpen":
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self.close()
        return self._inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _owned_loads(load_file: Any) -> Any:
    @functools.wraps(load_file)
    def load_file_owned(*args: Any, **kwargs: Any) -> Any:
        _bypass.on = True
        try:
            return load_file(*args, **kwargs)
        finally:
            _bypass.on = False

    return load_file_owned


def patch(module: Any) -> None:
    global _original_safe_open
    _original_safe_open = module.safe_open
    EmulatedSafeOpen._ownsan_original = module.safe_open  # type: ignore[attr-defined]
    import safetensors.torch as st_torch  # its `from safetensors import safe_open` may predate the patch

    replace(module, "safe_open", EmulatedSafeOpen)
    replace(st_torch, "safe_open", EmulatedSafeOpen)
    replace(st_torch, "load_file", _owned_loads(st_torch.load_file))


__all__ = ["iterate", "header", "largest_tensor_bytes", "EmulatedSafeOpen", "patch", "wanted"]
