"""The zellige planner on the batches where it died (SIGSEGV) inside `zellige validate-profile`
on the H200 machine: torch imported first, as there; planned in this process (`--mode main`) or
in a forked child per batch (`--mode fork`, as validate-profile does). Prints one line per batch
before planning it, so a crash names its batch.

    python3 -X faulthandler bench/planner_crash_check.py --profile P.json --mode main|fork
"""

import argparse
import multiprocessing

import torch  # noqa: F401  (validate-profile's process has torch loaded)

from zellige import _core
from zellige.costs import make_cost_model
from zellige.profile import load_profile
from zellige.workload import load_recipe

CASES = (("wan-stage3", 8), ("wan-stage2", 16), ("opensora2-stage2", 8), ("opensora2-stage1", 16))

parser = argparse.ArgumentParser()
parser.add_argument("--profile")
parser.add_argument("--mode", choices=("main", "fork"), default="main")
args = parser.parse_args()
profile = load_profile(args.profile)


def plan(recipe: str, gpus: int, seed: int) -> None:
    batch = _core.generate_batch(load_recipe(recipe), gpus, seed)
    cost_model = make_cost_model("wan-14b", gpus=gpus, profile=profile)
    result = _core.make_plan("zellige", batch, cost_model)
    print(f"  makespan {result.predicted.makespan_s:.4f} s", flush=True)


for recipe, gpus in CASES:
    for seed in (0, 1):
        print(f"{recipe}/{gpus}/{seed} ({args.mode})", flush=True)
        if args.mode == "main":
            plan(recipe, gpus, seed)
        else:
            child = multiprocessing.get_context("fork").Process(
                target=plan, args=(recipe, gpus, seed)
            )
            child.start()
            child.join()
            print(f"  exit code {child.exitcode}", flush=True)
