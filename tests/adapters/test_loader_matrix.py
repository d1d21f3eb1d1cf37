"""The adapters against every known CPU-installable version of fastsafetensors and runai-model-streamer.

Each version is installed side by side into ``.loaders/<package>-<version>`` by ``.ci/loader_matrix.sh``
(what ``.ci/run`` does first); a missing folder skips, saying so. The scenarios run in one ``ownsan run``
per version (shared with tests/adapters/test_engines.py, see ``matrix_run``): every entry point of the adapter's
contract table, with a consumer that keeps every tensor (caught, its holder named) and one that copies
each tensor before the next (bit-exact, nothing reported); an owning mode is clean either way.
"""
from __future__ import annotations

import os
import re
import textwrap

import pytest

from sanitizer.adapters import fastsafetensors_adapter, runai_adapter
from sanitizer.adapters.contracts import parse_version
from tests.conftest import run_python
from tests.adapters.test_engines import assert_outcome, matrix_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fst_expected(version: str) -> dict:
    v = parse_version(version)
    borrowing_buffer = v < (0, 5, 0)  # 0.5: tensors share the buffer's ownership unless borrowed_tensors=True
    out = {"fst_low_level": "caught" if borrowing_buffer else "clean",
           "fst_open": "caught" if borrowing_buffer else "clean",
           "fst_parallel": "caught" if v < (0, 3, 0) else "clean"}  # 0.3+: ParallelLoader clones
    if v >= (0, 5, 0):
        out.update(fst_low_level_borrowed="caught", fst_parallel_borrowed="caught")
    return out


def _runai_expected(version: str) -> dict:
    v = parse_version(version)
    if v < (0, 17, 0):
        return {"runai_plain": "caught"}  # no owned=: always views of the one reused buffer
    return {"runai_plain": "clean", "runai_owned_false": "caught"}


CASES = ([pytest.param("fst", v, key, outcome, id=f"fastsafetensors-{v}-{key}")
          for v in fastsafetensors_adapter.CONTRACTS.matrix for key, outcome in _fst_expected(v).items()]
         + [pytest.param("runai", v, key, outcome, id=f"runai-{v}-{key}")
            for v in runai_adapter.CONTRACTS.matrix for key, outcome in _runai_expected(v).items()])


@pytest.mark.parametrize("loader,version,key,outcome", CASES)
def test_adapter_contract_at_each_version(loader, version, key, outcome):
    results = matrix_run(loader, version)
    assert results["version"] == version, f"the matrix folder holds {results['version']}, not {version}"
    assert_outcome(results, key, outcome)


@pytest.mark.parametrize("loader,version", [("fst", v) for v in fastsafetensors_adapter.CONTRACTS.matrix]
                         + [("runai", v) for v in runai_adapter.CONTRACTS.matrix])
def test_a_known_version_gives_no_version_warning(loader, version):
    stderr = matrix_run(loader, version)["_stderr"]
    assert "is outside the versions its adapter was read from" not in stderr, stderr[-2000:]


def test_the_install_script_and_the_contract_tables_list_the_same_versions():
    with open(os.path.join(ROOT, ".ci", "loader_matrix.sh"), encoding="utf-8") as fh:
        matrix = re.search(r"^MATRIX=\((.*?)\)", fh.read(), re.S | re.M)  # (the engines' pieces come after)
    specs = set(re.findall(r"([a-z-]+)==([0-9.]+)", matrix.group(1)))
    assert specs == ({("fastsafetensors", v) for v in fastsafetensors_adapter.CONTRACTS.matrix}
                     | {("runai-model-streamer", v) for v in runai_adapter.CONTRACTS.matrix})
    assert all(fastsafetensors_adapter.CONTRACTS.knows(v) for v in fastsafetensors_adapter.CONTRACTS.matrix)
    assert all(runai_adapter.CONTRACTS.knows(v) for v in runai_adapter.CONTRACTS.matrix)


@pytest.mark.slow
def test_a_version_outside_the_known_range_warns_once_naming_it_and_what_is_assumed(tmp_path):
    """A runai-model-streamer 0.99.0 (a stand-in with its own dist-info): one line, and still patched."""
    pkg = tmp_path / "runai_model_streamer" / "safetensors_streamer"
    pkg.mkdir(parents=True)
    (tmp_path / "runai_model_streamer" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "safetensors_streamer.py").write_text(textwrap.dedent("""
        class SafetensorsStreamer:
            def __enter__(self): return self
            def __exit__(self, *exc): pass
            def stream_files(self, paths, s3_credentials=None, device="cpu", is_distributed=False): pass
            def get_tensors(self): yield from ()
    """))
    dist = tmp_path / "runai_model_streamer-0.99.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: runai-model-streamer\nVersion: 0.99.0\n")
    code = textwrap.dedent("""
        import warnings, sanitizer
        from sanitizer import adapters
        sanitizer.enable()
        adapters.install_import_hooks()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import runai_model_streamer.safetensors_streamer.safetensors_streamer as m
        print(adapters.versions())
        print(hasattr(m.SafetensorsStreamer.get_tensors, "__wrapped__"))
        for w in caught:
            print("W", w.message)
    """)
    proc = run_python(code, {"PYTHONPATH": str(tmp_path) + os.pathsep + ROOT})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "{'runai-model-streamer': '0.99.0'}" and lines[1] == "True"
    warned = [line for line in lines[2:] if "outside the versions" in line]
    assert len(warned) == 1, lines
    assert "runai-model-streamer 0.99.0" in warned[0] and "0.15.0 to 0.17.x" in warned[0]
    assert "assuming the 0.17 contract" in warned[0] and "\n" not in warned[0]
