"""Hypothesis strategies for borrowed weight streams: compose your own properties over any consumer.

``borrowed_streams()`` draws a :class:`~sanitizer.testing.streams.StreamCase`
(stream order, ring size, lifetime, quarantine, debug options, stream kind);
hypothesis shrinks a failing one towards the simplest case (layer-grouped, the
smallest ring, the ring's reuse alone, no quarantine, generations only, the
emulated ring). Turn a case into a borrowed iterator over your weights with
:func:`~sanitizer.testing.consumer_check.borrowed_stream` (or the pytest
fixture ``borrowed_weights``)::

    from hypothesis import given
    from sanitizer.testing.strategies import borrowed_streams
    from sanitizer.testing import borrowed_stream

    @given(case=borrowed_streams())
    def test_my_loader_keeps_nothing_borrowed(case):
        with borrowed_stream(STATE_DICT, case) as weights:
            model = load_weights(weights)
        ...

:func:`~sanitizer.testing.check_consumer` runs the whole property (unsanitized,
sanitized, against an owned oracle) with these strategies.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from hypothesis import strategies as st

from sanitizer.testing.streams import DEBUG, LIFETIMES, ORDERS, QUARANTINES, STREAMS, StreamCase


def _choices(name: str, given: Sequence[Any], valid: Sequence[Any]) -> Any:
    given = list(given)
    bad = [g for g in given if g not in valid]
    if not given or bad:
        raise ValueError(f"borrowed_streams: {name} must be a non-empty selection of {list(valid)}, "
                         f"got {given!r}" + (f" ({bad!r} not valid)" if bad else ""))
    return st.sampled_from(given)


def borrowed_streams(*, orders: Sequence[str] = ORDERS, streams: Sequence[str] = STREAMS,
                     lifetimes: Sequence[Optional[int]] = LIFETIMES, quarantines: Sequence[int] = QUARANTINES,
                     debug: Sequence[str] = DEBUG, ring_fraction: Any = None) -> Any:
    """A strategy of :class:`StreamCase`; each argument narrows one parameter (the defaults: all of them).

    ``lifetimes`` may hold None (a view lives until the ring reuses its bytes) and integers >= 1;
    ``quarantines`` integers >= 0; ``ring_fraction`` is a strategy of floats in [0, 1] (default: any)."""
    for life in lifetimes:
        if life is not None and (isinstance(life, bool) or not isinstance(life, int) or life < 1):
            raise ValueError(f"borrowed_streams: lifetimes must be None or integers >= 1, got {life!r}")
    for q in quarantines:
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ValueError(f"borrowed_streams: quarantines must be integers >= 0, got {q!r}")
    return st.builds(
        StreamCase,
        order=_choices("orders", orders, ORDERS),
        ring_fraction=ring_fraction if ring_fraction is not None else st.floats(0, 1),
        lifetime=st.sampled_from(list(lifetimes)) if lifetimes else _choices("lifetimes", lifetimes, LIFETIMES),
        quarantine=st.sampled_from(list(quarantines)) if quarantines else _choices("quarantines", (), QUARANTINES),
        debug=_choices("debug", debug, DEBUG),
        stream=_choices("streams", streams, STREAMS),
        seed=st.integers(0, 2**31 - 1),
    )


__all__ = ["borrowed_streams"]
