"""The safetensors header, read without torch: shared by the safetensors adapter and the
reference checkpoint reader in sanitizer/testing/; and the check that a checkpoint file is whole,
so a truncated download or a git-lfs pointer is one clear line, not a traceback from deep inside a loader."""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Tuple

LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # what a clone without git-lfs leaves in place of a file


def lfs_pointer_error(path: str) -> str:
    """The one-line complaint for a git-lfs pointer at ``path``."""
    return (f"{path}: a git-lfs pointer file, not the weights (the repository was cloned without its LFS "
            f"objects): run `git lfs pull` to fetch them")


def is_lfs_pointer(path: str) -> bool:
    """Is the file at ``path`` a git-lfs pointer (a small text file) rather than the file itself?"""
    with open(path, "rb") as fh:
        return fh.read(len(LFS_POINTER)) == LFS_POINTER


def read_header(path: str) -> Tuple[Dict[str, Any], Dict[str, str], int]:
    """``(tensors, metadata, data_start)`` of the safetensors file at ``path``.

    ``tensors`` maps each name to its ``{"dtype", "shape", "data_offsets"}`` entry in
    file-header order; ``metadata`` is ``__metadata__`` (``{}`` when absent); ``data_start``
    is the offset of the data section. Raises ``ValueError`` (one line naming the path) for a
    git-lfs pointer, a file shorter than the 8-byte length prefix, a header length beyond the
    file size, or a header that is not a JSON object.
    """
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if raw == LFS_POINTER[:8] and is_lfs_pointer(path):
            raise ValueError(lfs_pointer_error(path))
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        size = os.path.getsize(path)
        if n > size:
            raise ValueError(f"{path}: truncated, or not a safetensors file: header length {n} exceeds the file "
                             f"size {size}")
        try:
            tensors = json.loads(fh.read(n))
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).split("\n")[0]
            raise ValueError(f"{path}: truncated, or not a safetensors file: the header is not JSON ({why})") \
                from None
    if not isinstance(tensors, dict):
        raise ValueError(f"{path}: not a safetensors file: the header is a JSON {type(tensors).__name__}, "
                         f"not an object")
    meta = tensors.pop("__metadata__", None) or {}
    return tensors, meta, 8 + n


def check_file(path: str) -> None:
    """Raise ``ValueError`` (one line naming the path and what is wrong) unless ``path`` is a whole
    safetensors file: its header reads (:func:`read_header`) and every tensor's bytes are in the file
    (a download or a copy cut short ends before its last tensor)."""
    tensors, _meta, start = read_header(path)
    size = os.path.getsize(path)
    end = start
    for name, spec in tensors.items():
        offsets = spec.get("data_offsets") if isinstance(spec, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise ValueError(f"{path}: not a safetensors file: tensor {name!r} has no valid data_offsets "
                             f"(got {offsets!r:.60})")
        end = max(end, start + offsets[1])
    if end > size:
        raise ValueError(f"{path}: truncated: its tensors end at byte {end}, the file has {size} bytes (a download "
                         f"or a copy cut short?)")


__all__ = ["read_header", "check_file", "is_lfs_pointer", "lfs_pointer_error", "LFS_POINTER"]
