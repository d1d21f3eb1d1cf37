"""``ownsan audit`` against ground truth on engines outside the vLLM/SGLang lineage.

Each ``tests/audit_corpus/engines/<engine>.txt`` names a public repository, a commit and the files read,
and classifies by hand every weight-consuming function of those files (RETAINS / SAFE / INPLACE, with
the lines and the reason). The engines' code is not copied into this repository: the test reads it from
a local git mirror (``$OWNSAN_ENGINE_MIRRORS/<owner>+<name>/repo``, default ``/work/.mirror``) or a
checkout at that commit (``$OWNSAN_ENGINE_TREE_<ENGINE>``), and skips when neither is there.

It prints function-level recall and precision and fails when the audit misses a function or raises a
false alarm that the manifest does not list as KNOWN-MISS / KNOWN-FALSE-ALARM (and when a listed one
is no longer wrong: the list must follow the audit), or when it flags a function nobody classified.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

import pytest

from sanitizer.audit import audit_paths
from sanitizer.audit import settings as S

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "audit_corpus" / "engines").glob("*.txt"))
_ENTRY = re.compile(r"^(RETAINS|SAFE|INPLACE)\s+(\S+):(\d+)\s+(\S+)((?:\s+(?:lines=\S+|cond))*)\s+--\s+(.+)$")


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """The audit never touches the sanitizer's runtime (and must not import torch)."""
    yield


@dataclass
class Manifest:
    name: str
    repo: str = ""
    commit: str = ""
    files: List[str] = field(default_factory=list)
    settings: List[str] = field(default_factory=list)
    entries: Dict[Tuple[str, str], Tuple[str, Tuple[int, ...], bool]] = field(default_factory=dict)
    known_miss: Set[str] = field(default_factory=set)
    known_false: Set[str] = field(default_factory=set)
    # the same, measured with no settings at all (``no-settings-misses:`` / ``no-settings-false-alarms:``
    # lines; None when the manifest records no such measurement)
    bare_miss: Optional[Set[str]] = None
    bare_false: Optional[Set[str]] = None


def _parse(path: Path) -> Manifest:
    m = Manifest(path.stem)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, rest = line.partition(":")
        if key in ("no-settings-misses", "no-settings-false-alarms"):
            names = set(rest.split()) - {"none"}
            if key == "no-settings-misses":
                m.bare_miss = names
            else:
                m.bare_false = names
            continue
        if key in ("repo", "commit", "files", "settings") and " " not in key:
            if key == "files":
                m.files = rest.split()
            elif key == "settings":
                m.settings.append(rest.strip())
            else:
                setattr(m, key, rest.strip())
            continue
        if line.startswith(("KNOWN-MISS ", "KNOWN-FALSE-ALARM ")):
            kind, qualname = line.split()[:2]
            (m.known_miss if kind == "KNOWN-MISS" else m.known_false).add(qualname)
            continue
        e = _ENTRY.match(line)
        assert e, f"{path.name}:{number}: not an entry: {line}"
        verdict, file, _, qualname, extra, _ = e.groups()
        lines = tuple(int(x) for part in extra.split() if part.startswith("lines=") for x in part[6:].split(","))
        m.entries[(file, qualname)] = (verdict, lines, "cond" in extra.split())
    return m


def _tree(m: Manifest, dest: Path) -> Optional[Path]:
    """The manifest's files at its commit under ``dest`` (None when no mirror or checkout is here)."""
    checkout = os.environ.get(f"OWNSAN_ENGINE_TREE_{m.name.upper()}")
    if checkout:
        return Path(checkout)
    mirrors = Path(os.environ.get("OWNSAN_ENGINE_MIRRORS", "/work/.mirror"))
    if m.commit.startswith("pypi:"):
        name, _, version = m.commit[5:].partition("==")
        sdist = mirrors / f"pypi+{name}-{version}"
        if not all((sdist / f).is_file() for f in m.files):
            return None
        for name in m.files:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(sdist / name, dest / name)
        return dest
    git_dir = mirrors / m.repo.replace("/", "+") / "repo"
    if not git_dir.is_dir() or shutil.which("git") is None:
        return None
    git = ["git", f"--git-dir={git_dir}"]
    listed = subprocess.run(git + ["ls-tree", "-r", "--name-only", m.commit, "--"] + m.files,
                            capture_output=True, text=True)
    if listed.returncode != 0 or not listed.stdout.strip():
        return None
    for name in listed.stdout.split():
        if not name.endswith(".py"):
            continue
        blob = subprocess.run(git + ["show", f"{m.commit}:{name}"], capture_output=True)
        if blob.returncode != 0:
            return None
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob.stdout)
    return dest


# A tree of five files or more (LightX2V, timm, SD.Next, InvokeAI, Forge, ComfyUI, Sana...) is audited in the full
# suite only: the quick one keeps within the README's five minutes as the corpus grows (it measured 297 s on two cores
# at 166 manifests with the limit at thirty, and again at 194 with it at ten; the rules each tree taught have their
# own quick tests in test_audit_reach_shapes.py), and CI's full suite measures every manifest.
LARGE_TREE_FILES = 5
_GROUND_TRUTH_PARAMS = [p if len(_parse(p).files) < LARGE_TREE_FILES else pytest.param(p, marks=pytest.mark.slow)
                        for p in MANIFESTS]


@pytest.mark.parametrize("manifest", _GROUND_TRUTH_PARAMS, ids=[p.stem for p in MANIFESTS])
def test_engine_ground_truth(manifest: Path, tmp_path: Path):
    m = _parse(manifest)
    root = _tree(m, tmp_path)
    if root is None:
        pytest.skip(f"no mirror or checkout of {m.repo} at {m.commit[:12]} here")
    settings = S.Settings()
    if m.settings:
        import tomllib

        settings = S.parse(tomllib.loads("\n".join(m.settings)), str(manifest))
    result = audit_paths([str(root / f) for f in m.files], settings=settings)
    flagged: Dict[Tuple[str, str], Set[int]] = {}
    for f in result.findings:
        flagged.setdefault((os.path.relpath(f.path, root), f.function), set()).add(f.line)
    by_name = {q: (file, q) for file, q in m.entries}
    expected = {k for k, (v, _, _) in m.entries.items() if v in ("RETAINS", "INPLACE")}
    retains = {k for k, (v, _, _) in m.entries.items() if v == "RETAINS"}
    unclassified = sorted(set(flagged) - set(m.entries))
    tp = set(flagged) & expected
    missed = {q for _, q in expected - set(flagged)}
    false = {q for _, q in set(flagged) - expected - set(unclassified)}
    found_retains = len(retains & set(flagged))
    recall = found_retains / len(retains) if retains else 1.0
    precision = len(tp) / len(flagged) if flagged else 1.0
    wrong_lines = sorted(f"{q}: expected {sorted(m.entries[k][1])}, reported {sorted(flagged[k])}"
                         for k in tp for q in [k[1]] if set(m.entries[k][1]) != flagged[k])
    print(f"\n{m.name} ({m.repo} @ {m.commit[:12]}): {len(m.entries)} weight-consuming functions classified, "
          f"{len(retains)} retaining, {len(expected) - len(retains)} in-place only; flagged {len(flagged)}; "
          f"recall {recall:.3f} ({found_retains}/{len(retains)}), precision {precision:.3f} ({len(tp)}/{len(flagged)})")
    for q in sorted(missed):
        print(f"  missed: {q}")
    for q in sorted(false):
        print(f"  false alarm: {q}")
    for w in wrong_lines:
        print(f"  other lines: {w}")
    assert not unclassified, f"flagged functions the manifest does not classify: {unclassified}"
    assert all(q in by_name for q in m.known_miss | m.known_false), "a KNOWN entry names no classified function"
    assert missed == m.known_miss, f"missed {sorted(missed)}; the manifest lists {sorted(m.known_miss)}"
    assert false == m.known_false, f"false alarms {sorted(false)}; the manifest lists {sorted(m.known_false)}"


BARE = [p for p in MANIFESTS if _parse(p).bare_miss is not None]
# A manifest with no settings runs the same audit in both tests: its bare run is the full suite's only (the quick
# one keeps within its minutes as the corpus grows), and must agree with the first test's KNOWN lists.
_BARE_PARAMS = [p if _parse(p).settings else pytest.param(p, marks=pytest.mark.slow) for p in BARE]


@pytest.mark.parametrize("manifest", _BARE_PARAMS, ids=[p.stem for p in BARE])
def test_engine_ground_truth_without_settings(manifest: Path, tmp_path: Path):
    """The figures with no settings at all, for manifests that record them (issue 50, item 4: what a user
    gets before writing any `[tool.ownsan]`)."""
    m = _parse(manifest)
    root = _tree(m, tmp_path)
    if root is None:
        pytest.skip(f"no mirror or checkout of {m.repo} at {m.commit[:12]} here")
    result = audit_paths([str(root / f) for f in m.files], settings=S.Settings())
    flagged = {(os.path.relpath(f.path, root), f.function) for f in result.findings}
    expected = {k for k, (v, _, _) in m.entries.items() if v in ("RETAINS", "INPLACE")}
    retains = {k for k, (v, _, _) in m.entries.items() if v == "RETAINS"}
    unclassified = sorted(flagged - set(m.entries))
    missed = {q for _, q in expected - flagged}
    false = {q for _, q in flagged - expected - set(unclassified)}
    found = len(retains & flagged)
    print(f"\n{m.name} without settings: flagged {len(flagged)}; recall {found}/{len(retains)}, "
          f"precision {len(flagged & expected)}/{len(flagged)}")
    assert not unclassified, f"flagged functions the manifest does not classify: {unclassified}"
    assert missed == m.bare_miss, f"missed {sorted(missed)}; the manifest lists {sorted(m.bare_miss)}"
    assert false == (m.bare_false or set()), f"false alarms {sorted(false)}; the manifest lists {sorted(m.bare_false or set())}"


def test_manifests_parse_and_cover_their_verdicts():
    assert MANIFESTS, "no engine manifests"
    for path in MANIFESTS:
        m = _parse(path)
        assert m.repo and re.fullmatch(r"[0-9a-f]{40}|pypi:[\w.-]+==[\w.]+", m.commit) and m.files, path.name
        verdicts = {v for v, _, _ in m.entries.values()}
        # a tree with no retention at all is a check of precision alone (ms-swift: every dict copied)
        # and a tree with no borrowing loader at all (gpt-neox), of false alarms alone, recorded by a bare run
        # and a tree whose only weight-consuming functions all retain (llmc's two), of recall, its precision
        # counted by the run it records
        assert "SAFE" in verdicts or (not m.entries and m.bare_false == set()) or m.bare_false is not None, \
            f"{path.name}: needs safe functions"
        assert "RETAINS" in verdicts or m.bare_miss is not None, f"{path.name}: no retaining function, and no run recorded"
        for (file, q), (v, lines, _) in m.entries.items():
            assert v == "SAFE" or lines, f"{path.name}: {q} is {v} without lines"


def test_tgi_without_settings_infers_its_getters(tmp_path: Path):
    """TGI's `Weights` getters are inferred producers (:mod:`sanitizer.audit.producers`): with no settings
    the audit flags exactly the functions the manifest classifies as retaining (0 of 7 before)."""
    m = _parse(next(p for p in MANIFESTS if p.stem == "tgi"))
    root = _tree(m, tmp_path)
    if root is None:
        pytest.skip(f"no mirror or checkout of {m.repo} at {m.commit[:12]} here")
    result = audit_paths([str(root / f) for f in m.files])
    flagged = {(os.path.relpath(f.path, root), f.function) for f in result.findings}
    expected = {k for k, (v, _, _) in m.entries.items() if v in ("RETAINS", "INPLACE")}
    print(f"\ntgi without settings: flagged {len(flagged)}, {len(flagged & expected)} of {len(expected)} expected")
    assert flagged == expected


def test_a_manifest_without_settings_records_the_same_misses_twice():
    """With no settings, the KNOWN lists and the `no-settings-*` lines describe one audit: they must agree (so
    the quick suite, which runs that audit once, checks both)."""
    for path in BARE:
        m = _parse(path)
        if m.settings:
            continue
        assert m.bare_miss == m.known_miss, f"{path.name}: no-settings-misses {sorted(m.bare_miss or ())} " \
                                            f"!= KNOWN-MISS {sorted(m.known_miss)}"
        assert m.bare_false == m.known_false, f"{path.name}: no-settings-false-alarms {sorted(m.bare_false or ())} " \
                                              f"!= KNOWN-FALSE-ALARM {sorted(m.known_false)}"
