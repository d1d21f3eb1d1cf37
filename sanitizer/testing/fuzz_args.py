"""The arguments of ``ownsan fuzz`` (the project's campaign, or ``--consumer`` a user's), torch-free.

``ownsan fuzz`` parses them before it imports the campaign (torch, safetensors, hypothesis), so
``--help`` and a usage error answer at once.
"""
from __future__ import annotations

from sanitizer.core.suggest import HintingParser
from sanitizer.testing import consumer_cli


def build_parser() -> HintingParser:
    parser = HintingParser(prog="ownsan fuzz", description="Fuzz the sanitizer: no miss, no false alarm; "
                           "or, with --consumer, fuzz your own consumer over borrowed streams.")
    parser.add_argument("--examples", type=int, default=None,
                        help="cases to run (default 200; with --consumer, examples, default 100)")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed: case i is generated from (seed, i)")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--replay", metavar="JSON", help="run one case (as printed on a failure) and show it")
    parser.add_argument("--no-shrink", action="store_true", help="report failures without minimizing them")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    consumer_cli.add_arguments(parser)
    return parser


__all__ = ["build_parser"]
