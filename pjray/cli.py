"""Command line: `pjray train | sft | ppjd | eval | sweep [--config FILE] [key=value ...]`.

`pjray sweep --config FILE --grid KEY=V1,V2 ...` runs a grid of trainings on Ray Tune (pjray.sweep).

`pjray eval --judge DIR_OR_HUB_ID --bench NAME [--data PATH]` evaluates a judge (pjray.eval).

With no arguments `pjray train` runs the embedded CPU default: the cached base judge
(`pjray.models.base_judge`, built on first use) trained with GRPO on ranked candidate tuples
built from synthetic scenes, on a local Ray cluster.

Every path a command names is checked before Ray starts. A failed command prints one line,
`pjray: <what>: <where>: <why>`, and exits 2 for bad input (config, paths, data) or 1 for a bug
in pjray; `--debug` (or PJRAY_DEBUG=1) prints the traceback too.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback

from pjray.config import ConfigError, load
from pjray.console import VERBOSE_ENV, quiet_stack, run_summary
from pjray.errors import explain
from pjray.inputs import check_inputs
from pjray.signals import Interrupted


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pjray", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error (also PJRAY_DEBUG=1)")
    parser.add_argument("--verbose", action="store_true", help="keep Ray's and the actors' notices and warnings")
    # Also accepted after the subcommand; SUPPRESS keeps a subcommand from resetting them.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="print the traceback of an error"
    )
    common.add_argument(
        "--verbose", action="store_true", default=argparse.SUPPRESS, help="keep Ray's notices and warnings"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{train,sft,ppjd,eval,sweep}")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[common])

    train = add("train", "GRPO training of a judge on Ray")
    train.add_argument("--config", help="YAML file merged onto the defaults")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.group_size=8")
    sft = add("sft", "supervised fine-tuning of a judge (no model.path: build the base judge)")
    sft.add_argument("--config", help="YAML file merged onto the defaults")
    sft.add_argument(
        "--ship",
        action="store_true",
        help="with no model.path: copy the built base judge over the one pjray ships (pjray/assets/base_judge)",
    )
    sft.add_argument("overrides", nargs="*", help="dotted overrides, e.g. sft.steps=200 model.path=DIR")
    ppjd = add("ppjd", "build the PPJD dataset with Ray Data")
    ppjd.add_argument("--config", help="YAML file merged onto the defaults, e.g. configs/ppjd_scenes.yaml")
    ppjd.add_argument(
        "--push-to-hub",
        metavar="OWNER/NAME",
        help="publish the dataset and its card to this hub dataset (ppjd.push_to_hub)",
    )
    ppjd.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ppjd.num_items=64")
    evaluate = add("eval", "evaluate a judge on a benchmark and write a report")
    evaluate.add_argument("--config", help="YAML file merged onto the defaults, e.g. configs/eval_scenes.yaml")
    evaluate.add_argument("--judge", help="HF directory or hub id of the judge (eval.judge)")
    evaluate.add_argument(
        "--bench",
        help="score | pair | batch | perceptual_bias | mm_judgebias | looking | vl_rewardbench | mm_rewardbench (eval.bench)",
    )
    evaluate.add_argument(
        "--data", help="benchmark or PPJD file, or a dataset (hub id or folder); empty: synthetic scenes (eval.data)"
    )
    evaluate.add_argument("--image-dir", help="folder the data file's image paths are relative to")
    evaluate.add_argument("--output-dir", help="where the report and the output cache go")
    evaluate.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.tie_rule=downstream")
    sweep = add("sweep", "a grid of trainings, one W&B group, a results table and plots")
    sweep.add_argument("--config", help="YAML file merged onto the defaults for every trial")
    sweep.add_argument(
        "--grid",
        nargs="+",
        required=True,
        metavar="KEY=V1,V2",
        help="axes, e.g. algo.group_size=2,4,8 data.num_candidates=3,4 (one value: fixed)",
    )
    sweep.add_argument("--name", default="", help="sweep and W&B group name (default: sweep-<config>-<time>)")
    sweep.add_argument("--sweep-dir", help="where trial run dirs and results go (default: runs/sweeps/<name>)")
    sweep.add_argument(
        "--max-concurrent",
        type=int,
        default=0,
        metavar="N",
        help="at most N trials at once (default 0: as many as the cluster holds)",
    )
    sweep.add_argument("overrides", nargs="*", help="dotted overrides for every trial (before --grid)")
    args = parser.parse_args(argv)
    if args.command == "eval":
        # Explicit flags are applied after the dotted overrides, so they win.
        flags = {
            "judge": args.judge,
            "bench": args.bench,
            "data": args.data,
            "image_dir": args.image_dir,
            "output_dir": args.output_dir,
        }
        args.overrides = list(args.overrides) + [f"eval.{k}={v}" for k, v in flags.items() if v is not None]
    if args.command == "ppjd" and args.push_to_hub is not None:
        args.overrides = [*args.overrides, f"ppjd.push_to_hub={args.push_to_hub}"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    debug = args.debug or os.environ.get("PJRAY_DEBUG", "") not in ("", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # for the actors too (pjray.cluster.actor_env)
    quiet_stack()
    try:
        return run_command(args)
    except KeyboardInterrupt as err:  # Ctrl-C, or pjray.signals.Interrupted (also SIGTERM)
        if debug:
            traceback.print_exc()
        stopped = err if isinstance(err, Interrupted) else Interrupted(signal.SIGINT)
        print(f"pjray: {stopped.message}", file=sys.stderr)
        return stopped.exit_code
    except Exception as err:  # noqa: BLE001 - every error ends here as one line and an exit code
        if debug:
            traceback.print_exc()
        code, line = explain(err)
        print(line, file=sys.stderr)
        return code


def run_command(args: argparse.Namespace) -> int:
    if args.command == "sweep":
        from pjray.sweep import main as run_sweep_command

        return run_sweep_command(args)
    cfg = load(args.config, args.overrides)
    # Before Ray starts: a typo'd path costs a second, not a cluster start-up.
    check_inputs(cfg, args.command)

    if args.command == "train":
        from pjray.eval.runner import validation_hook
        from pjray.recipes.base_judge import held_out_hook
        from pjray.recipes.training import training_inputs
        from pjray.rl.trainer import train as run_training

        start = time.perf_counter()
        inputs = training_inputs(cfg, say=print)  # the rows and the judge, built where they must be
        run_dir = run_training(cfg, inputs, evaluate=validation_hook(cfg), held_out=held_out_hook(cfg))
        print("\n".join(run_summary(run_dir, time.perf_counter() - start)))
    elif args.command == "sft":
        if cfg.model.path:
            if args.ship:
                raise ConfigError("--ship copies the base judge's build; it takes no model.path")
            from pjray.rl.sft import run_sft

            export = run_sft(cfg, cfg.model.path)
        else:
            from pjray.recipes.base_judge import RECIPES, SHIPPED, SHIPPED_INIT, build_base_judge, ship

            if cfg.model.init not in RECIPES:
                raise ConfigError(
                    f"model.init={cfg.model.init}: pjray sft with no model.path builds one of {sorted(RECIPES)}"
                )
            if args.ship and cfg.model.init != SHIPPED_INIT:
                raise ConfigError(
                    f"--ship copies the shipped recipe's build (model.init={SHIPPED_INIT}), not {cfg.model.init}"
                )
            export = build_base_judge(cfg, RECIPES[cfg.model.init])  # into the cache, whatever is shipped
            if args.ship:
                record = ship(export.parent)
                print(f"pjray: shipped {record['recipe_hash']} into {SHIPPED}; commit it")
        print(f"pjray: sft finished: {export}")
    elif args.command == "ppjd":
        from pjray.ppjd.pipeline import run_ppjd, summary

        manifest = run_ppjd(cfg)
        print(summary(manifest))
        out = manifest["output"]
        print(f"pjray: PPJD rows in {out['ppjd']}, rejects in {out['rejects']}, dataset card {out['card']}")
        if cfg.ppjd.push_to_hub:
            print(f"pjray: published to https://huggingface.co/datasets/{cfg.ppjd.push_to_hub}")
    elif args.command == "eval":
        from pjray.eval.runner import run_eval

        paths = run_eval(cfg)
        print(paths["markdown"].read_text())
        print(f"pjray: report written: {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
