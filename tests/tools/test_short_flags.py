"""One meaning per short flag across ``ownsan``: every subcommand's parser is read (the pass-through ones,
``audit``, ``fuzz`` and ``demo``, parse their own arguments), and a short flag that two of them give two
long forms fails. ``-o`` was ``ownsan run --option`` and ``ownsan audit --output`` (issue 50, item 3)."""
from __future__ import annotations

import argparse
from typing import Dict, Iterator, Set, Tuple

from sanitizer.tools import cli


def _subparsers(parser: argparse.ArgumentParser) -> Dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parsers() -> Iterator[Tuple[str, argparse.ArgumentParser]]:
    """``ownsan`` and each of its commands' parsers, the pass-through commands' own ones included."""
    from sanitizer.audit.cli import build_parser as audit_parser
    from sanitizer.testing.demo import _parser as demo_parser
    from sanitizer.testing.fuzz_args import build_parser as fuzz_parser

    top = cli.build_parser()
    yield "ownsan", top
    subs = _subparsers(top)
    assert {"run", "triage", "demo", "options", "fuzz", "audit", "doctor"} <= set(subs)
    for name, sub in subs.items():
        yield f"ownsan {name}", sub
    yield "ownsan audit (its own)", audit_parser()
    yield "ownsan fuzz (its own)", fuzz_parser()
    yield "ownsan demo (its own)", demo_parser()


def _meanings() -> Dict[str, Dict[Tuple[str, ...], Set[str]]]:
    """short flag -> {its action's long forms: the parsers that give it those}."""
    out: Dict[str, Dict[Tuple[str, ...], Set[str]]] = {}
    for where, parser in _parsers():
        for action in parser._actions:
            shorts = [s for s in action.option_strings if len(s) == 2 and s[0] == "-" and s[1] != "-"]
            longs = tuple(sorted(s for s in action.option_strings if s.startswith("--"))) or (action.dest,)
            for short in shorts:
                out.setdefault(short, {}).setdefault(longs, set()).add(where)
    return out


def test_each_short_flag_means_one_thing_across_the_cli():
    meanings = _meanings()
    clashes = {short: {"/".join(longs): sorted(where) for longs, where in forms.items()}
               for short, forms in meanings.items() if len(forms) > 1}
    assert clashes == {}
    assert set(meanings["-o"]) == {("--option",)} and set(meanings["-h"]) == {("--help",)}
    assert set(meanings["-q"]) == {("--quiet",)}


def test_the_audit_has_output_as_a_long_flag_only():
    from sanitizer.audit.cli import build_parser

    output = next(a for a in build_parser()._actions if a.dest == "output")
    assert output.option_strings == ["--output"]
