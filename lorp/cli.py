"""The `lorp` command line: one entry point for the whole product.

Subcommands defined here use only the pure method. Packages that need heavier machinery
(the Ray pipeline) add theirs through the ``lorp.commands`` entry-point group, so `lorp/`
never imports Ray, MLflow or vLLM. Bad input prints one line on stderr and exits 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

from lorp import __version__
from lorp.allocation import VARIANTS
from lorp.methods import available_methods, get_method, select_layers
from lorp.similarity import LayerSimilarity, SimilarityStats, load_similarity

EXIT_BAD_INPUT = 2
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def parse_budget(text: str) -> int | float:
    """'4' -> 4 blocks; '0.25' -> a quarter of N."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"budget must be a block count or a fraction, got {text!r}"
        ) from None


def add_select(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "select",
        help="choose the blocks to prune from saved similarity statistics",
        description="Choose blocks to prune. STATS_FILE is a SimilarityStats .npz or a bare "
        "N x N .npy matrix (then only methods that need no output state apply).",
    )
    p.add_argument("stats_file", metavar="STATS_FILE")
    p.add_argument("--budget", required=True, type=parse_budget, help="blocks, or a fraction of N")
    p.add_argument("--method", default="lorp", help=f"one of {', '.join(available_methods())}")
    p.add_argument("--variant", choices=VARIANTS, help="LoRP allocation variant (default paper)")
    p.add_argument("--k", type=int, help="LoRP clusters; default: from RLS")
    p.add_argument("--seed", type=int, help="clustering / random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_select)


def run_select(args: argparse.Namespace) -> int:
    stats: SimilarityStats | LayerSimilarity = load_similarity(args.stats_file)
    spec = get_method(args.method)
    options: dict[str, Any] = {}
    for name in ("variant", "k", "seed"):
        value = getattr(args, name)
        if value is None:
            continue
        if name not in spec.defaults:
            raise ValueError(f"--{name} does not apply to method {args.method!r}")
        options[name] = value
    selection = select_layers(stats, args.budget, args.method, **options)
    if args.json:
        print(json.dumps(selection.to_dict(), sort_keys=True))
        return 0
    d = selection.details
    print(f"method   {selection.method}  {dict(selection.options)}")
    print(f"blocks   {selection.n_blocks}   budget {selection.budget}")
    if "rls" in d:
        source = "from RLS" if d["k_from_rls"] else "fixed"
        print(f"RLS      {d['rls']:.4f}   K = {d['k']} ({source})")
        print(f"clusters {' '.join(str(x) for x in d['labels'])}")
    print(f"pruned   {', '.join(str(x) for x in selection.layers)}")
    if "stages" in d:
        print(f"stages   {'  '.join(f'{k}:{v}' for k, v in d['stages'].items())}")
    return 0


# Subcommands from other packages: `name = "module:function"` in the lorp.commands group,
# where function(subparsers) adds the parser and sets `func`.
BUILTIN_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_select]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="lorp", description="Locality-Aware Redundancy Pruning")
    parser.add_argument("--version", action="version", version=f"lorp {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for add in BUILTIN_COMMANDS:
        add(sub)
    for ep in sorted(entry_points(group="lorp.commands"), key=lambda e: e.name):
        ep.load()(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors and --help: return the code, as for other errors
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"lorp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
