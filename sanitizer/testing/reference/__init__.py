"""Reference *consumers* of borrowed tensors, shipped for demonstrations, tests and fuzzing.

Everything here plays the part of user code: a faithful copy of vLLM's layerwise
deferred loader (``deferred_loader``, with its fused ``fused_loaders`` and an
online int8 ``quantize``r) and a checkpoint writer and ring reader
(``checkpoint``), which the demo (``sanitizer/testing/demo.py``) drives. Reports
show their frames, unlike the sanitizer's own plumbing (see ``sanitizer/sites.py``).
"""
