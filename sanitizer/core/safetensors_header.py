"""The safetensors header, read without torch: shared by the safetensors adapter and the
reference checkpoint reader in sanitizer/testing/."""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Tuple


def read_header(path: str) -> Tuple[Dict[str, Any], Dict[str, str], int]:
    """``(tensors, metadata, data_start)`` of the safetensors file at ``path``.

    ``tensors`` maps each name to its ``{"dtype", "shape", "data_offsets"}`` entry in
    file-header order; ``metadata`` is ``__metadata__`` (``{}`` when absent); ``data_start``
    is the offset of the data section. Raises ``ValueError`` for a file shorter than the
    8-byte length prefix or a header length beyond the file size.
    """
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > os.path.getsize(path):
            raise ValueError(f"{path}: header length {n} exceeds the file size")
        tensors = json.loads(fh.read(n))
    meta = tensors.pop("__metadata__", None) or {}
    return tensors, meta, 8 + n


__all__ = ["read_header"]
