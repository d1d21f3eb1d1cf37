"""Adapters: put the named loaders' borrowing entry points under lease tracking, on import.

:func:`install_import_hooks` (called by the zero-code activation when
``OWNERSHIP_SANITIZE=1``) patches each loader right after the loader's module
executes, through a ``sys.meta_path`` finder, or at once when it is already
imported. Nothing here is imported, and nothing is installed, while the
sanitizer is off. The patches check ``enabled()`` per call, so a loader used
after ``disable()`` runs untouched.

Each adapter states, per loader version, which entry points lend borrowed
memory, under which arguments, and until when (its ``CONTRACTS``, rendered in
its docstring and in ``docs/loaders.md``; see :mod:`sanitizer.adapters.contracts`).
When a loader's installed version lies outside the versions its adapter was
read from, one ``RuntimeWarning`` line names the version and what is assumed;
an API the adapter cannot patch at all is reported the same way and left to
run unsanitized, never broken.

============================  =====================================================  ===========================
loader                        entry points patched                                   lifetime
============================  =====================================================  ===========================
fastsafetensors 0.2-0.5       ``FilesBufferOnDevice`` getters and ``close``;         until ``fb.close()``;
                              ``ParallelLoader.iterate_weights`` (0.5, borrowed)     1 advance
runai-model-streamer 0.15-17  ``SafetensorsStreamer.stream_files``/``get_tensors``   1 advance
InstantTensor 0.1.5-0.2       ``safe_open.tensors`` (and 0.1.x ``get_tensor``)       1 advance, CUDA only
safetensors                   ``safe_open`` ``get_tensor``/``get_slice``/...         emulated (``safetensors_ring``)
============================  =====================================================  ===========================
"""
from __future__ import annotations

import importlib
import sys
import threading
import warnings
from typing import Any, Dict, List, Optional, Tuple

from sanitizer.core import post_import

# module name -> adapter module (relative); the adapter's patch(module) runs after the module executes
TARGETS: Dict[str, str] = {
    "fastsafetensors.file_buffer": "fastsafetensors_adapter",
    "fastsafetensors.parallel_loader": "fastsafetensors_adapter",
    "runai_model_streamer.safetensors_streamer.safetensors_streamer": "runai_adapter",
    "instanttensor._impl": "instanttensor_adapter",
    "safetensors": "safetensors_adapter",
}

_MISSING = object()
_lock = threading.RLock()
_patches: List[Tuple[Any, str, Any]] = []  # (owner, attribute, original), for uninstall
_patched_modules: List[str] = []
_versions_seen: Dict[str, Optional[str]] = {}  # loader -> version found at its first patch
_finder: Optional["_PostImportFinder"] = None


def replace(owner: Any, attribute: str, new: Any) -> None:
    """Set ``owner.attribute = new``, remembering the original for :func:`uninstall_import_hooks`."""
    with _lock:
        original = owner.__dict__.get(attribute, _MISSING) if isinstance(owner, type) else getattr(owner, attribute)
        _patches.append((owner, attribute, original))
        setattr(owner, attribute, new)


def _adapter(target: str):
    return importlib.import_module(f"{__name__}.{TARGETS[target]}")


def _patch(target: str, module: Any) -> None:
    """Patch ``module``; a loader version the adapter does not know is reported, never broken."""
    with _lock:
        if target in _patched_modules:
            return
        adapter = _adapter(target)
        if not adapter.wanted():
            return
        contracts = getattr(adapter, "CONTRACTS", None)
        version = _version_of(target, module, contracts)
        try:
            adapter.patch(module)
        except Exception as exc:
            warnings.warn(f"ownership-sanitizer: could not wrap {target} "
                          f"(version {version or 'unknown'}): {type(exc).__name__}: {exc}; it runs unsanitized",
                          RuntimeWarning, stacklevel=2)
            return
        _patched_modules.append(target)
        if contracts is not None and contracts.loader not in _versions_seen:
            _versions_seen[contracts.loader] = version
            message = contracts.warning(version)
            if message:
                warnings.warn(message, RuntimeWarning, stacklevel=2)


def _version_of(target: str, module: Any = None, contracts: Any = None) -> Optional[str]:
    from sanitizer.adapters.contracts import installed_version

    distribution = contracts.distribution if contracts is not None else target.split(".")[0].replace("_", "-")
    return installed_version(module if module is not None else sys.modules.get(target), distribution)


def versions() -> Dict[str, Optional[str]]:
    """loader -> the version its adapter found when it patched it (for reports and ``ownsan doctor``)."""
    with _lock:
        return dict(_versions_seen)


class _PostImportFinder:
    """Finds nothing itself: for a target module it asks the other finders, and has the adapter patch the
    module right after it executes (the loader wrapper shared with the start-up hook's finder)."""

    def __init__(self, targets: Dict[str, str]):
        self._targets = targets
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in self._targets or post_import.asking(self._busy, fullname):
            return None
        spec = post_import.spec_from_others(self, self._busy, fullname, path, target)
        return post_import.wrap(spec, lambda module: _patch(fullname, module))


def install_import_hooks() -> List[str]:
    """Patch the loaders already imported and hook the others' import. Idempotent.

    Returns the target modules patched so far (the others get patched when imported).
    """
    global _finder
    with _lock:
        for target in TARGETS:
            module = sys.modules.get(target)
            if module is not None:
                _patch(target, module)
        if _finder is None:
            _finder = _PostImportFinder(TARGETS)
            sys.meta_path.insert(0, _finder)
        return list(_patched_modules)


def uninstall_import_hooks() -> None:
    """Restore every patched attribute and remove the finder (for tests and for ``disable`` at will)."""
    global _finder
    with _lock:
        while _patches:
            owner, attribute, original = _patches.pop()
            if original is _MISSING:
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, original)
        _patched_modules.clear()
        _versions_seen.clear()
        if _finder is not None:
            post_import.remove(_finder)
            _finder = None


def patched() -> List[str]:
    """The target modules whose entry points are patched now."""
    with _lock:
        return list(_patched_modules)


def track_open(owner: Any, iterator: Any) -> Any:
    """Remember ``iterator`` on the loader object, so the loader's close/exit can end its leases first."""
    import weakref

    refs = owner.__dict__.setdefault("_ownsan_iterators", [])
    refs[:] = [r for r in refs if r() is not None]
    refs.append(weakref.ref(iterator))
    return iterator


def close_open(owner: Any) -> None:
    """Close the tracked iterators of ``owner`` (their leases end while the loader's memory is still there)."""
    for ref in owner.__dict__.pop("_ownsan_iterators", []):
        iterator = ref()
        if iterator is not None:
            iterator.close()


def lease_iterators(cls: Any, method: str, borrowed: Any, name: str) -> None:
    """Patch ``cls.method`` (which returns a ``(name, tensor)`` iterator) and ``cls.__exit__``.

    While the sanitizer is enabled and ``borrowed(self)`` says the loader lends
    its views, the iterator is wrapped by ``borrowed_iterator(lifetime=1)``;
    ``__exit__`` then ends those leases before the loader frees its memory.
    """
    import functools

    from sanitizer.torch_layer.iterators import borrowed_iterator
    from sanitizer.torch_layer.state import state

    original, exit_ = getattr(cls, method), cls.__exit__

    @functools.wraps(original)
    def patched_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        iterator = original(self, *args, **kwargs)
        if state.enabled and borrowed(self):
            return track_open(self, borrowed_iterator(iterator, lifetime=1, name=name))
        return iterator

    @functools.wraps(exit_)
    def patched_exit(self: Any, *exc: Any) -> Any:
        close_open(self)
        return exit_(self, *exc)

    replace(cls, method, patched_method)
    replace(cls, "__exit__", patched_exit)


__all__ = ["install_import_hooks", "uninstall_import_hooks", "patched", "versions", "replace", "track_open",
           "close_open", "lease_iterators", "TARGETS"]
