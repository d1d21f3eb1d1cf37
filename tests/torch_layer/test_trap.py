"""trap=poison|fault: every alias of a retired lease (numpy, memoryview, DLPack, frombuffer, ctypes) hits the
tombstone, not the next tensor; rescue=1 keeps every alias on the right bytes; limits and fallback."""
from __future__ import annotations

import ctypes
import gc
import math
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from sanitizer.core import options as _options
from sanitizer.core import pages
from sanitizer.torch_layer.ring import StagingRing

from tests.conftest import run_python

pytestmark = pytest.mark.skipif(not pages.AVAILABLE, reason=str(pages.UNAVAILABLE_REASON))

FIRST = torch.arange(8, dtype=torch.float32)
NEXT = torch.full((8,), 7.0)


def _ctypes_floats(ptr: int, n: int) -> list:
    return list((ctypes.c_float * n).from_address(ptr))


def _aliases(w: torch.Tensor) -> dict:
    """Every alias kind of a lease, made while it is fresh."""
    arr = w.numpy()
    return {"numpy": arr, "memoryview": memoryview(w.numpy()), "ptr": w.data_ptr(),
            "from_dlpack": torch.from_dlpack(w), "from_numpy": torch.from_numpy(w.numpy()),
            "frombuffer": torch.frombuffer(memoryview(w.numpy()), dtype=torch.float32),
            "np_from_dlpack": np.from_dlpack(w)}


def test_without_trap_an_alias_reads_the_next_tensor_the_bug_trap_closes():
    sanitizer.enable()
    buf = StagingBuffer(64)
    w = buf.write(0, FIRST, "w")
    arr = w.numpy()
    buf.write(0, NEXT, "next")
    assert arr.tolist() == NEXT.tolist()  # the guard re-pointed w, but not the numpy alias


@pytest.mark.slow
def test_every_alias_reads_poison_after_reuse_and_torch_aliases_raise():
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(64, name="trapbuf")
    w = buf.write(0, FIRST, "w")
    a = _aliases(w)
    assert a["numpy"].tolist() == FIRST.tolist()  # fresh: the right bytes through every path
    nxt = buf.write(0, NEXT, "next")
    assert torch.equal(nxt, NEXT)  # the producer's write and the new lease are untouched
    assert np.isnan(a["numpy"]).all() and np.isnan(a["np_from_dlpack"]).all()
    assert np.isnan(np.frombuffer(a["memoryview"], np.float32)).all()
    assert all(math.isnan(x) for x in _ctypes_floats(a["ptr"], 8))
    assert bytes(a["memoryview"]) == b"\xff" * 32
    for kind in ("from_dlpack", "from_numpy", "frombuffer"):  # storages of their own: found by address
        with pytest.raises(StaleBorrowError, match="'w'"):
            a[kind].sum()
    with pytest.raises(StaleBorrowError, match="'w'"):
        w.sum()


def test_leases_sharing_a_page_have_their_own_mappings():
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(4096)
    a = buf.write(0, FIRST, "a")
    b = buf.write(64, NEXT, "b")
    arr_a, arr_b = a.numpy(), b.numpy()
    buf.reuse(0, 32, by="c")
    assert np.isnan(arr_a).all()
    assert arr_b.tolist() == NEXT.tolist() and torch.equal(b, NEXT)  # b's window, same page, untouched


def test_rescue_keeps_every_alias_on_the_rescued_bytes():
    sanitizer.enable(trap="poison", rescue=True)
    buf = StagingBuffer(64)
    w = buf.write(0, FIRST, "w")
    a = _aliases(w)
    nxt = buf.write(0, NEXT, "next")
    assert torch.equal(nxt, NEXT)
    assert torch.equal(w, FIRST)
    assert a["numpy"].tolist() == FIRST.tolist() and a["np_from_dlpack"].tolist() == FIRST.tolist()
    assert np.frombuffer(a["memoryview"], np.float32).tolist() == FIRST.tolist()
    assert _ctypes_floats(a["ptr"], 8) == FIRST.tolist()
    for kind in ("from_dlpack", "from_numpy", "frombuffer"):
        assert torch.equal(a[kind], FIRST)
    record = sanitizer.rescues()[-1]
    assert record["in_place"] and "aliases_not_rescued" not in record
    assert sanitizer.errors() == []


def _ring_load(trap: str, quarantine: int = 0) -> list:
    sanitizer.enable(trap=trap, quarantine=quarantine)
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(5 + i, 7, generator=g) for i in range(12)]
    out = []
    with StagingRing(3 * 12 * 7 * 4, name="r") as ring:
        for i, t in enumerate(weights):
            view = ring.put(f"w{i}", t)
            out.append((view * 2).clone())  # a correct consumer: uses and copies before the next put
    sanitizer.disable()
    return out


@pytest.mark.parametrize("quarantine", [0, 2])
def test_a_correct_program_is_bit_identical_with_trap_on(quarantine):
    plain = _ring_load("0", quarantine)
    trapped = _ring_load("poison", quarantine)
    assert len(plain) == len(trapped) and all(torch.equal(a, b) for a, b in zip(plain, trapped))
    assert sanitizer.errors() == []


@pytest.mark.slow
def test_windows_are_unmapped_when_the_lease_dies():
    from sanitizer.torch_layer import trap

    sanitizer.enable(trap="poison")
    gc.collect()
    before = trap.stats()["windows"]
    buf = StagingBuffer(1 << 16)
    views = [buf.lend(i * 64, (16,), torch.float32, f"v{i}") for i in range(50)]
    arrs = [v.numpy() for v in views[:10]]
    assert trap.stats()["windows"] == before + 50
    del views
    gc.collect()
    assert trap.stats()["windows"] == before + 10  # the numpy aliases keep their leases' windows
    del arrs
    gc.collect()
    assert trap.stats()["windows"] == before


def test_past_the_map_budget_lends_fall_back_to_the_guard_with_one_warning(monkeypatch):
    from sanitizer.torch_layer import trap, trap_memory

    sanitizer.enable(trap="poison")
    trap_memory.room()  # read the kernel's limit
    assert trap.stats()["max_map_count"] == pages.read_max_map_count()
    monkeypatch.setitem(trap_memory._limits, "max_windows", trap.stats()["windows"] + 1)
    monkeypatch.setattr(trap_memory, "_warned", False)
    buf = StagingBuffer(256)
    a = buf.write(0, FIRST, "a")  # the last window the budget allows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b = buf.write(64, FIRST, "b")
        c = buf.write(128, FIRST, "c")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "vm.max_map_count=" in messages[0] and "fall back to the guard" in messages[0]
    assert str(pages.read_max_map_count()) in messages[0]
    assert trap.stats()["fallbacks"] >= 2
    buf.reuse(0, 256, by="d")
    assert all(math.isnan(x) for x in _ctypes_floats(b.data_ptr(), 8))  # the guard's tombstone
    assert all(math.isnan(x) for x in _ctypes_floats(a.data_ptr(), 8))  # the trap's window
    del c


def test_option_values_and_unavailable_platform(monkeypatch):
    with pytest.raises(_options.OptionError, match="poison, fault or 0"):
        _options.resolve({"trap": "yes"})
    monkeypatch.setattr(pages, "AVAILABLE", False)
    monkeypatch.setattr(pages, "UNAVAILABLE_REASON", "needs 64-bit Linux (memfd_create, mmap with MAP_FIXED); this is darwin")
    with pytest.raises(_options.OptionError, match="trap mode is unavailable here.*darwin"):
        _options.resolve({"trap": "fault"})
    assert _options.resolve({"trap": "0"})["trap"] == "0"


def test_default_and_device_buffers_are_plain():
    sanitizer.enable()
    assert type(StagingBuffer(64)) is StagingBuffer
    sanitizer.enable(trap="poison")
    assert type(StagingBuffer.adopt(torch.zeros(16))) is StagingBuffer  # a loader's memory is never remapped
    from sanitizer.torch_layer import trap

    assert trap.buffer_class((64,), {"pin_memory": True}) is None  # pinned memory stays torch's
    from sanitizer.torch_layer import trap_cuda

    if trap_cuda.unavailable(torch.device("cuda", 0)) is None:  # a GPU with virtual memory management
        assert trap.buffer_class((64, "cuda:0"), {}) is trap.TrapStagingBuffer
    else:  # no VMM driver here: the guard, with one warning saying why (tests/cuda/test_trap_cuda.py fakes one)
        with pytest.warns(RuntimeWarning, match="cannot be trapped on cuda:0"):
            assert trap.buffer_class((64, "cuda:0"), {}) is None
    assert trap.buffer_class((64,), {}) is trap.TrapStagingBuffer


def test_page_calls_validate_their_arguments():
    with pytest.raises(ValueError, match="page size"):
        pages.protect(pages.PAGE + 1, pages.PAGE, pages.PROT_NONE)
    with pytest.raises(ValueError, match="length"):
        pages.unmap(pages.PAGE * 16, 0)
    with pytest.raises(ValueError, match="prot"):
        pages.map_file(0, 0, pages.PAGE, 0x4)
    with pytest.raises(ValueError, match="offset"):
        pages.map_file(0, 3, pages.PAGE, pages.PROT_READ)
    with pytest.raises(ValueError, match="fd"):
        pages.map_file(-1, 0, pages.PAGE, pages.PROT_READ)


FAULT_PROGRAM = textwrap.dedent("""
    import sys, ctypes, torch, sanitizer
    from sanitizer import StagingBuffer
    sanitizer.enable(trap="fault")
    buf = StagingBuffer(64, name="faultbuf")
    w = buf.write(0, torch.arange(4, dtype=torch.float32), "layer0.weight")
    kept = {kind}
    buf.write(0, torch.full((4,), 7.0), "layer1.weight")
    print("fresh reads were fine", flush=True)
    def consumer():
        return {read}
    consumer()
    print("NOT REACHED", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind,read", [
    ("w.numpy()", "float(kept[0])"),
    ("memoryview(w.numpy())", "bytes(kept)"),
    ("w.data_ptr()", "ctypes.string_at(kept, 16)"),
])
def test_fault_mode_reports_the_lease_and_exits_non_zero(kind, read):
    proc = run_python(FAULT_PROGRAM.format(kind=kind, read=read))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "fresh reads were fine" in proc.stdout and "NOT REACHED" not in proc.stdout
    err = proc.stderr
    assert err.count("==ownsan== ERROR") == 1
    assert "lease 'layer0.weight'" in err and "'faultbuf'" in err and "generation" in err
    assert "for 'layer1.weight'" in err  # what retired it
    assert "in consumer" in err  # the Python stack at the fault


@pytest.mark.slow
def test_fault_mode_leaves_other_segfaults_to_the_previous_handler():
    proc = run_python("import faulthandler, ctypes, sanitizer\nfrom sanitizer import StagingBuffer\n"
                      "import torch\nsanitizer.enable(trap='fault')\nb = StagingBuffer(64)\n"
                      "w = b.write(0, torch.zeros(4), 'w')\nb.write(0, torch.ones(4), 'n')\n"
                      "faulthandler.enable()\nctypes.string_at(16, 4)\n")
    assert proc.returncode != 0 and proc.returncode != 1
    assert "==ownsan==" not in proc.stderr and "Fatal Python error" in proc.stderr


def test_safetensors_ring_emulation_traps_a_kept_numpy_alias(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from sanitizer import adapters

    tensors = {f"w{i}": torch.full((16, 16), float(i)) for i in range(3)}
    path = str(tmp_path / "m.safetensors")
    safetensors_torch.save_file(tensors, path)
    sanitizer.enable(safetensors_ring=4 * 16 * 16, safetensors_strict=1, trap="poison", halt_on_error=False)
    assert "safetensors" in adapters.install_import_hooks()
    try:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            kept = f.get_tensor("w0").numpy()
            assert (kept == 0).all()
            f.get_tensor("w1")
            assert np.isnan(kept).all()  # never w1's ones
    finally:
        adapters.uninstall_import_hooks()


def test_a_forked_child_writes_its_own_copy_never_the_parents_buffer():
    import os

    sanitizer.enable(trap="poison", rescue=True)
    buf = StagingBuffer(8192)
    w = buf.write(0, FIRST, "w")
    r = buf.write(4096, FIRST, "r")
    arr_r = r.numpy()
    buf.reuse(4096, 32, by="x")  # r is rescued onto its own pages (held by arr_r)
    pid = os.fork()
    if pid == 0:  # the child writes everywhere it can
        try:
            buf.tensor[:64].fill_(1)
            w.numpy()[:] = 5.0
            arr_r[:] = 6.0
            # the loader's mapping and w's window are one copy in the child: bytes past w keep the fill
            ok = (buf.tensor[40].item() == 1 and buf.tensor[:4].view(torch.float32).item() == 5.0
                  and w[0].item() == 5.0 and arr_r[0] == 6.0)
        finally:
            os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0  # the child saw its own writes
    assert torch.equal(w, FIRST) and arr_r.tolist() == FIRST.tolist()  # the parent's bytes are untouched
    assert buf.tensor[:32].view(torch.float32).tolist() == FIRST.tolist()


def test_a_correct_program_lends_from_one_mirror_and_a_trapped_range_is_lent_again():
    """Leases that die before the next lend over their pages share one mirror (no mapping per lend); a
    trapped lease's pages go back to the file when it dies, and the next lease over them reads its own
    bytes, in the same mirror."""
    from sanitizer.torch_layer import trap

    sanitizer.enable(trap="poison")
    gc.collect()
    buf = StagingBuffer(1 << 16, name="mirrors")
    for i in range(20):  # a correct consumer: each lease dead before the next put
        w = buf.write((i % 4) * 4096, torch.full((8,), float(i)), f"w{i}")
        assert w.tolist() == [float(i)] * 8
        del w
    assert len(buf._memory._mirrors) == 1
    kept = buf.write(0, FIRST, "kept")
    buf.write(0, NEXT, "next")  # traps kept's range; "next" (dead at once) needed a chunk mirror meanwhile
    assert all(math.isnan(x) for x in _ctypes_floats(kept.data_ptr(), 8))
    first_mirror = buf._memory._mirrors[0]
    other = buf.write(8192, FIRST, "other")  # free pages of the first mirror
    assert buf._memory.window(sanitizer.lease_of(other)).mirror is first_mirror
    assert other.tolist() == FIRST.tolist()
    del kept
    gc.collect()
    again = buf.write(0, NEXT * 2, "again")  # the trapped range was put back on the file
    assert buf._memory.window(sanitizer.lease_of(again)).mirror is first_mirror
    assert again.tolist() == (NEXT * 2).tolist() and len(buf._memory._mirrors) == 2  # (the chunk's stays)
    assert trap.stats()["mirrors"] >= 1


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_a_closed_buffers_file_is_reused_and_a_fork_child_never_shares_it():
    from sanitizer.torch_layer import trap_memory

    sanitizer.enable(trap="poison")
    gc.collect()
    trap_memory._FILES.clear()
    a = StagingBuffer(1 << 16)
    a.write(0, FIRST, "w")
    a.close()
    del a
    gc.collect()
    assert len(trap_memory._FILES._files) == 1  # nothing maps it any more: kept for the next buffer
    b = StagingBuffer(1 << 15)  # smaller: the pooled file serves it
    assert len(trap_memory._FILES._files) == 0
    w = b.write(0, NEXT, "w")
    assert w.tolist() == NEXT.tolist()
    del w, b
    gc.collect()
    assert len(trap_memory._FILES._files) == 1
    proc = run_python("import os, sanitizer, torch, gc\nfrom sanitizer import StagingBuffer\n"
                      "from sanitizer.torch_layer import trap_memory\nsanitizer.enable(trap='poison')\n"
                      "b = StagingBuffer(4096); b.close(); del b; gc.collect()\n"
                      "assert len(trap_memory._FILES._files) == 1\npid = os.fork()\n"
                      "if pid == 0:\n    os._exit(0 if not trap_memory._FILES._files else 3)\n"
                      "print('child', os.waitpid(pid, 0)[1] >> 8)\n")
    assert proc.stdout.strip() == "child 0", proc.stderr[-1000:]


@pytest.mark.parametrize("parent_buffer_dies_in_child", [False, True])
def test_a_forked_childs_new_buffer_never_shares_the_parents_live_memory(parent_buffer_dies_in_child):
    """Issue 48.1: the parent's files moved onto copies in the child died there and went to the child's pool,
    so the child's next buffer mapped the parent's live pages (MAP_SHARED): the child's writes reached the
    parent's ``w``, and nothing was reported."""
    import os

    sanitizer.enable(trap="poison")
    gc.collect()
    b = StagingBuffer(1 << 16)
    w = b.write(0, torch.full((16,), 1.0), "w")
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            global_b = [b]
            if parent_buffer_dies_in_child:
                global_b.clear()
            del b
            gc.collect()
            mine = StagingBuffer(1 << 16)
            mine.write(0, torch.full((16,), 99.0), "mine")
            mine.tensor.numpy().fill(0x55)  # (numpy: a torch op this big after a fork may wait on OpenMP)
            code = 0
        finally:
            os.write(wfd, b"x")
            os._exit(code)
    os.close(wfd)
    os.read(r, 1)
    _, status = os.waitpid(pid, 0)
    os.close(r)
    assert os.WEXITSTATUS(status) == 0
    assert w.tolist() == [1.0] * 16  # the child's buffer was its own memory


def test_past_the_descriptor_limit_buffers_fall_back_to_the_guard_with_one_warning():
    """Issue 48.3: one memfd per live trap buffer; past RLIMIT_NOFILE ``StagingBuffer()`` raised ``OSError:
    Too many open files``. Now: a plain buffer, one warning, and its leases are still checked by the guard."""
    proc = run_python(textwrap.dedent("""
        import resource, warnings, math, torch, sanitizer
        from sanitizer import StagingBuffer, StaleBorrowError
        sanitizer.enable(trap="poison")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        buffers, leases, caught = [], [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(100):
                b = StagingBuffer(1 << 16, name=f"b{i}")
                leases.append(b.write(0, torch.full((8,), float(i)), "w"))
                buffers.append(b)
        plain = [b for b in buffers if b._memory is None]
        ok = all(w.tolist() == [float(i)] * 8 for i, w in enumerate(leases))
        last = buffers[-1]
        last.reuse(0, 64, by="next")
        try:
            leases[-1].sum()
            stale = False
        except StaleBorrowError:
            stale = True
        messages = [str(w.message) for w in caught if "trap buffer could not be made" in str(w.message)]
        print(len(plain) > 0, ok, stale, len(messages), "Too many open files" in messages[0])
    """))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "True", "1", "True"], proc.stdout


def test_a_retire_that_cannot_map_the_trap_leaves_the_lease_to_the_guard(monkeypatch):
    """Issue 48.3: ``ENOMEM`` from the retire's mapping (no maps left to split the mirror) raised out of the
    reuse; now the window stays fresh, one warning says why, and the guard re-points the lease's own tensor."""
    import errno

    from sanitizer.torch_layer import trap_memory

    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 14)
    w = buf.write(0, FIRST, "w")

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(trap_memory.TrapMemory, "trap", no_memory)
    monkeypatch.setattr(trap_memory, "_warned_keys", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf.reuse(0, 64, by="next")
    assert any("could not be trapped" in str(c.message) for c in caught)
    with pytest.raises(StaleBorrowError):
        w.sum()


def test_leases_sharing_a_page_map_a_chunk_whatever_the_buffer_size():
    """Issue 48.4: each live lease that shared a page with another mapped a whole-buffer mirror, populated
    (64 leases in one page of 256 MiB: 64 maps of 256 MiB, seconds to lend). Now each depth of leases on a
    page maps one chunk of the buffer, shared by the leases of that chunk: the cost is bounded by the chunk,
    not the buffer; each lease reads its own bytes, and retiring one leaves the others as they were."""
    from sanitizer.torch_layer import trap_memory

    sanitizer.enable(trap="poison")
    buf = StagingBuffer(64 << 20, name="big")
    leases = [buf.write(i * 64, torch.full((16,), float(i)), f"w{i}") for i in range(64)]
    memory = buf._memory
    windows = [memory.window(sanitizer.lease_of(w)) for w in leases]
    assert windows[0].mirror is memory._mirrors[0] and memory._mirrors[0].length == 64 << 20
    assert all(w.mirror.base == 0 and w.mirror.length == trap_memory._CHUNK for w in windows[1:])
    assert len({id(w.mirror) for w in windows}) == 64 == len(memory._mirrors)
    below = buf.write(trap_memory._CHUNK + 64, torch.full((16,), -1.0), "other chunk")  # free in the whole mirror
    beside = buf.write(64 * 64 + 32, torch.full((8,), -2.0), "beside")  # page 1: whole mirror free there too
    assert memory.window(sanitizer.lease_of(below)).mirror is memory._mirrors[0]
    assert memory.window(sanitizer.lease_of(beside)).mirror is memory._mirrors[0]
    assert all(w.tolist() == [float(i)] * 16 for i, w in enumerate(leases))
    kept = leases[5].numpy()
    buf.reuse(5 * 64, 64, by="x")
    assert np.isnan(kept).all()
    assert all(w.tolist() == [float(i)] * 16 for i, w in enumerate(leases) if i != 5)
    assert below.tolist() == [-1.0] * 16 and beside.tolist() == [-2.0] * 8


@pytest.mark.parametrize("mode", ["poison", "fault"])
def test_a_forked_child_sees_the_buffer_as_it_was_at_the_fork(mode):
    """Issue 48, found by a blind user: the child copied its trap buffers after the fork, from the mapping it
    still shared with the parent, so a write the parent made right after the fork reached the child (the
    lease and a numpy alias of it read 3.0). The parent now snapshots each trap buffer just before the fork."""
    proc = run_python(textwrap.dedent(f"""
        import os, time, torch, sanitizer
        sanitizer.enable(trap={mode!r})
        buf = sanitizer.StagingBuffer(1 << 16, name="ring0")
        w = buf.lend(0, (4,), torch.float32, name="a")
        w.fill_(1.0)
        a = w.numpy()
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.read(r, 1)  # the parent has written by now
            ok = w.tolist() == [1.0] * 4 and a.tolist() == [1.0] * 4
            os._exit(0 if ok else 3)
        w.fill_(3.0)
        a[0] = 5.0
        os.write(wfd, b"x")
        _, status = os.waitpid(pid, 0)
        print(os.WEXITSTATUS(status), w.tolist())
    """))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "0 [5.0, 3.0, 3.0, 3.0]", proc.stdout


def test_the_map_budget_counts_the_splits_of_retired_windows(monkeypatch):
    """Issue 48, found by a blind user: the budget counted windows only, while each retired one splits its
    mirror (two more maps); a retaining program reached vm.max_map_count and its own allocations failed.
    Now a retired window counts as three maps."""
    from sanitizer.torch_layer import trap_memory

    sanitizer.enable(trap="poison")
    trap_memory.room()
    monkeypatch.setattr(trap_memory, "_warned", False)
    base = trap_memory.stats()["windows"] + 2 * trap_memory.stats()["replaced"]
    monkeypatch.setitem(trap_memory._limits, "max_windows", base + 9)
    buf = StagingBuffer(1 << 16)
    kept = [buf.write(i * 4096, FIRST, f"k{i}") for i in range(3)]  # 3 windows, each on a page of its own
    buf.reuse(0, 3 * 4096, by="next")  # all three retired in place: 3 + 2 * 3 = 9 maps
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        more = buf.write(8 * 4096, FIRST, "more")
    assert any("process maps with the splits" in str(c.message) for c in caught)
    assert buf._memory.window(sanitizer.lease_of(more)) is None  # a plain view: the guard's
    del kept


@pytest.mark.parametrize("pages_of_chunks", [0, 1, 2])
def test_an_empty_lend_at_the_very_end_of_a_trap_buffer_lends(pages_of_chunks):
    """A zero-byte put at a ring's head when the head is the buffer's end (a quarantined ring, trap=poison,
    size a multiple of 2 MiB) asked a chunk mirror past the buffer for 0 bytes and raised "length must be >
    0, got 0" from the put. Its window is now the last page; the view is empty, the buffer's bytes intact."""
    from sanitizer.torch_layer import trap_memory

    sanitizer.enable(trap="poison", halt_on_error=False)
    size = trap_memory._CHUNK * pages_of_chunks or 4096
    buf = StagingBuffer(size, name="end")
    full = buf.write(0, torch.arange(size, dtype=torch.int64).remainder(251).to(torch.uint8), "all")
    empty = buf.lend(size, (0,), torch.uint8, name="empty at the end")
    assert empty.shape == (0,) and empty.sum().item() == 0
    assert torch.equal(full[:251], torch.arange(251, dtype=torch.uint8))
    ring = StagingRing(size, quarantine=1)
    ring.put("whole", torch.ones(size, dtype=torch.uint8))
    assert ring.put("nothing", torch.empty(0, dtype=torch.uint8)).shape == (0,)
