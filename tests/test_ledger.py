"""The pure ledger, driven with synthetic ids and addresses: no torch anywhere here."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import threading

import pytest

from sanitizer.core.ledger import FIRST_GENERATION, Ledger, LedgerError

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sanitizer")


@pytest.mark.parametrize("module", ["core/ledger.py", "core/sites.py", "core/options.py", "core/errors.py"])
def test_pure_modules_import_no_torch_or_numpy(module):
    tree = ast.parse(open(os.path.join(PKG, module)).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    assert not names & {"torch", "numpy", "numba"}, names


def test_reuse_makes_overlapping_leases_stale_and_says_why():
    led = Ledger()
    r = led.add_region("ring0", "cpu", 0x1000, 4096)
    a = led.lend(r.region_id, 0, 1024, "a", "float32", (256,))
    b = led.lend(r.region_id, 1024, 2048, "b", "float32", (256,))
    c = led.lend(r.region_id, 2048, 4096, "c", "uint8", (2048,))
    assert a.generation == FIRST_GENERATION
    event, victims = led.reuse(r.region_id, 1000, 1100, by="next")
    assert {v.name for v in victims} == {"a", "b"}
    assert led.is_stale(a.lease_id) and led.is_stale(b.lease_id) and not led.is_stale(c.lease_id)
    assert led.stale_cause(a.lease_id) is event
    assert (event.generation_before, event.generation_after) == (1, 2)
    assert event.by == "next"
    # a half-open interval: [2048, 2048) touches nothing, [2047, 2048) touches b only (already stale)
    _, none = led.reuse(r.region_id, 2048, 2048)
    assert none == []
    assert led.overlapping(r.region_id, 0, 4096) == [c]
    assert set(l.name for l in led.overlapping(r.region_id, 0, 4096, include_stale=True)) == {"a", "b", "c"}


def test_stale_is_sticky_and_a_new_lend_is_fresh():
    led = Ledger()
    r = led.add_region("r", "cpu", 0, 100)
    old = led.lend(r.region_id, 0, 10, "old", "uint8", (10,))
    led.reuse(r.region_id, 0, 10)
    new = led.lend(r.region_id, 0, 10, "new", "uint8", (10,))
    assert new.generation == 2 and not new.stale
    led.reuse(r.region_id, 50, 60)  # elsewhere: touches neither
    assert old.stale and not new.stale
    assert old.stale_by.generation_after == 2


def test_close_makes_every_lease_stale_and_forbids_more():
    led = Ledger()
    r = led.add_region("r", "cuda:0", 0x10, 100)
    a = led.lend(r.region_id, 0, 10, "a", "uint8", (10,))
    event, victims = led.close(r.region_id)
    assert victims == [a] and a.stale and event.kind == "close"
    assert "was closed" in event.describe()
    with pytest.raises(LedgerError, match="closed"):
        led.lend(r.region_id, 0, 10, "b", "uint8", (10,))
    with pytest.raises(LedgerError, match="closed"):
        led.reuse(r.region_id, 0, 10)
    assert led.region_containing("cuda:0", 0x10) is None


@pytest.mark.parametrize("start,end", [(-1, 5), (5, 4), (90, 101)])
def test_out_of_range_intervals_name_the_numbers(start, end):
    led = Ledger()
    r = led.add_region("r", "cpu", 0, 100)
    with pytest.raises(LedgerError, match=rf"\[{start}, {end}\).*100 bytes"):
        led.lend(r.region_id, start, end, "x", "uint8", (1,))
    with pytest.raises(LedgerError, match=rf"\[{start}, {end}\).*100 bytes"):
        led.reuse(r.region_id, start, end)


def test_release_tracks_liveness_and_reports_transitions():
    changes = []
    led = Ledger(on_live_change=changes.append)
    r = led.add_region("r", "cpu", 0, 100)
    a = led.lend(r.region_id, 0, 10, "a", "uint8", (10,))
    b = led.lend(r.region_id, 10, 20, "b", "uint8", (10,))
    led.reuse(r.region_id, 0, 10)
    assert [l.name for l in led.stale_alive()] == ["a"]
    led.release(a.lease_id)
    assert not a.alive and led.stale_alive() == [] and changes == [1]
    assert led.release(a.lease_id) is None  # twice is harmless
    led.release(b.lease_id)
    assert changes == [1, 0] and led.live_count == 0
    with pytest.raises(LedgerError):
        led.is_stale(b.lease_id)


def test_region_lookup_by_address_including_nested_regions():
    led = Ledger()
    outer = led.add_region("outer", "cpu", 1000, 1000)
    inner = led.add_region("inner", "cpu", 1200, 100)
    other = led.add_region("gpu", "cuda:0", 1000, 1000)
    assert led.region_containing("cpu", 1000) is outer
    assert led.region_containing("cpu", 1250, 10) is inner
    assert led.region_containing("cpu", 1250, 100) is outer  # runs past inner's end
    assert led.region_containing("cpu", 1999) is outer
    assert led.region_containing("cpu", 2000) is None
    assert led.region_containing("cpu", 999) is None
    assert led.region_containing("cuda:0", 1500) is other
    assert led.region_containing("cuda:1", 1500) is None


def test_descriptions_read_like_the_report():
    led = Ledger()
    r = led.add_region("ring0", "cpu", 0, 1 << 20)
    a = led.lend(r.region_id, 0, 65536, "layers.0.mlp.gate_proj.weight", "bfloat16", (256, 128))
    event, _ = led.reuse(r.region_id, 0, 4096, by="layers.0.mlp.up_proj.weight")
    assert a.describe() == "'layers.0.mlp.gate_proj.weight' bfloat16[256, 128]"
    assert event.describe() == ("staging buffer 'ring0' reused bytes [0x0, 0x1000) for "
                                "'layers.0.mlp.up_proj.weight' (generation 1 -> 2)")
    assert a.to_dict()["byte_range"] == [0, 65536] and event.to_dict()["generation_after"] == 2


def test_threads_lend_reuse_and_release_without_losing_an_event():
    led = Ledger()
    regions = [led.add_region(f"r{i}", "cpu", i * 10_000, 10_000) for i in range(4)]
    per_thread = 500
    errors = []

    def worker(region):
        try:
            for i in range(per_thread):
                lease = led.lend(region.region_id, (i * 16) % 9000, (i * 16) % 9000 + 16, f"t{i}", "uint8", (16,))
                _, victims = led.reuse(region.region_id, (i * 16) % 9000, (i * 16) % 9000 + 16)
                assert lease in victims
                led.release(lease.lease_id)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in regions for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(r.generation == FIRST_GENERATION + 2 * per_thread for r in regions)
    assert led.live_count == 0


def test_closed_regions_are_forgotten_once_no_lease_reaches_them():
    led = Ledger()
    empty = led.add_region("empty", "cpu", 0, 100)
    held = led.add_region("held", "cpu", 1000, 100)
    lease = led.lend(held.region_id, 0, 10, "x", "uint8", (10,))
    led.close(empty.region_id)
    led.close(held.region_id)
    assert [r.name for r in led.regions()] == ["held"]  # a stale lease still reaches it
    assert lease.stale_by.region_name == "held"
    led.release(lease.lease_id)
    assert led.regions() == []


def test_disown_ends_the_borrow_without_making_it_stale():
    changes = []
    led = Ledger(on_live_change=changes.append)
    r = led.add_region("r", "cpu", 0, 100)
    a = led.lend(r.region_id, 0, 10, "a", "uint8", (10,))
    b = led.lend(r.region_id, 10, 20, "b", "uint8", (10,))
    assert led.live_count == 2 and changes == [1]
    assert led.disown(a.lease_id) is a
    assert a.rescued and not a.stale
    assert led.lease(a.lease_id) is None and a not in led.live_leases()  # no longer a borrow
    assert led.live_count == 1 and changes == [1]
    with pytest.raises(LedgerError):
        led.is_stale(a.lease_id)
    # a later reuse of its bytes makes only the still-borrowed lease a victim
    event, victims = led.reuse(r.region_id, 0, 20, by="next")
    assert victims == [b] and not a.stale and a.stale_by is None
    assert led.stale_cause(a.lease_id) is None and led.stale_alive() == [b]
    assert led.overlapping(r.region_id, 0, 100, include_stale=True) == [b]
    # twice, or an id the ledger never lent, is a no-op
    assert led.disown(a.lease_id) is None and led.disown(10_000) is None
    assert led.release(a.lease_id) is None  # its storage dying later is no event either
    assert led.live_count == 1 and changes == [1]
    led.disown(b.lease_id)  # a stale lease can be disowned too: the borrow (and its staleness) ends
    assert b.rescued and not b.stale and led.stale_alive() == []
    assert led.live_count == 0 and changes == [1, 0]


def test_disown_lets_a_closed_region_be_forgotten():
    led = Ledger()
    r = led.add_region("r", "cpu", 0, 100)
    lease = led.lend(r.region_id, 0, 10, "x", "uint8", (10,))
    led.close(r.region_id)
    assert [x.name for x in led.regions()] == ["r"]
    led.disown(lease.lease_id)
    assert led.regions() == []


_TORCHLESS = r"""
import sys
sys.modules['torch'] = None  # any 'import torch' now raises ImportError
import sanitizer
import sanitizer.core.errors, sanitizer.core.ledger, sanitizer.core.options
from sanitizer.core.ledger import Ledger
led = Ledger()
r = led.add_region('r', 'cpu', 0x1000, 64)
a = led.lend(r.region_id, 0, 8, 'a', 'uint8', (8,))
b = led.lend(r.region_id, 8, 16, 'b', 'uint8', (8,))
_, victims = led.reuse(r.region_id, 0, 8, by='next')
assert victims == [a] and a.stale and not b.stale
led.disown(b.lease_id); led.release(a.lease_id)
assert led.live_count == 0
assert sanitizer.OptionError is sanitizer.core.options.OptionError
assert 'option' in sanitizer.options_table()
assert issubclass(sanitizer.StaleBorrowError, sanitizer.OwnershipError)
assert sanitizer.LedgerError is sanitizer.core.ledger.LedgerError
assert sys.modules['torch'] is None, 'torch was imported'
assert not [m for m in sys.modules if m.startswith(('torch.', 'numba', 'numpy'))]
print('ok')
"""


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    root = os.path.dirname(PKG)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_core_and_the_package_face_import_without_torch():
    proc = subprocess.run([sys.executable, "-c", _TORCHLESS], env=_clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok"]


def test_importing_the_package_loads_no_torch_until_a_torch_name_is_used():
    code = ("import sys, sanitizer\n"
            "print('torch' in sys.modules, 'numba' in sys.modules, 'sanitizer.torch_layer' in sys.modules)\n"
            "print(set(sanitizer.__all__) <= set(dir(sanitizer)))\n"
            "print(sanitizer.enabled(), 'torch' in sys.modules, 'numba' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False", "True", "False", "True", "False"]


def test_importing_installs_no_feature_and_enable_composes_them_once():
    """Composition happens in one explicit place (sanitizer.activation.compose), called by enable: importing
    any module, the torch layer and the features included, installs no hook."""
    code = ("import sanitizer.torch_layer.runtime, sanitizer.features.checksums as c, sanitizer.features.triage\n"
            "import sanitizer.torch_layer.hooks as h, sanitizer.activation as a\n"
            "count = lambda: len(h.HOOKS.lend) + len(h.HOOKS.retire) + len(h.HOOKS.enable) + len(h.HOOKS.stale_use)\n"
            "print(a.composed(), count(), any(f is c.on_retire for _, f in h.HOOKS.retire))\n"
            "a.enable(); n = count(); a.disable(); a.enable()\n"
            "print(a.composed(), n > 0, count() == n, any(f is c.on_retire for _, f in h.HOOKS.retire))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "0", "False", "True", "True", "True", "True"]
