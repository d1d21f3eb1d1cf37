"""runai-model-streamer: ``SafetensorsStreamer.get_tensors()`` yields views of a reused CPU buffer.

runai-model-streamer (runai-model-streamer), read from versions 0.15.0 to 0.17.x; outside them: the 0.17 contract where `stream_files` takes `owned=` (views unless `owned=True`), else the 0.15 one (always views), lifetime 1.

| versions | entry point | borrows when | valid until | checked |
| --- | --- | --- | --- | --- |
| 0.15.x-0.16.x | `SafetensorsStreamer.stream_files(paths, device=, is_distributed=)` (or `stream_file`), then `get_tensors()` | always (no `owned=`): `torch.from_numpy` views of one numpy buffer sized by `RUNAI_STREAMER_MEMORY_LIMIT`; distributed streaming lends views of its broadcast buffers; a device destination without it gets `tensor.to(device)` copies | the next request (the buffer is refilled from offset 0 once the request's chunks are all yielded: with a limit of one tensor, every advance) | lifetime 1; the streamer's `__exit__` ends open leases |
| 0.17.x | `stream_files(..., owned=False)` (or `stream_file`), then `get_tensors()` | `owned=False` (the default, True, gives tensors the caller owns); unaligned tensors are cloned even then, and held to the same contract, as a consumer must assume | the next advance (documented: "each must be consumed before the iteration advances"); the slot pool is reused as it comes round | lifetime 1; `__exit__` ends open leases |

A yield is judged borrowed per stream, from what ``stream_files`` was asked and did: on 0.17 and later
``owned=False``; before 0.17, always; in both cases except a device destination without distributed
streaming (``file_streamer.is_distributed`` False), whose tensors are ``tensor.to(device)`` copies.
``stream_file`` (one path) goes through ``stream_files``. Exiting the streamer ends the leases of an
iterator still open, with every check, while the buffer is still there.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from sanitizer.adapters import lease_iterators, replace
from sanitizer.adapters.contracts import Contract, LoaderContracts

NAME = "runai-model-streamer"
CONTRACTS = LoaderContracts(
    loader="runai-model-streamer", distribution="runai-model-streamer", low="0.15.0", high="0.18.0",
    assumed="the 0.17 contract where `stream_files` takes `owned=` (views unless `owned=True`), else the 0.15 one "
            "(always views), lifetime 1",
    rows=(
        Contract("0.15.x-0.16.x", "`SafetensorsStreamer.stream_files(paths, device=, is_distributed=)` (or "
                 "`stream_file`), then `get_tensors()`",
                 "always (no `owned=`): `torch.from_numpy` views of one numpy buffer sized by "
                 "`RUNAI_STREAMER_MEMORY_LIMIT`; distributed streaming lends views of its broadcast buffers; a "
                 "device destination without it gets `tensor.to(device)` copies",
                 "the next request (the buffer is refilled from offset 0 once the request's chunks are all yielded: "
                 "with a limit of one tensor, every advance)", "lifetime 1; the streamer's `__exit__` ends open "
                 "leases"),
        Contract("0.17.x", "`stream_files(..., owned=False)` (or `stream_file`), then `get_tensors()`",
                 "`owned=False` (the default, True, gives tensors the caller owns); unaligned tensors are cloned "
                 "even then, and held to the same contract, as a consumer must assume",
                 "the next advance (documented: \"each must be consumed before the iteration advances\"); the slot "
                 "pool is reused as it comes round", "lifetime 1; `__exit__` ends open leases"),
    ),
    matrix=("0.15.7", "0.16.1", "0.17.1"),
)


def wanted() -> bool:
    return True


def borrowed(streamer: Any) -> bool:
    """Does the last ``stream_files`` of ``streamer`` lend views? (see the module docstring)"""
    if not getattr(streamer, "_ownsan_lends", False):
        return False
    device = getattr(streamer, "_ownsan_device", "cpu") or "cpu"
    return str(device) == "cpu" or bool(getattr(getattr(streamer, "file_streamer", None), "is_distributed", False))


def patch(module: Any) -> None:
    cls = module.SafetensorsStreamer
    stream_files = cls.stream_files
    signature = inspect.signature(stream_files)
    has_owned = "owned" in signature.parameters  # 0.17+; before it, every stream lends

    @functools.wraps(stream_files)
    def patched_stream_files(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        self._ownsan_lends = bound.arguments.get("owned", True) is False if has_owned else True
        self._ownsan_device = bound.arguments.get("device", "cpu")
        return stream_files(self, *args, **kwargs)

    replace(cls, "stream_files", patched_stream_files)
    lease_iterators(cls, "get_tensors", borrowed, NAME)
