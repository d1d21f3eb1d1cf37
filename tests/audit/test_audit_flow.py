"""What the audit's flow follows, in detail: the chain from the yielded name to the store, helpers in
the same module, class and other audited modules, and the places where a finding lands."""
from __future__ import annotations

import pytest

import textwrap

from sanitizer.audit import audit_paths, audit_text


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """Overrides conftest's: the audit never touches the sanitizer's runtime (and must not import torch),
    so there is nothing to reset between these tests."""
    yield



def _audit(src: str):
    return audit_text(textwrap.dedent(src), "m.py").findings


def test_a_finding_names_function_pattern_chain_and_fix():
    (f,) = _audit('''
        class Loader:
            def load_weights(self, weights):
                parked = {}
                for name, loaded_weight in weights:
                    shard = loaded_weight.narrow(0, 0, 2)
                    parked[name] = shard
                return parked
    ''')
    assert (f.path, f.line, f.col, f.end_line, f.code) == ("m.py", 7, 13, 7, "OWN101")
    assert f.function == "Loader.load_weights" and f.consumer == "Loader.load_weights"
    assert "parked" in f.message and "outlives" in f.message
    texts = [link.text for link in f.chain]
    assert texts[0].startswith("`weights` is a weights iterator")
    assert any("yielded by `weights`" in t for t in texts) and any(".narrow()" in t for t in texts)
    assert texts[-1] == "`parked[name] = shard`"
    assert "sanitizer.own(t)" in f.fix and "t.clone()" in f.fix


def test_through_a_helper_the_finding_is_in_the_helper_and_names_the_consumer():
    findings = _audit('''
        def _stash(cache, key, tensor):
            cache[key] = tensor

        def load_weights(weights):
            cache = {}
            for name, w in weights:
                _stash(cache, name, w)
            return cache
    ''')
    (f,) = findings
    assert (f.line, f.function, f.consumer) == (3, "_stash", "load_weights")
    assert "through helper `_stash`" in f.pattern
    assert any("passed to `_stash()` as `tensor`" in link.text for link in f.chain)


def test_a_helper_given_a_per_step_container_keeps_nothing():
    assert _audit('''
        import torch

        def _stash(cache, key, tensor):
            cache[key] = tensor

        def load_weights(weights):
            for name, w in weights:
                per_step = {}
                _stash(per_step, name, w)
                yield name, torch.cat(list(per_step.values()))
    ''') == []


def test_an_imported_helper_of_an_audited_module_is_followed(tmp_path):
    (tmp_path / "store.py").write_text("def keep(bucket, t):\n    bucket.append(t)\n")
    (tmp_path / "model.py").write_text(textwrap.dedent('''
        from .store import keep

        class M:
            def load_weights(self, weights):
                bucket = []
                for name, w in weights:
                    keep(bucket, w)
                return bucket
    '''))
    result = audit_paths([str(tmp_path)])
    (f,) = result.findings
    assert f.path.endswith("store.py") and f.line == 2 and f.function == "keep"
    assert f.consumer == "M.load_weights" and f.consumer_path.endswith("model.py")
    assert f.chain[0].path.endswith("model.py") and f.chain[-1].path is None  # links in the caller's file say so
    assert "model.py:" in f.chain[0].render()
    alone = audit_paths([str(tmp_path / "model.py")])  # store.py not audited: not read, nothing claimed
    assert alone.findings == []


def test_a_name_alone_is_not_a_weights_iterator():
    assert _audit('''
        class Indexer:
            def forward(self, hidden, weights):
                weights = weights * self.scale
                self.last = weights
                return hidden @ weights

            def __init__(self, weights):
                first = weights[0]
                self.original = tuple(weights)
    ''') == []


def test_a_weights_loop_in_a_nested_generator_is_found_and_credited_to_the_outer_function():
    (f,) = _audit('''
        class M:
            def load_weights(self, weights):
                extra = []

                def body_weights():
                    for name, w in weights:
                        if name.startswith("head."):
                            extra.append((name, w))
                        else:
                            yield name, w

                self.body.load_weights(body_weights())
                self.head.load_weights(extra)
    ''')
    assert f.function == "M.load_weights.<locals>.body_weights" and f.consumer == "M.load_weights"


def test_qualnames_match_what_python_reports():
    src = textwrap.dedent('''
        def outer(weights):
            class Local:
                def load_weights(self, weights):
                    self.kept = list(weights)
            return Local
    ''')
    (f,) = audit_text(src, "m.py").findings
    ns: dict = {}
    exec(compile(src, "m.py", "exec"), ns)
    assert f.function == ns["outer"](None).load_weights.__qualname__


def test_a_file_that_does_not_parse_is_named(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    (tmp_path / "good.py").write_text("def load_weights(weights):\n    return list(weights)\n")
    result = audit_paths([str(tmp_path)])
    assert len(result.findings) == 1 and len(result.errors) == 1
    assert str(bad) in result.errors[0] and "does not parse" in result.errors[0]


def test_a_dict_of_weights_iterated_whole_gives_names_not_tensors():
    """``list(weights)``, ``sorted(weights)``, ``set(weights)`` of a ``Dict[str, Tensor]`` keep its names: no
    finding; ``list(weights.values())`` and ``dict(weights)`` keep its tensors: findings."""
    found = _audit('''
        from typing import Dict
        import torch
        class Layer:
            def load_hf_weights(self, weights: Dict[str, torch.Tensor]):
                self.names = list(weights)
                self.order = sorted(weights)
                self.seen = set(weights)
                self.kept = list(weights.values())
                self.copy = dict(weights)
    ''')
    assert sorted((f.line, f.code) for f in found) == [(9, "OWN102"), (10, "OWN102")], \
        [(f.line, f.code, f.message) for f in found]


def test_a_dict_of_parameters_is_the_models_own_not_a_weight_source():
    """``params_dict: dict[str, nn.Parameter]`` (built from ``named_parameters()``) is where a loader copies
    to, never what it lends: writing into its entries is no finding (lmdeploy's ``_load_weight_experts``
    gave five false OWN120s), while the loaded tensor kept beside it still is one."""
    found = _audit('''
        import torch
        from torch import nn
        class Model:
            def _load_experts(self, name: str, loaded_weight: torch.Tensor, params_dict: dict[str, nn.Parameter]):
                param = params_dict[name]
                param.data.copy_(loaded_weight)
                params_dict[name].data[:4].copy_(loaded_weight[:4])
                self.kept = loaded_weight
    ''')
    assert [(f.line, f.code) for f in found] == [(9, "OWN102")], [(f.line, f.code, f.message) for f in found]


def test_a_self_call_reaches_the_overrides_in_subclasses_that_still_run_it():
    """``self._process(w)`` in a base class runs a subclass's override for the subclass's instances: what
    the override keeps, the call keeps. A subclass that overrides the calling method itself (without
    ``super()``) never makes that call, so its own override of ``_process`` is not followed from it."""
    found = _audit('''
        from typing import Dict
        import torch
        class Base:
            def load_hf_weights(self, weights: Dict[str, torch.Tensor]):
                self._process(weights["w"])
            def _process(self, w):
                self.weight = w.clone()
        class Keeps(Base):
            def _process(self, w):
                self.weight = w
        class KeepsToo(Keeps):
            pass
        class Fused(Base):
            def load_hf_weights(self, weights: Dict[str, torch.Tensor]):
                self.parts = [weights["a"].clone(), weights["b"].clone()]
                self._process(torch.cat(self.parts))
            def _process(self, w):
                self.weight = w
        class Chained(Fused):
            def load_hf_weights(self, weights: Dict[str, torch.Tensor]):
                super().load_hf_weights(weights)
    ''')
    assert sorted((f.function, f.line, f.code) for f in found) == [("Keeps._process", 11, "OWN102")], \
        [(f.function, f.line, f.code, f.message) for f in found]


def test_an_expression_evaluated_flat_gives_what_the_nested_walk_gives(monkeypatch):
    """Past FLAT_DEPTH nested handlers the flow evaluates an expression's parts first, children before
    parents (so a generated 900-term sum no longer overflows it). Forced on every expression, that order
    must change nothing: the whole corpus, findings with their chains, and the consumers looked at."""
    from pathlib import Path

    from sanitizer.audit import flow

    corpus = str(Path(__file__).resolve().parent.parent / "audit_corpus")

    def seen(result):
        return (sorted((f.path, f.line, f.col, f.code, f.message, f.pattern, tuple(link.text for link in f.chain),
                        tuple(f.also_from)) for f in result.findings),
                sorted((c.path, c.line, c.function, c.why) for c in result.consumers))

    nested = seen(audit_paths([corpus]))
    assert len(nested[0]) > 90
    monkeypatch.setattr(flow, "FLAT_DEPTH", 0)
    assert seen(audit_paths([corpus])) == nested
