"""safetensors under ``safetensors_ring=N``: get_tensor, get_slice and get_tensors lend ring views; what a kept
view means under safetensors' own contract (an ``emulated_retention``, bit-exact) and the strict one (an error);
transformers' own loading, from a tiny random-config model saved locally (skips without transformers)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import sanitizer
from sanitizer import StaleBorrowError, adapters

safetensors_torch = pytest.importorskip("safetensors.torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RING = 4 * 16 * 16  # one float32[16, 16]: every put reuses the previous tensor's bytes


@pytest.fixture
def ckpt(tmp_path):
    g = torch.Generator().manual_seed(11)
    tensors = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(4)}
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(tensors, path)
    return path, tensors


@pytest.fixture(autouse=True)
def _no_holder_paths_from_other_modules(fresh_triage):
    """Holder paths a walk learned in another module's tests (the engine table's in-process loads) are
    replayed first; each test here starts without them (the naming they change is the test below's)."""
    yield


@pytest.fixture
def emulation():
    def start(**options):
        options.setdefault("safetensors_strict", 0)  # options outlive disable(): say which contract, every time
        options.setdefault("safetensors_ring", RING)
        sanitizer.enable(**options)
        assert "safetensors" in adapters.install_import_hooks()
        from safetensors import safe_open

        return safe_open

    yield start
    adapters.uninstall_import_hooks()


KEPT = {}


@pytest.mark.slow
def test_slices_and_get_tensors_are_ring_views_and_kept_ones_are_reported_not_errors(ckpt, emulation):
    path, tensors = ckpt
    safe_open = emulation()
    f = safe_open(path, framework="pt")  # as transformers does: no with block, __exit__ by hand
    sl = f.get_slice("layers.0.weight")
    assert sl.get_shape() == [16, 16] and sl.get_dtype() == "F32"
    rows = sl[2:5]
    assert sanitizer.is_borrowed(rows) and torch.equal(rows, tensors["layers.0.weight"][2:5])
    for name in tensors:
        KEPT[name] = f.get_slice(name)[...]  # a consumer that keeps every tensor (transformers' parameters)
    # get_tensor over offset_keys(): the dict holds every one at once, more than this ring of one tensor can lend
    # (it would overwrite its own first tensors): handed over owned, counted as not checked
    everything = f.get_tensors()
    assert set(everything) == set(tensors) and not any(sanitizer.is_borrowed(v) for v in everything.values())
    f.__exit__(None, None, None)
    try:
        # safetensors' own contract: keeping is correct, so the kept views were moved onto owned copies
        assert all(torch.equal(KEPT[k], tensors[k]) for k in tensors)
        assert all(torch.equal(everything[k], tensors[k]) for k in tensors)
        assert sanitizer.errors() == [] and sanitizer.retentions() == []
        events = [e for e in sanitizer.report()["events"] if e["kind"] == "emulated_retention"]
        # one per file and holder: each view named by what holds it (rows, KEPT)
        assert sum(e["count"] for e in events) == 1 + len(tensors)
        paths = {(e["holder"] or {}).get("path", "") for e in events}
        assert any("KEPT" in p for p in paths), paths
        unchecked = [e for e in sanitizer.report()["events"] if e["kind"] == "unchecked_load"]
        assert [(e["entry"], e["tensors"]) for e in unchecked] == [
            (f"safetensors.safe_open.get_tensors (a dict larger than safetensors_ring={RING})", len(tensors))]
        assert all("correct under safetensors' own" in e["summary"] for e in events)
    finally:
        KEPT.clear()


def test_strict_contract_makes_a_kept_view_a_stale_use(ckpt, emulation):
    path, tensors = ckpt
    safe_open = emulation(safetensors_strict=1)
    with safe_open(path, framework="pt") as f:
        first = f.get_slice("layers.0.weight")[:]
        second = f.get_tensor("layers.1.weight")  # the ring comes round onto first's bytes
        assert torch.equal(second, tensors["layers.1.weight"])
        with pytest.raises(StaleBorrowError):
            first.sum()
    with pytest.raises(StaleBorrowError):
        second.sum()


def test_a_consumer_that_copies_each_tensor_is_clean_in_both_modes(ckpt, emulation):
    path, tensors = ckpt
    for strict in (0, 1):
        safe_open = emulation(safetensors_strict=strict)
        params = {k: torch.empty_like(v) for k, v in tensors.items()}
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                params[k].copy_(f.get_slice(k)[:])
        assert all(torch.equal(params[k], tensors[k]) for k in tensors)
        assert sanitizer.errors() == [] and not [e for e in sanitizer.report()["events"]
                                                 if e["kind"] == "emulated_retention"]
        adapters.uninstall_import_hooks()


LOAD = textwrap.dedent("""
    import json, sys, torch, transformers
    from transformers.modeling_utils import load_state_dict
    from safetensors.torch import load_file
    path = sys.argv[1]
    ref = load_file(path + "/model.safetensors")
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    sd = model.state_dict()
    direct = load_state_dict(path + "/model.safetensors")
    print(json.dumps({"from_pretrained": sum(not torch.equal(sd[k], ref[k]) for k in ref),
                      "load_state_dict": sum(not torch.equal(direct[k], ref[k]) for k in ref), "n": len(ref)}))
""")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed here")
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)  # no hub: a random model, saved locally
    return path


def _ownsan(tmp_path, model, *options):
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env.update(PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    args = [sys.executable, "-m", "sanitizer", "run", "-q", "--report", str(report)]
    for option in options:
        args += ["-o", option]
    proc = subprocess.run(args + ["--", sys.executable, str(script), model], env=env, capture_output=True,
                          text=True, timeout=300)
    with open(report, encoding="utf-8") as fh:
        return proc, json.loads(proc.stdout.strip().splitlines()[-1]), json.load(fh)


def test_transformers_from_pretrained_under_the_emulation(tmp_path, tiny_model):
    """from_pretrained keeps get_slice(...)[...] as the model's parameters; load_state_dict keeps get_tensor in a
    dict: retentions under the emulated contract, correct under safetensors' own: reported, bit-exact, exit 0."""
    proc, result, rep = _ownsan(tmp_path, tiny_model, f"safetensors_ring={64 * 32 * 4}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["from_pretrained"] == 0 and result["load_state_dict"] == 0
    assert rep["error_count"] == 0 and rep["summary"]["retentions"] == 0
    found = [e for e in rep["events"] if e["kind"] == "emulated_retention"]
    # One event per file and holder: each view is named by what holds it (a norm's weight as the norm's)
    assert sum(e["count"] for e in found) == 2 * result["n"]
    holders = {(e.get("holder") or {}).get("path") or "" for e in found}
    assert any(h.endswith(".weight") and "Linear" in h for h in holders), holders  # the model's parameters
    assert any("state_dict" in h for h in holders), holders  # load_state_dict's dict
    assert rep["summary"]["emulated_retentions"] == 2 * result["n"]


def test_load_file_is_left_alone_and_counted_as_unchecked_in_the_summary(ckpt, emulation):
    """``load_file`` (peft's and diffusers' way in) returns owned tensors by contract and is never
    emulated: the run says how many such loads it did not check and why, instead of passing silently."""
    from sanitizer.reporting.report import summarize

    path, tensors = ckpt
    emulation()
    from safetensors.torch import load_file

    before = sanitizer.report()["events"]
    a, b = load_file(path), load_file(path)
    assert all(torch.equal(a[k], tensors[k]) and torch.equal(b[k], tensors[k]) for k in tensors)
    assert not sanitizer.is_borrowed(a["layers.0.weight"])  # owned: nothing to check
    rep = sanitizer.report()
    new = [e for e in rep["events"] if e["kind"] == "unchecked_load" and e not in before]
    assert len(new) == 1 and (new[0]["count"], new[0]["tensors"], new[0]["bytes"]) == (2, 8, 8 * 16 * 16 * 4)
    line = summarize({"events": new, "errors": []})["line"]
    assert "2 loads not checked (safetensors.torch.load_file: 8 tensors, 8.0 KiB; owned tensors" in line, line
    assert new[0]["first_at"]["file"] == os.path.abspath(__file__)
    sanitizer.disable()


# -- issue 49: a generator between the loader and the consumer (vLLM 0.32's WeightsMapper.apply()) ----------
STACKED = {"layers.2.weight": ["q", "k"]}  # the file's last tensor but one is a stacked (sharded) one


def _weights_mapper_apply(weights, stacked):
    """vLLM 0.32.0's ``WeightsMapper.apply()`` (vllm/model_executor/models/utils.py), its shape: a generator
    whose locals ``data`` and ``shard_data`` still hold the previous tensor while it asks the loader for the
    next one (and, after the file's last tensor, while the loader closes the file)."""
    for name, data in weights:
        shard_ids = stacked.get(name)
        if shard_ids is None:
            yield name, data
            continue
        for i, one_shard_id in enumerate(shard_ids):
            shard_data = data if i == 0 else data.detach()
            yield f"{name}.{one_shard_id}", shard_data


def _safetensors_weights_iterator(safe_open, path):
    """vLLM's default loader's ``safetensors_weights_iterator``: ``get_tensor`` per key inside the ``with``."""
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _emulated(rep):
    return [e for e in rep["events"] if e["kind"] == "emulated_retention"]


@pytest.mark.parametrize("strict", [0, 1])
def test_a_generator_that_passes_weights_on_keeps_nothing_in_either_mode(ckpt, emulation, strict):
    """vLLM's case: a ring that holds the whole file, so only the close frees what the generator's locals hold
    (``shard_data`` the stacked tensor, ``data`` the last one). The generator ends as the loader's ``next()``
    returns, before anything can read them: not a retention under the borrowed contract, so neither mode
    reports one (the default mode reported both as emulated retentions, held at the close; strict, nothing)."""
    path, tensors = ckpt
    safe_open = emulation(safetensors_strict=strict, safetensors_ring=len(tensors) * RING)
    params = {}
    for name, t in _weights_mapper_apply(_safetensors_weights_iterator(safe_open, path), STACKED):
        params[name] = t.clone()  # a consumer that copies each tensor before the next (vLLM's weight_loader)
    assert torch.equal(params["layers.3.weight"], tensors["layers.3.weight"])
    assert torch.equal(params["layers.2.weight.k"], tensors["layers.2.weight"])
    rep = sanitizer.report(final=True)
    assert sanitizer.errors() == [] and sanitizer.retentions() == []
    assert _emulated(rep) == [], [e["summary"] for e in _emulated(rep)]


@pytest.mark.parametrize("strict", [0, 1])
def test_a_loop_variable_rebound_at_each_reuse_is_not_kept_and_both_modes_agree(ckpt, emulation, strict):
    """A ring of one tensor: every lend reuses the previous tensor's bytes while ``data`` still holds it
    (rebound as the lend returns: forgotten in both modes; the default mode reported each one). ``shard_data``
    is not rebound by the next, unstacked, tensor: it still holds the stacked one after that tensor's turn,
    so both modes report that one view, held by ``shard_data`` (a dead local, never read again: see
    docs/loaders.md, vLLM 0.32.0)."""
    path, tensors = ckpt
    safe_open = emulation(safetensors_strict=strict)
    for name, t in _weights_mapper_apply(_safetensors_weights_iterator(safe_open, path), STACKED):
        t.clone()
    rep = sanitizer.report(final=True)
    assert sanitizer.errors() == []
    found = [r for r in rep["events"] if r["kind"] == ("retention" if strict else "emulated_retention")]
    names = sorted(n for r in found for n in (r.get("leases") or [r.get("lease", {}).get("name")]))
    paths = {(r.get("holder") or {}).get("path", "") for r in found}
    assert names == ["layers.2.weight"], (names, paths)
    assert all("shard_data" in p for p in paths), paths


KEPT_BY_CONSUMER = {}


@pytest.mark.parametrize("strict", [0, 1])
def test_a_consumer_that_keeps_what_the_generator_passes_on_is_reported_in_both_modes(ckpt, emulation, strict):
    """The same generator, a consumer that keeps every tensor: four views kept (the two shards share one),
    named at the consumer's dict in both modes: emulated retentions by default, retentions when strict."""
    path, tensors = ckpt
    safe_open = emulation(safetensors_strict=strict)
    try:
        for name, t in _weights_mapper_apply(_safetensors_weights_iterator(safe_open, path), STACKED):
            KEPT_BY_CONSUMER[name] = t
        rep = sanitizer.report(final=True)
        if strict:
            found = [r for r in rep["events"] if r["kind"] == "retention"]
            assert len(found) == len(tensors) and not _emulated(rep)
            paths = {(r.get("holder") or {}).get("path", "") for r in found}
        else:
            assert torch.equal(KEPT_BY_CONSUMER["layers.0.weight"], tensors["layers.0.weight"])
            found = _emulated(rep)
            assert sum(e["count"] for e in found) == len(tensors) and sanitizer.retentions() == []
            paths = {(e.get("holder") or {}).get("path", "") for e in found}
        assert paths and all("KEPT_BY_CONSUMER" in p for p in paths), paths
    finally:
        KEPT_BY_CONSUMER.clear()


@pytest.mark.parametrize("strict", [pytest.param(0, marks=pytest.mark.xfail(strict=True, reason=(
    "open: the default (emulated) mode's own naming puts first the holder that held the view at its reuse, "
    "the generator's local, before the consumer a walk finds beside it"))), 1])
def test_a_consumer_is_named_though_an_earlier_load_taught_the_generators_local(ckpt, emulation, strict):
    """The first load leaves ``shard_data`` holding a view (the test above): its path is remembered. The next
    load's consumer keeps every tensor: a known path reaching the stacked tensor through that generator local
    named it alone, without the walk that finds the consumer beside it (1 run in 2 after other engine tests)."""
    from sanitizer.features import triage

    path, tensors = ckpt
    safe_open = emulation(safetensors_strict=strict)
    for name, t in _weights_mapper_apply(_safetensors_weights_iterator(safe_open, path), STACKED):
        t.clone()
    kind = "retention" if strict else "emulated_retention"
    rep = sanitizer.report(final=True)
    assert any("shard_data" in (r.get("holder") or {}).get("path", "") for r in rep["events"] if r["kind"] == kind)
    triage.reset(records_too=True)  # the findings go; the holder paths learned stay, as in a long process
    try:
        for name, t in _weights_mapper_apply(_safetensors_weights_iterator(safe_open, path), STACKED):
            KEPT_BY_CONSUMER[name] = t
        rep = sanitizer.report(final=True)
        paths = {(r.get("holder") or {}).get("path", "") for r in rep["events"] if r["kind"] == kind}
        assert paths and all("KEPT_BY_CONSUMER" in p for p in paths), paths
    finally:
        KEPT_BY_CONSUMER.clear()


@pytest.mark.parametrize("strict", [0, 1])
def test_a_module_level_loop_variable_left_on_the_last_tensor_is_not_kept_in_either_mode(ckpt, strict):
    """A script's own loop at module level (``for k in f.keys(): t = f.get_tensor(k)``) leaves the global ``t``
    on the last tensor when the file closes. The strict mode never called it a retention (a global of the code
    that ran the close, as a loop variable is); the default mode reported it as an emulated retention, though
    docs/loaders.md says both modes decide the same views. A module-level list that keeps views is still
    reported, in both modes, at a report during the run and at exit."""
    from tests.conftest import run_python

    path, tensors = ckpt
    code = textwrap.dedent(f"""
        import sanitizer
        from safetensors import safe_open
        keep, kind = [], "retention" if {strict} else "emulated_retention"
        def found(final):
            events = sanitizer.report(final=final)["events"]
            return sum(e.get("count", 1) for e in events if e["kind"] == kind)
        with safe_open({path!r}, framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                t.sum()
        print(found(False), found(True))
        with safe_open({path!r}, framework="pt") as f:
            for i, k in enumerate(f.keys()):
                t = f.get_tensor(k)
                if i % 2:
                    keep.append(t)
        print(found(True))  # (strict decides the view kept at the close at the next lend or at exit)
    """)
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1",
                             "OWNERSHIP_SANITIZE_OPTIONS": f"safetensors_ring={RING},safetensors_strict={strict}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "0", "2"], proc.stdout + proc.stderr


@pytest.mark.parametrize("strict", [0, 1])
def test_a_one_line_loop_in_a_dash_c_script_is_not_kept_at_exit(ckpt, tmp_path, strict):
    """A blind user's case: ``python -c`` with ``for k in f.keys(): t = f.get_tensor(k)`` on one line was an
    emulated retention at exit (``__main__.t``, holder lives at ?): the module of a ``-c`` script has no file,
    and the loop rule looked for one."""
    from tests.conftest import run_python

    path, _ = ckpt
    report = str(tmp_path / "r.json")
    code = (f"from safetensors import safe_open\nwith safe_open({path!r}, 'pt') as f:\n"
            f"    for k in f.keys(): t = f.get_tensor(k)\n")
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS":
                             f"safetensors_ring={RING},safetensors_strict={strict},report={report}"})
    assert proc.returncode == 0, proc.stderr
    with open(report) as fh:
        events = json.load(fh)["events"]
    assert [e for e in events if e["kind"] in ("retention", "emulated_retention")] == []


def test_a_dict_comprehension_that_keeps_every_view_is_named_once_it_is_built(ckpt, tmp_path):
    """A blind user's case: ``res = {k: f.get_tensor(k) for k in f.keys()}`` through a small ring was reported
    as kept by "<held where Python cannot see: a list a comprehension is still building>" (the ring passed
    its views while the comprehension ran); the strict mode named ``__main__.res[*]``. Such a view is named
    again at the report, once the dict is built and bound."""
    from tests.conftest import run_python

    path, tensors = ckpt
    report = str(tmp_path / "r.json")
    code = (f"from safetensors import safe_open\nwith safe_open({path!r}, 'pt') as f:\n"
            f"    res = {{k: f.get_tensor(k) for k in f.keys()}}\nprint(sum(float(v.sum()) for v in res.values()))\n")
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1",
                             "OWNERSHIP_SANITIZE_OPTIONS": f"safetensors_ring={RING},report={report}"})
    assert proc.returncode == 0, proc.stderr
    with open(report) as fh:
        events = [e for e in json.load(fh)["events"] if e["kind"] == "emulated_retention"]
    assert sum(e["count"] for e in events) == len(tensors), events
    assert {e["holder"]["consumer"] for e in events} == {"__main__.res[*]"}, [e["holder"] for e in events]


def _in_ring(t, ring_segments):
    """Do ``t``'s bytes lie in one of the ring's segments' memory?"""
    ptr = t.data_ptr()
    return any(seg.tensor.data_ptr() <= ptr < seg.tensor.data_ptr() + seg.nbytes for seg in ring_segments)


def test_under_safetensors_own_contract_each_tensor_is_lent_where_safetensors_made_it(ckpt, emulation):
    """No copy into the ring (issue 52: the copy was a whole extra pass over the checkpoint), yet the ring's
    bookkeeping is the same: each view is a lease at the ring's offsets, reused as the ring comes round, and
    one still held there is reported kept; a strict ring copies (its bytes must change under a held view)."""
    path, tensors = ckpt
    safe_open = emulation(safetensors_ring=2 * RING)
    with safe_open(path, framework="pt") as f:
        first = f.get_tensor("layers.0.weight")
        segments = list(f._ring.segments)
        lease = sanitizer.lease_of(first)
        assert lease is not None and (lease.start, lease.end) == (0, RING)  # at the ring's offsets
        assert sanitizer.is_borrowed(first) and not _in_ring(first, segments)
        assert first.untyped_storage().nbytes() == RING and torch.equal(first, tensors["layers.0.weight"])
        # a slice (a view into the whole tensor's mapping) is lent in place too, under a storage of its own:
        # a write through it is seen by a later read of that name, as without the sanitizer (a blind user's test)
        rows = f.get_slice("layers.1.weight")[2:5]
        assert sanitizer.is_borrowed(rows) and not _in_ring(rows, f._ring.segments)
        assert torch.equal(rows, tensors["layers.1.weight"][2:5])
        cols = f.get_slice("layers.1.weight")[:, 2:5]  # strided as safetensors lays it out
        assert cols.stride() == (16, 1) and torch.equal(cols, tensors["layers.1.weight"][:, 2:5])
        rows.add_(1)
        assert torch.equal(f.get_tensor("layers.1.weight")[2:5], tensors["layers.1.weight"][2:5] + 1)
        for k in ("layers.2.weight", "layers.3.weight"):  # the ring comes round onto first's offsets
            assert torch.equal(f.get_tensor(k), tensors[k])
    assert torch.equal(first, tensors["layers.0.weight"]) and sanitizer.errors() == []
    events = [e for e in sanitizer.report()["events"] if e["kind"] == "emulated_retention"]
    assert sum(e["count"] for e in events) == 3, events  # first (at the ring's turn), rows and cols (the close)
    safe_open = emulation(safetensors_strict=1)
    with safe_open(path, framework="pt") as f:
        strict = f.get_tensor("layers.0.weight")
        assert _in_ring(strict, f._ring.segments)


def test_a_checksum_hashes_the_bytes_an_in_place_view_reads(ckpt, emulation):
    """checksum=1 over a view lent in place hashes that view's own bytes (not the ring's unused memory): a
    correct load verifies clean, and a write through the view is a mismatch at verify()."""
    path, tensors = ckpt
    safe_open = emulation(checksum=1)
    with safe_open(path, framework="pt") as f:
        view = f.get_tensor("layers.0.weight")
        assert not _in_ring(view, f._ring.segments)
        sanitizer.verify(view)  # the bytes it was lent with: clean
        view[0, 0] += 1  # bytes changed behind the lend
        with pytest.raises(sanitizer.BorrowCorruptedError):
            sanitizer.verify(view)


@pytest.mark.parametrize("threads", [0, 4])
def test_a_loop_variable_left_on_a_files_last_tensor_is_not_kept_though_later_files_load(ckpt, threads):
    """A blind user's cases (issue 52): ``for k in f.keys(): t = f.get_tensor(k)`` leaves ``t`` on the file's
    last tensor; a later file's load (a script's, or 4 threads each loading the file 3 times) decided that view
    at its lends, with no look at what held it, and reported the loop's variable as a keeper (1 of 1; 9-11 of
    12 in threads, where another thread's lend also decided a view before its own thread had rebound the
    variable). A list that keeps views is still counted, exactly."""
    from tests.conftest import run_python

    path, tensors = ckpt
    code = textwrap.dedent(f"""
        import threading, sanitizer
        from safetensors import safe_open
        keep = []
        def load(times):
            for _ in range(times):
                with safe_open({path!r}, framework="pt") as f:
                    for k in f.keys():
                        t = f.get_tensor(k)
                        t.clone()
        if {threads}:
            workers = [threading.Thread(target=load, args=(3,)) for _ in range({threads})]
            [w.start() for w in workers]; [w.join() for w in workers]
        else:
            with safe_open({path!r}, framework="pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    t.clone()
            load(2)  # later files, while the global t is still on the first file's last tensor
        with safe_open({path!r}, framework="pt") as f:
            for i, k in enumerate(f.keys()):
                u = f.get_tensor(k)
                if i % 2:
                    keep.append(u)
        events = sanitizer.report(final=True)["events"]
        print(sum(e["count"] for e in events if e["kind"] == "emulated_retention"))
    """)
    # (threads: a ring of the whole file, so that only the closes pass a held view, as in the user's case; a ring
    # that comes round inside each thread's loop still reports 0-3 of 48 passed views, held by what the walk
    # cannot name: docs/limitations.md)
    ring = RING * (len(tensors) if threads else 1)
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": f"safetensors_ring={ring}"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(len(tensors) // 2)], proc.stdout + proc.stderr
