"""The weights a consumer check streams: a state dict, safetensors files, or a directory of them.

:meth:`WeightSet.of` reads them once into owned, contiguous tensors (the
*sources*): every example then streams those through a fresh borrowed ring,
and the oracle is built from clones of them, so no file is read, and none
written, per example. A ``.safetensors`` file is read with
``safetensors.torch.load_file``; a ``.pt``/``.pth``/``.bin`` file with
``torch.load(weights_only=True)``. A directory gives its ``*.safetensors``
files, or when it has none its ``*.bin``/``*.pt``/``*.pth`` files, sorted by
name (``model-00001-of-00002.safetensors`` first). Names keep the order the
files give (a safetensors file's own order is its data offsets).
"""
from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from sanitizer.testing.streams import StreamCase, order_names, ring_bytes

_TORCH_FILES = (".bin", ".pt", ".pth")
_ALL_FILES = (".safetensors",) + _TORCH_FILES


class WeightSet:
    """Owned copies of a checkpoint's tensors, in the checkpoint's order, with where they came from."""

    def __init__(self, tensors: Dict[str, torch.Tensor], paths: Sequence[str] = ()):
        if not tensors:
            raise ValueError("check_consumer: the weights hold no tensor")
        self.tensors = tensors
        self.names = list(tensors)
        self.paths = list(paths)  # the files read (empty for a state dict)
        self.sizes = [t.numel() * t.element_size() for t in tensors.values()]
        self.largest = max(self.sizes)
        self.nbytes = sum(self.sizes)

    @classmethod
    def of(cls, weights: Any) -> "WeightSet":
        """Read ``weights``: a mapping of names to tensors, ``(name, tensor)`` pairs, a file, a directory, or
        a list of files. Errors name the problem and the value."""
        if isinstance(weights, WeightSet):
            return weights
        if isinstance(weights, (str, os.PathLike)):
            return cls._from_files(_files_of(os.fspath(weights)))
        if isinstance(weights, Mapping):
            return cls(_owned(weights.items()))
        if isinstance(weights, (list, tuple)) and weights and all(isinstance(w, (str, os.PathLike)) for w in weights):
            files: List[str] = []
            for w in weights:
                files.extend(_files_of(os.fspath(w)))
            return cls._from_files(files)
        if isinstance(weights, (list, tuple)) and all(isinstance(w, tuple) and len(w) == 2 for w in weights):
            return cls(_owned(weights))
        raise TypeError(f"check_consumer: weights must be a state dict, (name, tensor) pairs, a safetensors file, a "
                        f"directory or a list of files; got {type(weights).__name__}: {weights!r:.100}")

    @classmethod
    def _from_files(cls, files: List[str]) -> "WeightSet":
        tensors: Dict[str, torch.Tensor] = {}
        where: Dict[str, str] = {}
        for path in files:
            for name, t in _read_file(path):
                if name in tensors:
                    raise ValueError(f"check_consumer: tensor {name!r} is in both {where[name]!r} and {path!r}")
                tensors[name] = t
                where[name] = path
        return cls(_owned(tensors.items()), files)

    def describe(self) -> str:
        from sanitizer.core.units import format_bytes

        what = f"{len(self.names)} tensors, {format_bytes(self.nbytes)}"
        if not self.paths:
            return f"a state dict ({what})"
        where = os.path.dirname(self.paths[0])
        shown = self.paths[0] if len(self.paths) == 1 else f"{len(self.paths)} files in {where}"
        return f"{shown} ({what})"

    def order(self, case: StreamCase) -> List[str]:
        return order_names(self.names, case.order, case.seed)

    def ring(self, case: StreamCase) -> int:
        return ring_bytes(self.sizes, case.ring_fraction, case.stream, case.lifetime)

    def items(self, names: Iterable[str]) -> List[Tuple[str, torch.Tensor]]:
        """The sources in ``names``' order (never hand these to a consumer: they are the oracle's too)."""
        return [(n, self.tensors[n]) for n in names]

    def owned_copies(self, names: Iterable[str]) -> List[Tuple[str, torch.Tensor]]:
        """Fresh owned copies in ``names``' order: what the oracle's consumer reads (it may keep or write them)."""
        return [(n, self.tensors[n].clone()) for n in names]


def _owned(items: Iterable[Tuple[Any, Any]]) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for name, t in items:
        if not isinstance(name, str):
            raise TypeError(f"check_consumer: weight names must be strings, got {type(name).__name__} {name!r:.60}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"check_consumer: weight {name!r} is a {type(t).__name__}, not a tensor")
        if t.layout is not torch.strided or t.is_meta:
            raise ValueError(f"check_consumer: weight {name!r} is a {'meta' if t.is_meta else str(t.layout)[6:]} "
                             f"tensor; a stream lends dense bytes")
        if name in out:
            raise ValueError(f"check_consumer: weight {name!r} appears twice")
        out[name] = t.detach().clone(memory_format=torch.contiguous_format)
    return out


def _files_of(path: str) -> List[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"check_consumer: weights path {path!r} does not exist")
    if not os.path.isdir(path):
        return [path]
    names = sorted(os.listdir(path))
    for kinds in ((".safetensors",), _TORCH_FILES):
        found = [os.path.join(path, n) for n in names if n.endswith(kinds)]
        if found:
            return found
    raise FileNotFoundError(f"check_consumer: directory {path!r} has no weight files "
                            f"({', '.join('*' + k for k in _ALL_FILES)})")


def _read_file(path: str) -> List[Tuple[str, torch.Tensor]]:
    """The tensors of one file. A file that is not whole (a git-lfs pointer, a truncated download) is a
    ``ValueError`` naming the path and what is wrong, checked before the loader sees it: a traceback from
    deep inside safetensors or torch.load reads, in CI, as the consumer having failed."""
    from sanitizer.core.safetensors_header import check_file, is_lfs_pointer, lfs_pointer_error

    if is_lfs_pointer(path):
        raise ValueError(f"check_consumer: {lfs_pointer_error(path)}")
    if path.endswith(_TORCH_FILES):
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
            first = str(exc).strip().split("\n")[0][:120]
            raise ValueError(f"check_consumer: {path}: cannot read it as a torch.save file, truncated or not one "
                             f"({type(exc).__name__}: {first})") from None
        if not isinstance(loaded, Mapping):
            raise TypeError(f"check_consumer: {path!r} holds a {type(loaded).__name__}, not a state dict")
        return list(loaded.items())
    if not path.endswith(".safetensors"):
        raise ValueError(f"check_consumer: {path!r} is not a weight file (expected "
                         f"{', '.join('*' + k for k in _ALL_FILES)})")
    try:
        from safetensors import safe_open
    except ImportError:  # pragma: no cover - the fuzz and test extras install it
        raise ImportError(f"check_consumer: reading {path!r} needs safetensors: "
                          f"pip install 'ownership-sanitizer[fuzz]'") from None
    try:
        check_file(path)
    except ValueError as exc:
        raise ValueError(f"check_consumer: {exc}") from None
    try:
        with safe_open(path, framework="pt") as f:  # in the file's own order (data offsets)
            return [(name, f.get_tensor(name)) for name in _file_order(path, list(f.keys()))]
    except Exception as exc:  # safetensors' own SafetensorError (not a ValueError): what check_file cannot see
        if type(exc).__name__ != "SafetensorError":
            raise
        raise ValueError(f"check_consumer: {path}: not a valid safetensors file ({exc})") from None


def _file_order(path: str, names: List[str]) -> List[str]:
    """``names`` in the order of their bytes in the file (``keys()`` is sorted by name)."""
    from sanitizer.core.safetensors_header import read_header

    header, _meta, _start = read_header(path)
    offset = {n: spec["data_offsets"][0] for n, spec in header.items() if n != "__metadata__"}
    return sorted(names, key=lambda n: (offset.get(n, 0), n))


def describe_source(weights: Any) -> Optional[str]:
    """The weights as a command-line value (a path, or paths joined by commas), None for a state dict."""
    if isinstance(weights, (str, os.PathLike)):
        return os.fspath(weights)
    if isinstance(weights, WeightSet) and weights.paths:
        return ",".join(weights.paths) if len(weights.paths) > 1 else weights.paths[0]
    if isinstance(weights, (list, tuple)) and weights and all(isinstance(w, (str, os.PathLike)) for w in weights):
        return ",".join(os.fspath(w) for w in weights)
    return None


__all__ = ["WeightSet", "describe_source"]
