"""The core scenario: a loader lends a view, reuses its bytes, a consumer reads it late.

Run ``python examples/quickstart.py``: 1. unsanitized, the kept view silently reads the next tensor's bytes;
2. sanitized, the same read raises StaleBorrowError, naming who kept the view and the line to fix; 3. with
``halt_on_error=0`` it is recorded, not raised, and ``sanitizer.report()`` lists it; 4. after the buffer is
closed, a read is a use-after-free report, never a segfault. Under ``ownsan run -- python examples/quickstart.py``
(or ``OWNERSHIP_SANITIZE=1``) the sanitizer is on before the program starts: it says so, and each step says
what that sanitizer did (ownsan run's ``triage=1`` records every late read and raises none).
"""
import contextlib
import sys

import torch

import sanitizer

ON_FROM_START = sanitizer.enabled()  # ownsan run / OWNERSHIP_SANITIZE=1 turned it on before this program


# `ownsan audit` finds nothing here, and cannot: the view goes stale because this program itself writes the next
# tensor into the same bytes (buf.write at offset 0, twice, in one call); the audit knows a view as good until
# its loader's step ends (the loop over a loader's tensors moves on, or the call returns), knows no
# StagingBuffer as a loader and compares no offsets. Only the sanitizer, running it, tells (docs/audit.md).
def load_two_weights(buf):
    """A loader that reuses the same staging bytes for consecutive tensors, as fast loaders do."""
    w = buf.write(0, torch.full((256, 128), 1.0, dtype=torch.bfloat16), name="layers.0.mlp.gate_proj.weight")
    kept = w.t()[:, :64]  # a consumer keeps a derived view instead of copying
    buf.write(0, torch.full((256, 128), 2.0, dtype=torch.bfloat16), name="layers.0.mlp.up_proj.weight")
    return kept


def main():
    buf = sanitizer.StagingBuffer(1 << 20, device="cpu", name="ring0")
    if ON_FROM_START:
        print(f"0. the sanitizer is on from the start (triage={int(sanitizer.options()['triage'])}): no read "
              "below goes unsanitized\n")
    steps = [("1. before any sanitize()" if ON_FROM_START else "1. unsanitized", None),
             ("2. sanitized", {}), ("3. halt_on_error=0", {"halt_on_error": 0}), ("4. after close", {})]
    for heading, options in steps:
        if heading.startswith("4."):  # the buffer is gone: a read is a use-after-free report, never a segfault
            kept = buf.write(0, torch.ones(4, 4), name="lm_head.weight")
            buf.close()
        else:
            kept = load_two_weights(buf)
        before = len(sanitizer.errors())
        try:  # one late read of the kept view
            with contextlib.nullcontext() if options is None else sanitizer.sanitize(**options):
                value = kept.float().mean().item()
        except sanitizer.StaleBorrowError as err:
            print(f"{heading}: the late read raises at once:\n\n{err}\n")
            continue
        new = sanitizer.errors()[before:]
        print(f"{heading}: the late read reads {value:.1f}, " + (f"recorded, not raised: {new[0]['summary']}\n" if new
              else "up_proj's bytes (gate_proj's are all 1.0), silently\n"))
    print(f"sanitizer.report()['error_count'] = {sanitizer.report()['error_count']}: one per late read caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
