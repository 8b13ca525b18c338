"""The trainer's own step under different settings, alternated in the same rank processes.

Why: the op and model-step scripts never ran the trainer, and its defaults once cost more than any
op (`docs/benchmarks.md`, fortieth pass: FSDP2 wrapping a lone data replica, 18% of a lite step;
a FSDP unit per tiny block, 1.7x the 4-rank quick start's step). Here each setting (a list of
Hydra overrides on top of ``+experiment=stormcast``, the regression stage) trains ``--steps``
steps through ``physics_dp.training.run.train``, as ``torchrun -m physics_dp.train`` would, and
reports the median of its ``step_s`` after ``--warmup`` steps (read back from ``metrics.jsonl``;
the step's own time, without validation and checkpoints). Settings take turns round by round, so a
burst of background load hits all of them alike, and the per-round ratio to the first setting
is the comparison to read. The final losses are printed too: settings that should train the same
(layouts, wrappers) must agree.

    python benchmarks/trainer_settings.py                                   # 2 ranks, domain 2, lite 256x384
    python benchmarks/trainer_settings.py --ranks 4 --grid 64 96 --model test \\
        --setting "" --setting "parallel.data_parallel=ddp" --setting "parallel.fsdp_unit_params=0"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_processes import run_ranks  # noqa: E402

__all__ = ["DEFAULT_SETTINGS", "train_settings", "summarize", "format_report", "main"]

DEFAULT_SETTINGS = ("", "training.channels_last=true", "parallel.data_parallel=ddp", "parallel.data_parallel=none")


def _overrides(root: str, run: str, common: Sequence[str], setting: str) -> list[str]:
    return [
        "+experiment=stormcast", "training.stage=regression", "logging.wandb_mode=disabled", "logging.figures=false",
        "training.log_interval=1", "training.validation_interval=1000000", "training.checkpoint_interval=1000000",
        f"data.root={root}/data", f"run.dir={root}/{run}", *common,
        *setting.split(),
    ]


def train_settings(root: str, common: Sequence[str], settings: Sequence[str], rounds: int) -> dict[str, Any]:
    """Every setting's trainer run, ``rounds`` times in turn (one rank's body): on rank 0, each run's
    ``step_s`` list and final loss, keyed by setting."""
    import torch.distributed as dist

    from physics_dp.config import compose_config
    from physics_dp.training.run import train

    runs: dict[str, list[dict[str, Any]]] = {setting: [] for setting in settings}
    for round_index in range(rounds):
        for index, setting in enumerate(settings):
            run = f"run_{round_index}_{index}"
            result = train(compose_config(_overrides(root, run, common, setting)))["regression"]
            dist.barrier()
            if dist.get_rank() == 0:
                with open(os.path.join(root, run, "metrics.jsonl")) as handle:
                    rows = [json.loads(line) for line in handle]
                steps = [row["regression/step_s"] for row in rows if "regression/step_s" in row]
                runs[setting].append({"step_s": steps, "loss": result.losses[-1]})
    return runs


def summarize(runs: dict[str, list[dict[str, Any]]], warmup: int) -> dict[str, dict[str, float]]:
    """Per setting: the median over rounds of each run's median step (after ``warmup`` steps), its
    range, the median of the per-round ratios to the first setting, and the last run's final loss."""
    per_round = {setting: [statistics.median(run["step_s"][warmup:]) for run in done] for setting, done in runs.items()}
    first = next(iter(per_round.values()))
    return {
        setting: {
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "ratio": statistics.median(t / b for t, b in zip(times, first)), "loss": runs[setting][-1]["loss"],
        }
        for setting, times in per_round.items()
    }


def format_report(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    rows = "\n".join(
        f"| {setting or '(defaults)'} | {s['median_s'] * 1e3:.0f} | {s['min_s'] * 1e3:.0f}-{s['max_s'] * 1e3:.0f} | "
        f"{s['ratio']:.3f} | {s['loss']:.6f} |"
        for setting, s in summary.items()
    )
    return "\n".join([
        f"The trainer's step, model={args.model}, grid {args.grid[0]}x{args.grid[1]}, {args.ranks} ranks, "
        f"domain_size={args.domain}: median step_s of {args.steps - args.warmup} steps after {args.warmup}, "
        f"{args.rounds} rounds",
        "",
        "| setting | median ms | range over rounds, ms | per-round ratio to the first | final loss |",
        "| --- | --- | --- | --- | --- |",
        rows,
    ])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--domain", type=int, default=2, help="parallel.domain_size (default 2)")
    parser.add_argument("--model", default="lite", help="model size: test | lite | paper (default lite)")
    parser.add_argument("--grid", nargs=2, type=int, default=[256, 384], metavar=("H", "W"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's median (default 2)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--setting", action="append", default=None,
                        help="space-separated overrides of one setting ('' for the defaults); repeat for several")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup or args.rounds < 1:
        parser.error("--steps must exceed --warmup, and --rounds be >= 1")
    settings = args.setting if args.setting is not None else list(DEFAULT_SETTINGS)
    common = [f"model={args.model}", f"parallel.domain_size={args.domain}", f"training.max_steps={args.steps}",
              f"training.global_batch_size={max(1, args.ranks // args.domain)}",  # one sample per data replica
              f"data.synthetic.height={args.grid[0]}", f"data.synthetic.width={args.grid[1]}"]
    with tempfile.TemporaryDirectory() as root:
        runs = run_ranks(args.ranks, train_settings, root, common, settings, args.rounds)[0]
    summary = summarize(runs, args.warmup)
    print(format_report(summary, args), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"runs": runs, "summary": summary}, handle, indent=2)


if __name__ == "__main__":
    main()
