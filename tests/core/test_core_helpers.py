"""The torch-free helpers in sanitizer.core: spans, units, the safetensors header, our-frames rule."""
import json
import os
import struct

import pytest

from sanitizer.core import sites
from sanitizer.core.safetensors_header import read_header
from sanitizer.core.spans import merge, subtract
from sanitizer.core.units import format_bytes

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(sites.__file__)))


def test_merge_joins_touching_and_drops_empty():
    assert merge([(5, 9), (0, 3), (3, 4), (7, 7), (8, 12)]) == [(0, 4), (5, 12)]


def test_subtract_takes_holes_in_any_order_and_overlapping():
    assert subtract([(0, 10)], [(6, 8), (2, 4), (3, 5)]) == [(0, 2), (5, 6), (8, 10)]
    assert subtract([(0, 4), (10, 14)], [(2, 12)]) == [(0, 2), (12, 14)]
    assert subtract([(0, 4)], []) == [(0, 4)]
    assert subtract([(0, 4)], [(0, 4)]) == []


def test_format_bytes():
    assert format_bytes(12) == "12 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 20) == "3.0 MiB"
    assert format_bytes(5 << 30) == "5.0 GiB"


def test_safetensors_header(tmp_path):
    blob = json.dumps({"__metadata__": {"a": "b"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(8))
    tensors, meta, start = read_header(str(path))
    assert list(tensors) == ["w"] and meta == {"a": "b"} and start == 8 + len(blob)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"123")
    with pytest.raises(ValueError, match="shorter than 8 bytes"):
        read_header(str(short))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="exceeds the file size"):
        read_header(str(bad))


def test_one_rule_for_our_own_frames():
    join = os.path.join
    assert sites.is_internal_file(join(_PKG, "torch_layer", "runtime.py"))
    assert sites.is_internal_file(join(_PKG, "features", "holders.py"))
    assert sites.is_internal_file(join(os.path.dirname(_PKG), "cuda_hooks", "gpu.py"))
    for user in ("demo.py", "fuzz.py", join("reference", "deferred_loader.py")):
        assert not sites.is_internal_file(join(_PKG, "testing", user))
    assert not sites.is_internal_file("/elsewhere/model.py")


def test_holder_walk_uses_the_same_rule():
    from sanitizer.features import holder_paths

    def probe():
        return probe.__code__

    assert holder_paths.internal(holder_paths.internal.__code__)
    assert not holder_paths.internal(probe())


def test_in_a_loop_reads_the_bytecode_of_a_function_a_generator_and_a_script():
    """A lend bound by a loop's body (or its ``for`` header: a generator's ``for name, data in weights``) is
    rebound at the next iteration; one outside a loop is not. Read from the code, not the source: a ``-c``
    script or a notebook cell has no file (the emulated safetensors contract's loop-variable rule)."""
    import sys as _sys

    from sanitizer.core.sites import in_a_loop

    seen = {}

    def here(tag):
        frame = _sys._getframe(1)
        seen[tag] = (frame.f_code, frame.f_lasti)

    def consumer(keys):
        before = here("before")
        for k in keys:
            here("body")
        while len(seen) < 9:
            here("while")
            seen[len(seen)] = None
        [here("comprehension") for _ in keys]
        here("after")

    def gen(items):
        for name in items:
            yield name

    consumer([1, 2])
    assert {tag: in_a_loop(*seen[tag]) for tag in ("before", "body", "while", "comprehension", "after")} == \
        {"before": False, "body": True, "while": True, "comprehension": True, "after": False}
    g = gen(iter([1, 2]))
    next(g)
    assert in_a_loop(g.gi_code, g.gi_frame.f_lasti)  # suspended at the yield inside its for loop
    script = compile("for k in range(2):\n    here('module-body')\nhere('module-after')\n", "<string>", "exec")
    exec(script, {"here": here})
    assert in_a_loop(*seen["module-body"]) and not in_a_loop(*seen["module-after"])
