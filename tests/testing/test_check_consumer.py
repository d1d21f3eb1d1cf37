"""check_consumer: a correct consumer passes bit-exactly; a retaining one fails with the holder, the fix, the
minimal case and a replay line; a corrupted result nothing caught is a miss, never a pass."""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import time

import pytest
import torch
from torch import nn

pytest.importorskip("hypothesis")
safetensors_torch = pytest.importorskip("safetensors.torch")

import sanitizer  # noqa: E402
from sanitizer.testing import (ConsumerCheckError, NondeterministicConsumerError, RetainedBorrowError,  # noqa: E402
                               SanitizerMissError, StreamCase, check_consumer)
from sanitizer.testing.reference.deferred_loader import load_layerwise  # noqa: E402
from sanitizer.testing.strategies import borrowed_streams  # noqa: E402
from sanitizer.torch_layer import records  # noqa: E402

EXAMPLES = 12  # per check: enough to cross every parameter's simplest values; the long run is the benchmark


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(16, 32), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(32), requires_grad=False)
        self.c = nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16), requires_grad=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


def _state_dict():
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in Model().state_dict().items()}


SD = _state_dict()


# -- consumers ---------------------------------------------------------------------------
def copy_into_model(weights):
    model = Model()
    params = dict(model.named_parameters())
    for name, t in weights:
        params[name].copy_(t)
    return model


def owned_dict(weights):
    return {name: sanitizer.own(t) for name, t in weights}


def state_dict_copy(weights):
    model = Model()
    model.load_state_dict({n: t.clone() for n, t in weights})
    return model


def deferred_owning(weights):
    return load_layerwise(Model(), weights, ownership=True)


def deferred_retaining(weights):
    return load_layerwise(Model(), weights, ownership=False)


def returns_views(weights):
    return {name: t for name, t in weights}


def keeps_a_list(weights):
    return list(weights)


def assigns(weights):
    model = Model()
    model.load_state_dict(dict(weights), assign=True)
    return model


KEPT = []


def keeps_in_a_global(weights):
    for _, t in weights:
        KEPT.append(t)


class Cache:
    def __init__(self) -> None:
        self.parked = {}


CACHE = Cache()


def parks_in_an_object(weights):
    model = Model()
    params = dict(model.named_parameters())
    for name, t in weights:
        CACHE.parked[name] = t  # kept "for later", never read: still a retention
        params[name].copy_(t)
    return model


def reads_through_a_raw_pointer(weights):
    """Keeps no tensor, only the previous one's address, and reads it one step later: a path no dispatch mode
    sees (as a C extension would). Over owned copies those bytes are intact; over a ring they were reused."""
    out, prev = {}, None
    for name, t in weights:
        if prev is not None:
            pname, ptr, nbytes, dtype, shape = prev
            raw = bytearray((ctypes.c_char * nbytes).from_address(ptr))
            out[pname] = torch.frombuffer(raw, dtype=dtype).reshape(shape)
        prev = (name, t.data_ptr(), t.numel() * t.element_size(), t.dtype, t.shape)
        out[name] = t.clone()
    return out


def not_deterministic(weights):
    return {name: t.clone() + time.perf_counter_ns() % 7 for name, t in weights}


def fails_anyway(weights):
    raise KeyError("no such parameter")


# -- correct consumers pass ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("consume", [copy_into_model, owned_dict, state_dict_copy, deferred_owning])
def test_a_correct_consumer_passes_every_example_bit_exactly(consume):
    result = check_consumer(consume, SD, examples=EXAMPLES)
    assert result.examples == EXAMPLES and "bit-exact" in str(result)
    assert sanitizer.errors() == [] and sanitizer.retentions() == []


def test_weights_may_be_a_file_a_list_of_files_a_directory_or_pairs(tmp_path):
    names = sorted(SD)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    safetensors_torch.save_file({n: SD[n] for n in first}, str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors_torch.save_file({n: SD[n] for n in second}, str(tmp_path / "model-00002-of-00002.safetensors"))
    files = sorted(str(p) for p in tmp_path.iterdir())
    for weights in (files, str(tmp_path), tmp_path, list(SD.items())):
        assert check_consumer(copy_into_model, weights, examples=3).examples == 3
    torch.save(SD, str(tmp_path / "sd.pt"))
    assert "sd.pt" in check_consumer(copy_into_model, str(tmp_path / "sd.pt"), examples=2).weights


# -- retaining consumers fail, readably --------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("consume, holder", [
    (returns_views, "the value returns_views() returned"),
    (keeps_a_list, "the value keeps_a_list() returned"),
    (assigns, "returned still borrowed"),
    (keeps_in_a_global, "KEPT[*]"),
    (parks_in_an_object, "Cache.parked["),
    (deferred_retaining, "LayerReloadingInfo.loaded_weights["),
])
def test_a_retaining_consumer_fails_with_its_holder_the_fix_the_minimal_case_and_a_replay_line(consume, holder):
    with pytest.raises(RetainedBorrowError) as info:
        check_consumer(consume, SD, examples=EXAMPLES)
    KEPT.clear()
    CACHE.parked.clear()
    err = info.value
    text = str(err)
    assert isinstance(err, AssertionError) and isinstance(err, ConsumerCheckError)
    assert text.startswith(f"check_consumer({consume.__name__}): {consume.__name__} keeps borrowed weights")
    assert holder in text, text
    assert "fix: " in text and "sanitizer.own(t)" in text
    assert "minimal case" in text and "ring " in text and "(the largest tensor)" in text
    assert err.case == StreamCase()  # it fails in the simplest case: that is where hypothesis shrinks to
    assert f"replay: check_consumer({consume.__name__}, weights, replay='{err.replay}')" in text
    assert err.found_at == 1 and err.report is not None and err.report["summary"]["retentions"] > 0


@pytest.mark.slow
def test_the_unsanitized_corruption_and_the_sanitized_stale_reads_are_both_shown():
    with pytest.raises(RetainedBorrowError) as info:
        check_consumer(deferred_retaining, SD, examples=EXAMPLES)
    text = str(info.value)
    assert "sanitizer error" in text and "stale_use" in text and "read stale at" in text
    assert "unsanitized: " in text and "elements differ" in text  # what the bare program would have loaded
    assert info.value.outcome.unsanitized_diff and info.value.outcome.errors_seen > 0


@pytest.mark.slow
def test_shrinking_reports_the_simplest_failing_case_of_the_space_searched():
    streams = borrowed_streams(orders=("sorted", "shuffled"), debug=("checksum+poison",), streams=("borrowed",))
    with pytest.raises(RetainedBorrowError) as info:
        check_consumer(returns_views, SD, examples=EXAMPLES, streams=streams)
    case = info.value.case
    assert (case.order, case.debug, case.stream, case.ring_fraction, case.lifetime) == (
        "sorted", "checksum+poison", "borrowed", 0.0, None)
    assert "debug checksum+poison" in str(info.value) and "borrowed_iterator" in str(info.value)


@pytest.mark.slow
def test_replay_reruns_exactly_that_case():
    with pytest.raises(RetainedBorrowError) as info:
        check_consumer(returns_views, SD, examples=EXAMPLES)
    with pytest.raises(RetainedBorrowError) as again:
        check_consumer(returns_views, SD, replay=info.value.replay)
    assert again.value.case == info.value.case and again.value.found_at is None
    case = StreamCase(order="shuffled", ring_fraction=0.5, lifetime=2, quarantine=1, debug="checksum+poison",
                      stream="borrowed", seed=7)
    assert check_consumer(copy_into_model, SD, replay=case.to_json()).examples == 1
    assert check_consumer(copy_into_model, SD, replay=case).examples == 1


@pytest.mark.parametrize("replay, named", [
    ("{", "not JSON"),
    ('{"order": "backwards"}', "field 'order'"),
    ('{"ring_fraction": 2}', "field 'ring_fraction'"),
    ('{"lifetime": 0}', "field 'lifetime'"),
    ('{"colour": "red"}', "unknown field(s) ['colour']"),
])
def test_a_bad_replay_is_a_value_error_naming_the_field(replay, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_consumer(copy_into_model, SD, replay=replay)


# -- what is neither -------------------------------------------------------------------------
def test_a_corrupted_result_nothing_detected_fails_loudly_as_a_sanitizer_miss():
    with pytest.raises(SanitizerMissError) as info:
        check_consumer(reads_through_a_raw_pointer, SD, examples=EXAMPLES)
    text = str(info.value)
    assert "SANITIZER MISS" in text and "raw data_ptr" in text and "please report it" in text
    assert "elements differ" in text and "replay: " in text
    assert not info.value.outcome.detected


def test_a_nondeterministic_consumer_is_told_so_not_called_a_miss():
    with pytest.raises(NondeterministicConsumerError, match="not deterministic"):
        check_consumer(not_deterministic, SD, examples=EXAMPLES)


def test_a_consumer_that_fails_over_owned_copies_raises_its_own_error():
    with pytest.raises(KeyError, match="no such parameter") as info:
        check_consumer(fails_anyway, SD, examples=2)
    assert any("owned copies" in note for note in getattr(info.value, "__notes__", ["owned copies"]))


@pytest.mark.parametrize("call, error, named", [
    (lambda: check_consumer("load_weights", SD), TypeError, "consume must be callable"),
    (lambda: check_consumer(copy_into_model, SD, examples=0), ValueError, "examples must be an integer >= 1"),
    (lambda: check_consumer(copy_into_model, SD, seed=-1), ValueError, "seed must be None or an integer"),
    (lambda: check_consumer(copy_into_model, SD, deadline=0), ValueError, "deadline must be a number"),
    (lambda: check_consumer(copy_into_model, "/no/such/ckpt.safetensors"), FileNotFoundError, "/no/such/ckpt"),
    (lambda: check_consumer(copy_into_model, {}), ValueError, "hold no tensor"),
    (lambda: check_consumer(copy_into_model, {"w": [1.0]}), TypeError, "weight 'w' is a list"),
    (lambda: check_consumer(copy_into_model, 3), TypeError, "got int: 3"),
])
def test_bad_arguments_are_clear_errors_naming_the_value(call, error, named):
    with pytest.raises(error, match=named):
        call()


def test_a_directory_without_weight_files_names_itself(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        check_consumer(copy_into_model, str(tmp_path))


# -- it leaves the program as it found it ------------------------------------------------------
@pytest.mark.slow
def test_the_check_leaves_state_options_threads_and_records_as_it_found_them():
    threads = torch.get_num_threads()
    buf = sanitizer.StagingBuffer(4096, name="mine")
    with sanitizer.sanitize(halt_on_error=0, stack_depth=3):
        view = buf.lend(0, (4,), torch.float32, "my.weight")
        buf.reuse(0, 16, by="next")
        view.sum()  # the caller's own error, recorded before the check
        mine = sanitizer.errors()
        assert len(mine) == 1
        check_consumer(copy_into_model, SD, examples=3)
        with sanitizer.sanitize(rescue=1):  # a caller's rescue=1 hides no retention, and is kept
            with pytest.raises(RetainedBorrowError):
                check_consumer(returns_views, SD, examples=3)
            assert sanitizer.options()["rescue"] is True
        assert sanitizer.enabled() and sanitizer.options()["stack_depth"] == 3
        assert sanitizer.options()["halt_on_error"] is False
        assert sanitizer.errors() == mine  # the check's own records are gone, the caller's kept
        assert records.record_counts()["errors_seen"] == 1
        assert [e for e in records.events("retention") if e["lease"]["buffer"] != "mine"] == []
    del view
    buf.close()
    assert not sanitizer.enabled() and torch.get_num_threads() == threads and gc.get_freeze_count() == 0


def test_deadline_stops_starting_examples_and_progress_counts_them():
    def slow(weights):
        time.sleep(0.05)
        return copy_into_model(weights)

    seen = []
    result = check_consumer(slow, SD, examples=200, deadline=0.5, progress=lambda d, n, f: seen.append((d, n, f)))
    assert 1 <= result.examples < 200
    assert seen[0] == (1, 200, 0) and seen[-1] == (result.examples, 200, 0)


def test_seeds_choose_other_fixed_cases():
    drawn = {}

    def record(weights):
        names = [n for n, _ in weights]
        drawn.setdefault(key, []).append(tuple(names))
        return None

    for key in ("a", "b"):
        check_consumer(record, SD, examples=20, seed=5)
    key = "c"
    check_consumer(record, SD, examples=20, seed=6)
    assert drawn["a"] == drawn["b"] and drawn["a"] != drawn["c"]


def test_a_borrowed_stream_of_a_case_over_weights():
    from sanitizer.testing import borrowed_stream

    case = StreamCase(order="sorted", ring_fraction=0.0)
    with sanitizer.sanitize(halt_on_error=0):
        with borrowed_stream(SD, case) as weights:
            got = [(name, sanitizer.is_borrowed(t), t.clone()) for name, t in weights]
        assert sanitizer.errors() == []
    assert [n for n, _, _ in got] == sorted(SD) and all(b for _, b, _ in got)
    assert all(torch.equal(t, SD[n]) for n, _, t in got)
    with borrowed_stream(SD, order="interleaved", stream="borrowed") as weights:
        assert [n for n, _ in weights][:2] == ["layers.0.a", "layers.1.a"]
    with pytest.raises(ValueError, match="field 'stream'"):
        borrowed_stream(SD, dataclasses.replace(case), stream="tape")


class _LeftBehind:
    kept = None


def _leaves_a_view_in_a_class_attribute(weights):
    for _, w in weights:
        _LeftBehind.kept = w
    return {}


def _copies_each(weights):
    return {name: w.clone() for name, w in weights}


def test_a_correct_consumer_is_never_blamed_for_a_view_an_earlier_check_left_behind():
    """Issue 29, point 3: the earlier check's consumer keeps its last view in a class attribute; the next
    check (a correct consumer) judges only what its own consumer kept (its buffers have names of their own)."""
    import torch

    weights = {f"layers.{i}.w": torch.randn(16, 16) for i in range(4)}
    with pytest.raises(RetainedBorrowError):
        check_consumer(_leaves_a_view_in_a_class_attribute, weights, examples=10)
    try:
        check_consumer(_copies_each, weights, examples=10)
    finally:
        _LeftBehind.kept = None
