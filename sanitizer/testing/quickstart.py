"""The core scenario: a loader lends a view, reuses its bytes, a consumer reads it late.

Run: ``python examples/quickstart.py`` (or ``python -m sanitizer.testing.quickstart``;
``ownsan demo`` runs it where the end-to-end demo is not installed). It shows, in order:
  1. without the sanitizer, the retained view silently reads the next tensor's bytes;
  2. with the sanitizer, the same read raises StaleBorrowError with the full report;
  3. with ``halt_on_error=0``, the error is recorded and the JSON report lists it.
"""
from __future__ import annotations

import json
import sys

import torch

import sanitizer


def load_two_weights(buf: sanitizer.StagingBuffer):
    """A loader that reuses the same staging bytes for consecutive tensors, as fast loaders do."""
    gate = torch.full((256, 128), 1.0, dtype=torch.bfloat16)
    up = torch.full((256, 128), 2.0, dtype=torch.bfloat16)
    w = buf.write(0, gate, name="layers.0.mlp.gate_proj.weight")
    kept = w.t()[:, :64]  # a consumer keeps a derived view instead of copying
    buf.write(0, up, name="layers.0.mlp.up_proj.weight")  # the loader moves on: same bytes
    return kept


def main() -> int:
    buf = sanitizer.StagingBuffer(1 << 20, device="cpu", name="ring0")

    print("1. unsanitized: the retained view of gate_proj (all 1.0) now reads", end=" ")
    kept = load_two_weights(buf)
    print(f"{kept.float().mean().item():.1f}  <- up_proj's bytes, silently")

    print("\n2. sanitized: the same read raises at once\n")
    kept = load_two_weights(buf)
    with sanitizer.sanitize():
        try:
            kept.sum()
        except sanitizer.StaleBorrowError as err:
            print(err)
            print(f"\n   (err.lease.name = {err.lease.name!r}, err.event.by = {err.event.by!r}, err.op = {err.op!r})")

    print("\n3. halt_on_error=0: recorded, not raised; sanitizer.report() has it")
    sanitizer.clear_errors()
    kept = load_two_weights(buf)
    with sanitizer.sanitize(halt_on_error=0):
        kept.sum()
        kept.float().mean()
    rep = sanitizer.report()
    print(f"   error_count={rep['error_count']}; first: {rep['errors'][0]['summary']}")
    print("   report keys:", json.dumps(sorted(rep)))

    print("\n4. after close, a retained view is a use-after-free report, never a segfault:")
    last = buf.write(0, torch.ones(4, 4), name="lm_head.weight")
    buf.close()
    with sanitizer.sanitize():
        try:
            last.clone()
        except sanitizer.StaleBorrowError as err:
            print("  ", err.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
