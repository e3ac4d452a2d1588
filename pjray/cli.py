"""Command line: `pjray train [--config FILE] [key=value ...]`.

With no arguments `pjray train` runs the embedded CPU default: a tiny random judge trained with
GRPO on ranked candidate tuples built from synthetic scenes, on a local Ray cluster.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pjray.config import ConfigError, load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pjray", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="GRPO training of a judge on Ray")
    train.add_argument("--config", help="YAML file merged onto the defaults")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.group_size=8")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(args.config, args.overrides)
    except ConfigError as err:
        print(f"pjray: bad config: {err}", file=sys.stderr)
        return 2

    if args.command == "train":
        from pjray.rl.trainer import train as run_training

        run_dir = run_training(cfg)
        print(f"pjray: run finished: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
