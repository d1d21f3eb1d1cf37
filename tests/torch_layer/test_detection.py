"""Immediate detection: every read or write of a stale lease raises before the op runs."""
from __future__ import annotations

import gc
import json
import threading

import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from tests.conftest import run_python

DERIVED = {
    "view": lambda w: w.view(-1),
    "narrow": lambda w: w.narrow(0, 1, 2),
    "slice": lambda w: w[1:, ::2],
    "t": lambda w: w.t(),
    "detach": lambda w: w.detach(),
    "as_strided": lambda w: w.as_strided((4, 4), (1, 4)),
    "reshape": lambda w: w.reshape(8, 8),
    "unflatten": lambda w: w.unflatten(1, (2, 4)),
    "contiguous": lambda w: w.contiguous(),
    "to_same": lambda w: w.to(torch.float32),
    "select": lambda w: w[2],
    "chain": lambda w: w.t()[:, :3].narrow(0, 1, 4).detach(),
}


def _fresh(buf: StagingBuffer, name: str = "w") -> torch.Tensor:
    return buf.write(0, torch.arange(64, dtype=torch.float32).view(8, 8), name=name)


@pytest.mark.parametrize("kind", sorted(DERIVED))
def test_each_derived_view_raises_when_stale_and_works_when_fresh(kind):
    buf = StagingBuffer(4096, name="ring0")
    w = _fresh(buf)
    d = DERIVED[kind](w)
    expected = d.clone()
    with sanitizer.sanitize():
        assert torch.equal(d * 1, expected)  # fresh: works, same values
        buf.reuse(0, 16, by="next")
        with pytest.raises(StaleBorrowError) as err:
            d * 1
    assert err.value.lease.name == "w" and err.value.op == "aten.mul.Tensor"


OPS = {
    "add": lambda t: t + 1,
    "sum": lambda t: t.sum(),
    "clone": lambda t: t.clone(),
    "index_read": lambda t: t[torch.tensor([0, 1])],
    "item": lambda t: t[0, 0].item(),
    "tolist": lambda t: t.tolist(),
    "float": lambda t: float(t[0, 0]),
    "to_dtype": lambda t: t.to(torch.float16),
    "matmul": lambda t: t @ t,
    "numpy": lambda t: t.numpy(),
    "write_into": lambda t: t.fill_(0.0),
    "copy_into_param": lambda t: torch.nn.Parameter(torch.zeros(8, 8)).data.copy_(t),
    "cat": lambda t: torch.cat([torch.zeros(1, 8), t]),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_stale_use_raises_for_every_kind_of_read_and_write(op):
    buf = StagingBuffer(4096, name="ring0")
    w = _fresh(buf)
    buf.reuse(0, 256, by="next")
    before = buf.tensor[:256].clone()
    with sanitizer.sanitize():
        with pytest.raises(StaleBorrowError):
            OPS[op](w)
    assert torch.equal(buf.tensor[:256], before)  # raised *before* the op ran


def test_metadata_stays_readable_on_a_stale_lease():
    buf = StagingBuffer(4096)
    w = _fresh(buf)
    buf.reuse(0, 8, by="next")
    with sanitizer.sanitize():
        assert w.shape == (8, 8) and w.dtype == torch.float32 and w.device.type == "cpu"
        assert w.stride() == (8, 1) and w.numel() == 64 and w.dim() == 2
        v = w.t()[:2]  # a view re-describes memory without reading it
        assert v.shape == (2, 8)
        assert torch.empty_like(w).shape == w.shape


def test_load_state_dict_of_a_stale_lease_raises_and_a_fresh_one_loads_bit_exactly():
    buf = StagingBuffer(1 << 16, name="ring0")
    src = torch.randn(16, 8, dtype=torch.bfloat16)
    model = torch.nn.Linear(8, 16, bias=False, dtype=torch.bfloat16)
    with sanitizer.sanitize():
        w = buf.write(0, src, name="weight")
        model.load_state_dict({"weight": w})
        assert torch.equal(model.weight.detach().view(torch.int16), src.view(torch.int16))
        buf.write(0, torch.zeros_like(src), name="other.weight")
        # load_state_dict wraps what copy_ raised into its own RuntimeError; the report survives in it
        with pytest.raises(RuntimeError, match="borrowed view 'weight' bfloat16\\[16, 8\\].*in aten.copy_.default"):
            model.load_state_dict({"weight": w})
        assert sanitizer.errors()[-1]["lease"]["name"] == "weight"
        assert torch.equal(model.weight.detach().view(torch.int16), src.view(torch.int16))  # unchanged
        # assign=True keeps the borrowed storage as the parameter; the first read raises
        model.load_state_dict({"weight": w}, assign=True)
        with pytest.raises(StaleBorrowError, match="in aten.(mm|t|addmm|matmul)"):
            model(torch.ones(1, 8, dtype=torch.bfloat16))


def test_threads_started_while_enabled_are_checked_too():
    buf = StagingBuffer(4096)
    w = _fresh(buf)
    buf.reuse(0, 8, by="next")
    caught = []
    with sanitizer.sanitize():
        def consumer():
            try:
                w.sum()
            except StaleBorrowError as err:
                caught.append(err)
        t = threading.Thread(target=consumer)
        t.start()
        t.join()
    assert len(caught) == 1 and caught[0].record["thread"] == t.name


def test_producer_thread_and_consumer_thread_lose_no_event():
    """A producer lends and reuses in a thread while the consumer reads every lease it kept."""
    n = 200
    buf = StagingBuffer(64 * 4, name="ring")
    handoff = []
    ready = threading.Semaphore(0)
    with sanitizer.sanitize(halt_on_error=0):
        def producer():
            for i in range(n):
                handoff.append(buf.write((i % 4) * 64, torch.full((16,), float(i)), name=f"w{i}"))
                ready.release()
        t = threading.Thread(target=producer)
        t.start()
        for _ in range(n):
            ready.acquire()
        t.join()
        for v in handoff:
            v.sum()  # the last 4 are fresh, every earlier one was reused
    lease_names = {e["lease"]["name"] for e in sanitizer.errors()}
    assert lease_names == {f"w{i}" for i in range(n - 4)}
    assert buf.generation == 1 + n


def test_halt_on_error_0_records_and_continues_with_the_report():
    buf = StagingBuffer(4096, name="ring0")
    w = _fresh(buf)
    buf.write(0, torch.full((8, 8), 7.0), name="next")
    with sanitizer.sanitize(halt_on_error=0, max_errors_per_lease=2):
        out = w + 0  # runs on the stale bytes, as unsanitized code would
        for _ in range(4):
            w.sum()
    assert torch.equal(out, torch.full((8, 8), 7.0))
    rep = sanitizer.report()
    json.dumps(rep)  # JSON-ready
    assert rep["error_count"] == 5 and len(rep["errors"]) == 2
    err = rep["errors"][0]
    assert err["kind"] == "stale_use" and err["lease"]["name"] == "w" and err["event"]["by"] == "next"
    assert err["op"] == "aten.add.Tensor" and err["used_at"][0]["function"].startswith("test_halt_on_error")
    assert "w" in [lease["name"] for lease in rep["retained_stale_leases"]]


@pytest.mark.slow
def test_report_file_written_at_exit(tmp_path):
    path = tmp_path / "report-{pid}.json"
    code = (
        "import torch, sanitizer\n"
        "b = sanitizer.StagingBuffer(1024, name='r')\n"
        "w = b.write(0, torch.ones(4), name='w')\n"
        "b.reuse(0, 4, by='x')\n"
        "w.sum()\n"
        "print('ran on')\n"
    )
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": f"halt_on_error=0:report={path}"})
    assert proc.returncode == 0, proc.stderr
    assert "ran on" in proc.stdout
    files = list(tmp_path.glob("report-*.json"))
    assert len(files) == 1
    rep = json.loads(files[0].read_text())
    assert rep["error_count"] == 1 and rep["errors"][0]["op"] == "aten.sum.default"


def test_stacks_name_lend_reuse_and_use_sites():
    buf = StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize():
        w = _fresh(buf)                      # lent here (via _fresh)
        buf.reuse(0, 8, by="next")           # reused here
        with pytest.raises(StaleBorrowError) as err:
            w.sum()                          # used here
    text = str(err.value)
    assert "lent at" in text and "reused at" in text and "used at" in text
    assert err.value.lease.site and err.value.event.site and err.value.used_at
    lent = err.value.record["lease"]["lent_at"]
    assert lent[0]["function"] == "_fresh" and lent[1]["function"] == "test_stacks_name_lend_reuse_and_use_sites"
    assert err.value.record["event"]["stack"][0]["function"] == "test_stacks_name_lend_reuse_and_use_sites"
    assert err.value.record["used_at"][0]["file"].endswith("test_detection.py")  # the user line, not torch


def test_correct_program_is_bit_identical_with_sanitizer_on_and_off():
    def load(ring_bytes: int) -> dict:
        torch.manual_seed(0)
        ring = sanitizer.StagingRing(ring_bytes, name="ring")
        out = {}
        for i in range(12):
            src = torch.randn(32, 16, dtype=torch.bfloat16)
            w = ring.put(f"w{i}", src)
            out[f"w{i}"] = (w.float() * 2).to(torch.bfloat16).clone()  # consumes before the ring advances
        return out

    off = load(4096)
    with sanitizer.sanitize():
        on = load(4096)
    assert sanitizer.errors() == []
    for k in off:
        assert torch.equal(off[k].view(torch.int16), on[k].view(torch.int16))


def test_no_interception_remains_once_no_stale_lease_is_reachable():
    buf = StagingBuffer(4096)
    with sanitizer.sanitize():
        assert torch._C._len_torch_dispatch_stack() == 0  # enabled but nothing borrowed
        w = _fresh(buf)
        assert torch._C._len_torch_dispatch_stack() == 0  # fresh leases cost nothing per op in main
        buf.reuse(0, 8, by="next")
        assert torch._C._len_torch_dispatch_stack() == 1  # a stale lease is reachable: checked
        v = w[1:]
        del w
        assert torch._C._len_torch_dispatch_stack() == 1  # a retained stale view keeps it checked
        del v
        gc.collect()
        assert torch._C._len_torch_dispatch_stack() == 0
        assert not sanitizer.torch_layer.readers.hooked() and "tolist" not in torch.Tensor.__dict__
    assert torch._C._len_torch_dispatch_stack() == 0


def test_disable_removes_the_mode_and_the_thread_hook():
    import threading as th
    orig = th.Thread._bootstrap_inner
    buf = StagingBuffer(4096)
    w = _fresh(buf)
    buf.reuse(0, 8)
    sanitizer.enable()
    assert torch._C._len_torch_dispatch_stack() == 1 and th.Thread._bootstrap_inner is not orig
    sanitizer.disable()
    assert torch._C._len_torch_dispatch_stack() == 0 and th.Thread._bootstrap_inner is orig
    w.sum()  # off means off: nothing checks
    w.tolist()


@pytest.mark.slow
def test_off_means_off_no_numba_no_mode_no_hook():
    code = (
        "import sys, threading, torch\n"
        "orig = threading.Thread._bootstrap_inner\n"
        "import sanitizer\n"
        "b = sanitizer.StagingBuffer(1024)\n"
        "w = b.write(0, torch.ones(4), name='w')\n"
        "b.reuse(0, 4)\n"
        "w.sum()\n"
        "print('numba' in sys.modules, torch._C._len_torch_dispatch_stack(), threading.Thread._bootstrap_inner is orig)\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "0", "True"]
