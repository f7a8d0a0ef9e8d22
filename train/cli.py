"""``medusa train``: command-line flags generated from :class:`train.config.TrainConfig` (CLI > YAML > defaults)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from train.config import TrainConfig, field_docs, load_config


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--config`` and one ``--field-name`` flag per :class:`TrainConfig` field to ``parser``.

    Flags default to ``None`` (not given), so only flags on the command line override the YAML file. Booleans get
    ``--flag/--no-flag``; optional fields accept ``none``. ``--drafter`` is a synonym of ``--head-type``.
    """
    parser.add_argument("--config", default=None, metavar="YAML", help="YAML file of TrainConfig fields")
    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.default in ("", None) else f" (default: {f.default})"
        help_text = docs.get(f.name, "") + default
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            # Values stay strings here; TrainConfig converts and validates them with the YAML values.
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.split("_")[-1].upper(),
                                help=help_text)
    parser.add_argument("--drafter", dest="drafter", default=None, metavar="NAME",
                        help="the same as --head-type: the registered name of the drafter to train")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` for parsed arguments: defaults, then ``--config`` YAML, then the flags given."""
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(TrainConfig)}
    overrides["drafter"] = getattr(args, "drafter", None)
    return load_config(args.config, overrides)


def run_train(args: argparse.Namespace) -> int:
    """Run ``medusa train``; returns the process exit code (2 for a configuration or data error)."""
    # Only the first process of a multi-process launch logs progress.
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from train.trainer import train

    try:
        config = config_from_args(args)
        heads_dir = train(config)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"medusa train: error: {e}", file=sys.stderr)
        return 2
    if rank == 0:
        print(f"{config.trainable.label} written to {heads_dir}")
    return 0
