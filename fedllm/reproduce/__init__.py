"""``fedllm reproduce NAME``: the papers' own experiments, run by fedllm's own algorithm code.

One module per reproduction, each with ``add_arguments(parser)`` and ``main(args)``: it drives fedllm's
client algorithms, server and strategies on a small torch model whose loss gives its paper's update, shows
progress, prints a table, writes ``DIR/results.json`` and a plot laid out like the paper's figure, and
ends with one JSON line. ``docs/reproductions/`` has one page per reproduction.
"""

from __future__ import annotations

import argparse
import importlib

REPRODUCTIONS = {
    "scafflsa": "fedllm.reproduce.scafflsa",
    "floral-linear": "fedllm.reproduce.floral_linear",
    "perfedavg-digits": "fedllm.reproduce.perfedavg_digits",
}


def add_command(sub) -> None:
    p = sub.add_parser("reproduce", help="run a paper's own experiment with fedllm's algorithms")
    names = p.add_subparsers(dest="reproduction", required=True)
    for name, module in REPRODUCTIONS.items():
        mod = importlib.import_module(module)
        q = names.add_parser(
            name,
            help=mod.__doc__.splitlines()[0],
            description=mod.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(q)
        q.set_defaults(func=mod.main)
