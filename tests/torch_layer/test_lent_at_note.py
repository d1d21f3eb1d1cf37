"""Issue 51 item 4: a lend made before ``sanitize()`` keeps only its call site (the sanitizer off keeps one
frame), and the report showed that one frame as if it were the whole stack. It now says why it is short."""
from __future__ import annotations

import pytest
import torch

import sanitizer


def _load(buf):
    buf.write(0, torch.ones(4))
    return buf.lend(0, (4,), torch.float32)


def _stale_text(lend_inside: bool) -> str:
    buf = sanitizer.StagingBuffer(256)
    if not lend_inside:
        view = _load(buf)
    with sanitizer.sanitize(stack_depth=8):
        if lend_inside:
            view = _load(buf)
        buf.write(0, torch.zeros(4))
        with pytest.raises(sanitizer.StaleBorrowError) as caught:
            float(view.sum())
    return str(caught.value)


def test_a_lend_before_the_sanitizer_was_on_says_its_stack_was_cut():
    text = _stale_text(lend_inside=False)
    lent = text[text.index("lent at"):text.index("reused at")]
    assert "#0 _load" in lent and "#1" not in lent
    assert "1 frame: the lend happened while the sanitizer was off" in lent


def test_a_lend_while_on_keeps_its_callers_and_says_nothing_more():
    text = _stale_text(lend_inside=True)
    lent = text[text.index("lent at"):text.index("reused at")]
    assert "#1 " in lent and "sanitizer was off" not in lent
