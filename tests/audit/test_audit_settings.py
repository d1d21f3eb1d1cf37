"""``[tool.ownsan]`` in pyproject.toml: producers, consumer entry points, per-path ignores, --show-settings,
and bad settings named in one line with exit status 2."""
from __future__ import annotations

import textwrap

import pytest

from sanitizer.audit import audit_paths
from sanitizer.audit.cli import main
from sanitizer.audit.settings import SettingsError, resolve


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """The audit never touches the sanitizer's runtime."""
    yield


CODE = textwrap.dedent('''
    class Container:
        def set_dependency(self, dep_name, dep_value):
            setattr(self.param, dep_name, dep_value)

    class Policy:
        def populate(self):
            kept = []
            for name, p in self._checkpoint_engine.parameters():
                kept.append(p)
            return kept
''')
CONFIG = textwrap.dedent('''
    [project]
    name = "x"

    [tool.ownsan]
    producers = ["_checkpoint_engine.parameters"]
    consumers = ["Container.set_dependency:dep_value"]

    [tool.ownsan.per-path-ignores]
    "src/vendored_*.py" = ["OWN102"]
''')


def _project(tmp_path, config=CONFIG):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text(CODE)
    (tmp_path / "src" / "vendored_m.py").write_text(CODE)
    (tmp_path / "pyproject.toml").write_text(config)
    return tmp_path


def test_without_settings_the_project_loader_names_mean_nothing(tmp_path):
    root = _project(tmp_path, "[project]\nname = 'x'\n")
    assert audit_paths([str(root / "src")], settings=resolve([str(root / "src")])).findings == []


def test_configured_producers_consumers_and_per_path_ignores(tmp_path):
    root = _project(tmp_path)
    result = audit_paths([str(root / "src")], settings=resolve([str(root / "src")]))
    got = sorted((p.rsplit("/", 1)[1], f.line, f.code) for f in result.findings for p in [f.path])
    assert got == [("m.py", 4, "OWN102"), ("m.py", 10, "OWN101"), ("vendored_m.py", 10, "OWN101")]
    assert result.suppressed == 1


def test_show_settings_and_cli_use_the_nearest_pyproject(tmp_path, capsys, monkeypatch):
    root = _project(tmp_path)
    monkeypatch.chdir(root)
    assert main(["--show-settings", "src"]) == 0
    out = capsys.readouterr().out
    assert "pyproject.toml" in out and "_checkpoint_engine.parameters" in out
    assert "Container.set_dependency:dep_value=tensor" in out and "src/vendored_*.py: OWN102" in out
    assert main(["--format", "concise", "src"]) == 1
    assert "src/m.py:4:" in capsys.readouterr().out


@pytest.mark.parametrize("table, needle", [
    ('producers = "x"\nconsumers = ["NoColon"]', "consumers entry 'NoColon'"),
    ('consumers = ["A.f:w=blob"]', "consumers entry 'A.f:w=blob'"),
    ('colour = 1', "unknown key 'colour'"),
    ('[tool.ownsan.per-path-ignores]\n"a/*" = ["OWN999"]', "'OWN999'"),
    ('producers = [', "not valid TOML"),
    ('producers = ["weights.get_tensor=blob"]', "producers entry 'weights.get_tensor=blob'"),
    ('suppressions = ["a.txt"]', "suppressions must be a file name"),
])
def test_bad_settings_are_one_named_line_and_exit_2(tmp_path, capsys, table, needle):
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text(f"[tool.ownsan]\n{table}\n")
    with pytest.raises(SettingsError):
        resolve([str(tmp_path / "m.py")])
    assert main([str(tmp_path / "m.py")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_config_option_names_a_missing_file(tmp_path, capsys):
    (tmp_path / "m.py").write_text("x = 1\n")
    assert main(["--config", str(tmp_path / "nope.toml"), str(tmp_path / "m.py")]) == 2
    assert "nope.toml" in capsys.readouterr().err


GETTER_CODE = textwrap.dedent('''
    import torch
    from dataclasses import dataclass
    from torch import nn


    @dataclass
    class Scales:
        k: torch.Tensor
        v: torch.Tensor


    class Norm(nn.Module):
        def __init__(self, weight, eps):
            super().__init__()
            self.weight = nn.Parameter(weight)          # kept by a module: the fix belongs here
            self.eps = eps

        @classmethod
        def load(cls, prefix, weights, eps=1e-6):
            weight = weights.get_tensor(f"{prefix}.weight")
            return cls(weight, eps)                     # hands it to the constructor


    class Plain:
        def __init__(self, weight):
            self.weight = weight


    def load_scales(weights, prefix):
        k = weights.get_tensor(f"{prefix}.k_scale")
        v = weights.get_tensor(f"{prefix}.v_scale")
        return Scales(k=k, v=v)                         # an object built around what this call fetched


    def load_bias(weights, prefix):
        return weights.get_tensor(f"{prefix}.bias")     # handed on: the caller's step


    def summed(weights, prefix):
        parts = [weights.get_tensor(f"{prefix}.{i}") for i in range(2)]
        return Plain(torch.cat(parts))                  # a copy


    class Loader:
        def get_weights(self, weights, prefix):
            # a producer's own definition (TGI's weights loaders): what it returns is borrowed by contract
            return Scales(k=weights.get_tensor(prefix), v=weights.get_tensor(prefix))


    def transient(weights, prefix):
        w = Plain(weights.get_tensor(prefix))           # a plain object that dies in the call
        return w.weight.shape
''')
GETTER_CONFIG = '[tool.ownsan]\nproducers = ["weights.get_tensor=tensor", "weights.get_weights=tensor"]\n'


def test_a_getter_producer_returns_one_tensor_valid_for_the_call(tmp_path):
    """TGI's shape: a `Weights` object whose getters return one borrowed tensor a call. With the getter
    declared `=tensor`, a module constructor that keeps it is found at its own store, a dataclass built
    around it and returned is found in the function that fetched it, and handing it on is not."""
    (tmp_path / "m.py").write_text(GETTER_CODE)
    (tmp_path / "pyproject.toml").write_text(GETTER_CONFIG)
    result = audit_paths([str(tmp_path / "m.py")], settings=resolve([str(tmp_path / "m.py")]))
    got = sorted((f.function, f.line, f.code) for f in result.findings)
    assert got == [("Norm.__init__", 16, "OWN102"), ("load_scales", 33, "OWN101")], got
    assert "returned by `weights.get_tensor(" in " ".join(link.text for link in result.findings[0].chain)
    # declared as an iterator (the default kind), the same getter yields pairs: nothing is a tensor
    (tmp_path / "pyproject.toml").write_text(GETTER_CONFIG.replace("=tensor", ""))
    assert audit_paths([str(tmp_path / "m.py")], settings=resolve([str(tmp_path / "m.py")])).findings == []


# issue 50, pattern 1: a declared helper producer whose definition is audited ---------------------------------

HELPER_CODE = '''
import torch
from torch import nn


class Linear(nn.Module):
    def load_weight(self, weights):
        return weights.get_tensor(self.prefix + ".weight").half()

    def load_multi(self, weights, names):
        out = {}
        for n in names:
            out[n] = weights.get_tensor(n)
        return out

    def load(self, weights):
        w = self.load_weight(weights)
        self.weight = w

    def load_experts(self, weights, n):
        experts = []
        for i in range(n):
            tensors = self.load_multi(weights, [f"e{i}.w1", f"e{i}.w2"])
            tensors["scale"] = torch.ones(1)
            experts.append(tensors)
        self.experts = torch.stack([e["w1"] for e in experts])
'''
HELPER_CONFIG = ('[tool.ownsan]\nproducers = ["weights.get_tensor=tensor", "self.load_weight=tensor", '
                 '"self.load_multi=tensor"]\n')


def test_a_declared_helper_producer_keeps_its_conversion_and_its_dict(tmp_path):
    """Issue 50, pattern 1 (the part left open): a module's loader helper returns a getter's tensor through
    `.half()`, another returns a dict it fills; both declared `=tensor`. The store of the first is OWN107
    (the helper's `.half()` is a no-op on a half-precision checkpoint: its definition, audited, refines the
    declared kind), and a store under a string key into the returned dict is no in-place write (OWN120).
    Before: OWN102 at line 18 (the module names no loader API, so inference never read the helper, and the
    declared kind was taken as it was) and OWN120 at line 24."""
    (tmp_path / "m.py").write_text(HELPER_CODE)
    (tmp_path / "pyproject.toml").write_text(HELPER_CONFIG)
    found = audit_paths([str(tmp_path / "m.py")], settings=resolve([str(tmp_path / "m.py")])).findings
    by_line = {(f.line, f.code) for f in found}
    assert (18, "OWN107") in by_line and (18, "OWN102") not in by_line  # `self.weight = w`
    assert not any(f.code == "OWN120" for f in found)  # `tensors["scale"] = ...` stores into the dict
    assert (25, "OWN101") in by_line  # `experts.append(tensors)`: every expert's dict kept past its step
    # declared with no kind (an iterator), the helper is left as declared: inference refines only `=tensor`
    (tmp_path / "pyproject.toml").write_text(HELPER_CONFIG.replace('"self.load_weight=tensor"', '"self.load_weight"'))
    kept = audit_paths([str(tmp_path / "m.py")], settings=resolve([str(tmp_path / "m.py")])).findings
    assert not any(f.line == 18 for f in kept)


def test_show_settings_names_each_producers_kind(tmp_path, capsys):
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text('[tool.ownsan]\nproducers = ["a.stream", "w.get_tensor=tensor"]\n')
    assert main(["--show-settings", str(tmp_path / "m.py")]) == 0
    assert "producers: a.stream=iterator, w.get_tensor=tensor" in capsys.readouterr().out


# issue 46 (9): `tool.ownsan` is found in every TOML spelling, and a value that is no table is named ----------

@pytest.mark.parametrize("toml, needle", [
    ("[tool]\nownsan = 3\n", "tool.ownsan must be a table"),
    ('tool.ownsan = "producers"\n', "tool.ownsan must be a table"),
    ("[tool]\nownsan = [1]\n", "tool.ownsan must be a table"),
    ("tool = { ownsan = true }\n", "tool.ownsan must be a table"),
    ("[tool]\nownsan.colour = 1\n", "unknown key 'colour'"),
    ("tool.ownsan.colour = 1\n", "unknown key 'colour'"),
    ('[tool."ownsan"]\ncolour = 1\n', "unknown key 'colour'"),
    ("tool = { ownsan = { colour = 1 } }\n", "unknown key 'colour'"),
    ("[tool]\nownsan = { producers = [\n", "not valid TOML"),
], ids=["int", "dotted-str", "array", "inline-bool", "dotted-key", "dotted-top", "quoted", "inline", "broken"])
def test_every_toml_spelling_of_tool_ownsan_is_read_and_a_bad_value_named(tmp_path, capsys, toml, needle):
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text(toml + '\n[project]\nname = "x"\n')
    with pytest.raises(SettingsError):
        resolve([str(tmp_path / "m.py")])
    for argv in ([str(tmp_path / "m.py")], ["--show-settings", str(tmp_path / "m.py")],
                 ["--config", str(tmp_path / "pyproject.toml"), str(tmp_path / "m.py")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "pyproject.toml" in err and err.count("\n") == 1 and "Traceback" not in err, err
    if "must be a table" in needle:  # the line names the value it got
        value = toml.split("ownsan = ")[1].strip().rstrip("}").strip()
        assert f"got {value}".replace("true", "True").replace('"', "'") in err, err


@pytest.mark.parametrize("spelling", [
    '[tool]\nownsan = {{ producers = {producers}, consumers = {consumers} }}\n',
    'tool.ownsan.producers = {producers}\ntool.ownsan.consumers = {consumers}\n',
    '[tool."ownsan"]\nproducers = {producers}\nconsumers = {consumers}\n',
], ids=["inline", "dotted", "quoted"])
def test_settings_in_any_toml_spelling_are_used(tmp_path, capsys, spelling):
    config = spelling.format(producers='["_checkpoint_engine.parameters"]',
                             consumers='["Container.set_dependency:dep_value"]')
    root = _project(tmp_path, config)
    settings = resolve([str(root / "src")])
    assert settings.path == str(root / "pyproject.toml")
    assert settings.producers == ("_checkpoint_engine.parameters",)
    got = sorted((f.line, f.code) for f in audit_paths([str(root / "src" / "m.py")], settings=settings).findings)
    assert got == [(4, "OWN102"), (10, "OWN101")]


def test_a_pyproject_that_only_mentions_ownsan_elsewhere_is_no_settings(tmp_path):
    """Another tool's table that runs `ownsan` (or a comment) is not a `tool.ownsan` table, even when the
    file is broken TOML: the search goes on to the next pyproject.toml above."""
    (tmp_path / "pyproject.toml").write_text('[tool.ownsan]\nproducers = ["my_loader.stream"]\n')
    inner = tmp_path / "pkg"
    inner.mkdir()
    (inner / "m.py").write_text("x = 1\n")
    (inner / "pyproject.toml").write_text('# ownsan = 3\n[tool.hatch.envs.lint.scripts]\n'
                                          'audit = "ownsan audit src"\n[broken\n')
    assert resolve([str(inner / "m.py")]).producers == ("my_loader.stream",)


def test_the_file_given_with_config_must_be_valid_toml(tmp_path, capsys):
    """`--config FILE` names the settings file: TOML that does not parse there is that error, even when
    nothing in it spells `ownsan` (it was read as no settings at all)."""
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "conf.toml").write_text("[tool.other\nx = 1\n")
    assert main(["--config", str(tmp_path / "conf.toml"), str(tmp_path / "m.py")]) == 2
    err = capsys.readouterr().err
    assert "conf.toml" in err and "not valid TOML" in err and err.count("\n") == 1


def test_the_runtimes_suppressions_key_is_accepted_read_relative_to_the_file_and_shown(tmp_path, capsys):
    """``suppressions`` (the runtime's file, for ownsan run and the pytest plugin) shares the table: the
    audit must not call it an unknown key, and --show-settings says where it points."""
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "pyproject.toml").write_text('[tool.ownsan]\nsuppressions = "ci/rules.txt"\n')
    assert resolve([str(tmp_path / "m.py")]).suppressions == str(tmp_path / "ci" / "rules.txt")
    assert main(["--show-settings", str(tmp_path / "m.py")]) == 0
    assert f"suppressions (runtime): {tmp_path / 'ci' / 'rules.txt'}" in capsys.readouterr().out
