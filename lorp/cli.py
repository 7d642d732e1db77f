"""The `lorp` command line: one entry point for the whole product.

Subcommands defined here use only the pure method. Packages that need heavier machinery
(the Ray pipeline) add theirs through the ``lorp.commands`` entry-point group, so `lorp/`
never imports Ray, MLflow or vLLM. Bad input prints one line on stderr and exits 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

from lorp.data.windows import BOS_POLICIES
from lorp.locality.allocation import VARIANTS
from lorp.locality.similarity import LayerSimilarity
from lorp.locality.similarity_stats import SimilarityStats, load_similarity
from lorp.methods import available_methods, get_method, select_layers
from lorp.methods.registry import Selection
from lorp.methods.shortgpt import CANDIDATES
from lorp.methods.sublayer_selection import select_units
from lorp.models.sublayers import GRANULARITIES, check_units, parse_unit_label, unit_label
from lorp.version import __version__

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
    add_granularity(p)
    add_method_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_select)


def add_granularity(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--granularity",
        choices=GRANULARITIES,
        default="block",
        help="what the budget counts: whole blocks (default), or attention / MLP sub-layers "
        "(or both, mixed), from statistics captured with --sublayers",
    )


def choose(stats: SimilarityStats | LayerSimilarity, args: argparse.Namespace) -> Selection:
    """The selection `args` ask for: blocks, or sub-layer units from sub-layer statistics
    (`capture --sublayers`), where the budget counts units of the granularity."""
    options = method_options(args)
    sublayers = isinstance(stats, SimilarityStats) and bool(stats.extra.get("sublayers"))
    if not sublayers:
        if args.granularity != "block":
            raise ValueError(
                f"--granularity {args.granularity} needs sub-layer statistics: capture with "
                "--sublayers"
            )
        return select_layers(stats, args.budget, args.method, **options)
    if not isinstance(args.budget, int):
        raise ValueError(f"--budget: a sub-layer budget counts units, got {args.budget!r}")
    return select_units(stats.similarity(), args.budget, args.granularity, args.method, **options)


def add_method_options(p: argparse.ArgumentParser) -> None:
    """The options of the built-in methods; each applies only to methods that declare it."""
    p.add_argument("--variant", choices=VARIANTS, help="LoRP allocation variant (default paper)")
    p.add_argument("--k", type=int, help="LoRP clusters; default: from RLS")
    p.add_argument("--seed", type=int, help="clustering / random seed (default 0)")
    p.add_argument(
        "--candidates", choices=CANDIDATES, help="ShortGPT's blocks: inner (default) or all"
    )
    p.add_argument(
        "--last-block",
        action="store_const",
        const=True,
        help="streamline/angular: allow windows that include the last block",
    )


def run_select(args: argparse.Namespace) -> int:
    stats: SimilarityStats | LayerSimilarity = load_similarity(args.stats_file)
    selection = choose(stats, args)
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
    if "sublayers" in d:
        print(f"pruned   {', '.join(d['sublayers'])}  ({d['granularity']})")
    else:
        print(f"pruned   {', '.join(str(x) for x in selection.layers)}")
    if "stages" in d:
        print(f"stages   {'  '.join(f'{k}:{v}' for k, v in d['stages'].items())}")
    return 0


def parse_layers(text: str) -> list[int]:
    """'3,7-9' -> [3, 7, 8, 9]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            out.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers must look like 3,7-9, got {text!r}") from None
    return out


def add_capture(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capture",
        help="compute similarity statistics of a model on a calibration corpus",
        description="Single-process capture; `lorp run` distributes the same function on Ray.",
    )
    p.add_argument("model", metavar="MODEL", help="HF directory, hub id, .gguf file or alias")
    p.add_argument(
        "--data", required=True, metavar="CORPUS", help="a .txt/.json/.parquet file or ptb"
    )
    p.add_argument("--split", default="train")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bos",
        choices=BOS_POLICIES,
        default="auto",
        help="prepend a BOS to every window: auto (when the tokenizer adds one itself), "
        "always, never (default auto)",
    )
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--sublayers",
        action="store_true",
        help="S over the 2N + 1 sub-layer boundaries: select attention / MLP sub-layers "
        "(select --granularity); whole blocks select from it too",
    )
    p.add_argument("--out", required=True, metavar="STATS_FILE", help="where to write the .npz")
    p.set_defaults(func=run_capture)


def run_capture(args: argparse.Namespace) -> int:
    from lorp.data.corpora import load_corpus, tokenize_documents
    from lorp.data.windows import (
        calibration_fingerprint,
        calibration_windows,
        prepend_bos,
        resolve_bos,
    )
    from lorp.locality.capture import capture_stats
    from lorp.models.loading import load_model, parse_model_ref

    if not str(args.out).endswith(".npz"):
        raise ValueError(f"--out must end in .npz, got {args.out!r}")
    parse_model_ref(args.model)  # cheap input errors first, before any corpus or weights
    corpus = load_corpus(args.data, args.split)
    lm = load_model(
        args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code
    )
    bos_id = resolve_bos(lm.tokenizer, args.bos)
    check_seq_len(args.seq_len + (bos_id is not None), lm.max_positions)
    windows = calibration_windows(
        tokenize_documents(lm.tokenizer, corpus),
        args.samples,
        args.seq_len,
        args.seed,
        name=f"corpus {args.data!r} ({corpus.split})",
    )
    windows = prepend_bos(windows, bos_id)
    batches = [windows[i : i + args.batch_size] for i in range(0, len(windows), args.batch_size)]
    stats = capture_stats(
        lm.model,
        batches,
        model_fingerprint=lm.fingerprint,
        calibration_fingerprint=calibration_fingerprint(
            corpus, args.samples, args.seq_len, args.seed, bos_id=bos_id
        ),
        extra={
            "model": args.model,
            "dtype": args.dtype,
            "corpus": args.data,
            "bos": args.bos,
            "bos_id": bos_id,
            **({"sublayers": True} if args.sublayers else {}),
        },
        total=len(batches),
        skip_prefix=int(bos_id is not None),
        sublayers=args.sublayers,
    )
    stats.to_file(args.out)
    bos_note = f", BOS {bos_id} first" if bos_id is not None else ""
    what = f"{stats.n_blocks} sub-layers" if args.sublayers else f"{stats.n_blocks} blocks"
    print(f"wrote {args.out}: {what}, {stats.tokens} tokens{bos_note}")
    return 0


def check_seq_len(seq_len: int, max_positions: int | None) -> None:
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(
            f"seq_len {seq_len} exceeds the model's max_position_embeddings {max_positions}"
        )


def add_prune(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prune", help="drop blocks from a model and save the checkpoint")
    p.add_argument("model", metavar="MODEL")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--layers", type=parse_layers, help="blocks to drop, e.g. 3,7-9")
    how.add_argument("--stats", metavar="STATS_FILE", help="select with a method from these stats")
    how.add_argument(
        "--units",
        type=parse_units,
        help="sub-layers to remove, e.g. attn.3,mlp.5 (vLLM-servable Nemotron-NAS checkpoint)",
    )
    p.add_argument("--budget", type=parse_budget)
    p.add_argument("--method", default="lorp")
    add_granularity(p)
    add_method_options(p)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(func=run_prune)


def run_prune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lorp.models.fingerprint import fingerprint_checkpoint
    from lorp.models.loading import load_model, materialize, read_num_layers
    from lorp.models.surgery import check_layers, drop_layers, save_pruned

    if Path(args.out).exists() and not args.overwrite:
        raise ValueError(f"--out {args.out!r} already exists (pass --overwrite to replace it)")
    stats = _prune_stats(args)
    # Fingerprint and block count first (memoised, no weights loaded): a mismatch or a bad
    # selection fails in a second.
    path = materialize(args.model)
    fingerprint, n_blocks = fingerprint_checkpoint(path), read_num_layers(path)
    if stats is not None:
        _check_stats_match(args.stats, stats, args.model, fingerprint, n_blocks)
    if args.layers is not None:
        check_layers(args.layers, n_blocks)
    record = _prune_provenance(args, stats, fingerprint, n_blocks)
    if (record.get("details") or {}).get("granularity", "block") != "block":
        return _prune_sublayers(args, record)
    lm = load_model(args.model, trust_remote_code=args.trust_remote_code)
    kept = drop_layers(lm.model, record["pruned"])
    save_pruned(lm.model, lm.tokenizer, args.out, record, overwrite=args.overwrite)
    print(f"pruned blocks {record['pruned']} -> {args.out} ({len(kept)} blocks kept)")
    return 0


def parse_units(text: str) -> list[int]:
    """'attn.3,mlp.5' -> [6, 11] (`lorp.models.sublayers`)."""
    try:
        return [parse_unit_label(x.strip()) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _prune_sublayers(args: argparse.Namespace, record: dict[str, Any]) -> int:
    """Remove the record's sub-layer units and write the Nemotron-NAS checkpoint (refused
    in one line, before loading, for a family the form cannot carry)."""
    from lorp.models.loading import load_model, materialize, read_config
    from lorp.models.nemotron_nas import check_servable, save_sublayer_variant
    from lorp.models.sublayers import remove_sublayers

    check_servable(read_config(materialize(args.model)))
    units = record["pruned"]
    lm = load_model(args.model, trust_remote_code=args.trust_remote_code)
    remove_sublayers(lm.model, units)
    save_sublayer_variant(lm.model, lm.tokenizer, args.out, units, record, overwrite=args.overwrite)
    names = ", ".join(record["details"]["sublayers"])
    print(
        f"removed sub-layers {names} -> {args.out} (Nemotron-NAS form: vLLM serves it; "
        "transformers loads it with trust_remote_code)"
    )
    return 0


def _prune_stats(args: argparse.Namespace) -> SimilarityStats | None:
    """The statistics `--stats` names (needs --budget), or None for `--layers`/`--units`."""
    if args.stats is None:
        if args.budget is not None:
            raise ValueError("--budget applies only with --stats")
        if args.units is not None and args.granularity == "block":
            args.granularity = "mixed"  # explicit units: whatever kinds they name
        return None
    if args.budget is None:
        raise ValueError("--stats needs --budget")
    return SimilarityStats.from_file(args.stats)


def _check_stats_match(
    stats_file: str, stats: SimilarityStats, model: str, fingerprint: str, n_blocks: int
) -> None:
    if stats.model_fingerprint not in (None, fingerprint):
        raise ValueError(
            f"stats {stats_file!r} were captured from model {stats.model_fingerprint}, "
            f"not {model!r} ({fingerprint})"
        )
    if stats.n_blocks != n_blocks * (2 if stats.extra.get("sublayers") else 1):
        raise ValueError(
            f"stats {stats_file!r} describe {stats.n_blocks} blocks, model {model!r} has {n_blocks}"
        )


def _prune_provenance(
    args: argparse.Namespace, stats: SimilarityStats | None, fingerprint: str, n_blocks: int
) -> dict[str, Any]:
    """Select the blocks (a method on `stats`, or the `--layers` list) and describe them."""
    from lorp.locality.similarity_stats import stats_hash
    from lorp.provenance import provenance

    source = {"source_model": args.model, "source_fingerprint": fingerprint}
    if args.units is not None:
        units = check_units(args.units, n_blocks)
        return provenance(
            **source,
            method="manual",
            options={},
            budget=len(units),
            n_blocks=2 * n_blocks,
            pruned=units,
            details={"granularity": args.granularity, "sublayers": [unit_label(u) for u in units]},
        )
    if stats is None:
        layers = sorted(set(args.layers))
        return provenance(
            **source,
            method="manual",
            options={},
            budget=len(layers),
            n_blocks=n_blocks,
            pruned=layers,
        )
    selection = choose(stats, args)
    if args.granularity == "block" and "blocks" in selection.details:  # from sub-layer stats
        selection = dataclasses.replace(
            selection, layers=tuple(selection.details["blocks"]), n_blocks=n_blocks
        )
    return provenance(
        **source,
        method=selection.method,
        options=selection.options,
        budget=selection.budget,
        n_blocks=selection.n_blocks,
        pruned=selection.layers,
        stats_hash=stats_hash(stats),
        details=selection.details,
    )


def method_options(args: argparse.Namespace) -> dict[str, Any]:
    """The method options given on the command line; one the method lacks is an error."""
    spec = get_method(args.method)
    options: dict[str, Any] = {}
    for name in ("variant", "k", "seed", "candidates", "last_block"):
        value = getattr(args, name)
        if value is None:
            continue
        if name not in spec.defaults:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} does not apply to method {args.method!r}")
        options[name] = value
    return options


# Subcommands from other packages: `name = "module:function"` in the lorp.commands group,
# where function(subparsers) adds the parser and sets `func`.
BUILTIN_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_select,
    add_capture,
    add_prune,
]


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


def quiet_libraries() -> None:
    """Keep stderr for lorp's own progress and one-line errors: libraries log at ERROR and
    transformers' per-load progress bars are off (`--verbose` restores them). transformers
    reads the first two variables when it is imported, so a command that imports it later
    (or never: a `lorp plan` whose reads are cached) is quiet without importing it here,
    a second of a plan; one that has imported it already is quietened now."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


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
    if not args.verbose:
        quiet_libraries()
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"lorp {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
