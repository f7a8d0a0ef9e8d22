"""``python -m train``: the ``medusa train`` command for launchers (``accelerate launch -m train``, ``torchrun``)."""

import argparse
import sys

from train.cli import add_train_arguments, run_train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description="Train Medusa heads on a frozen base model.")
    add_train_arguments(parser)
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
