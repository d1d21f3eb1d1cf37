"""InstantTensor: ``safe_open(...).tensors()`` yields views of a device ring. CUDA only.

InstantTensor (instanttensor), read from versions 0.1.5 to 0.2.x; outside them: views unless the `safe_open` object has `copy` set true (the 0.1.9+ contract; without a `copy` attribute, the 0.1.5 one: always views), lifetime 1.

| versions | entry point | borrows when | valid until | checked |
| --- | --- | --- | --- | --- |
| 0.1.5-0.1.8 | `safe_open(files, framework, device, process_group=)`, then `tensors()` or `get_tensor(name)` in `keys()` order | always (no `copy` parameter): views of the ring (`_C.get_dl_tensor`), the ring sized so that two consecutive tensors do not overlap | the next yield (documented: "copy each tensor if you need it after the current iteration"); `__exit__` frees the ring | lifetime 1; `__exit__` ends open leases |
| 0.1.9-0.2.x | `safe_open(..., copy=False)`, then `tensors()` | `copy=False` (the default, True, yields clones that own their memory); unaligned tensors are cloned even then | the next yield; `__exit__` frees the ring | lifetime 1; `__exit__` ends open leases |

Some tensors silently fall back to owned clones (unaligned ones, with a warning from 0.2.0); they are
held to the same contract, which is what a consumer must assume. ``__exit__`` frees the ring: exiting
first ends the leases of an iterator still open, while the ring is there. 0.1.5-0.1.8's
``get_tensor(name)`` draws from an internal ``self.tensors()`` generator, so it is leased by the same
patch (lifetime 1 in ``get_tensor`` calls).
"""
from __future__ import annotations

from typing import Any

from sanitizer.adapters import lease_iterators
from sanitizer.adapters.contracts import Contract, LoaderContracts

NAME = "instanttensor"
CONTRACTS = LoaderContracts(
    loader="InstantTensor", distribution="instanttensor", low="0.1.5", high="0.3.0",
    assumed="views unless the `safe_open` object has `copy` set true (the 0.1.9+ contract; without a `copy` "
            "attribute, the 0.1.5 one: always views), lifetime 1",
    rows=(
        Contract("0.1.5-0.1.8", "`safe_open(files, framework, device, process_group=)`, then `tensors()` or "
                 "`get_tensor(name)` in `keys()` order",
                 "always (no `copy` parameter): views of the ring (`_C.get_dl_tensor`), the ring sized so that two "
                 "consecutive tensors do not overlap",
                 "the next yield (documented: \"copy each tensor if you need it after the current iteration\"); "
                 "`__exit__` frees the ring", "lifetime 1; `__exit__` ends open leases"),
        Contract("0.1.9-0.2.x", "`safe_open(..., copy=False)`, then `tensors()`",
                 "`copy=False` (the default, True, yields clones that own their memory); unaligned tensors are "
                 "cloned even then", "the next yield; `__exit__` frees the ring",
                 "lifetime 1; `__exit__` ends open leases"),
    ),
)


def wanted() -> bool:
    return True


def borrowed(handle: Any) -> bool:
    """0.1.9+: ``copy`` false. 0.1.5-0.1.8 have no ``copy`` attribute and always lend."""
    return not getattr(handle, "copy", False)


def patch(module: Any) -> None:
    lease_iterators(module.safe_open, "tensors", borrowed, NAME)
