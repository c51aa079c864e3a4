"""Every planner on every recipe at a few cluster sizes, in this process: a smoke test of a fresh
build (the device machine compiles its own extension). Prints one line per case; a crash shows up
as the process dying on the case named last.

    python3 bench/planner_smoke.py [--model M] [--profile FILE]

--model plans every recipe for that model (as `zellige validate-profile` does with wan-14b)
instead of the recipe's own; --profile uses that profile instead of the built-in one.
"""

import argparse
import sys

import zellige
from _provenance import header, print_header
from zellige import _core

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="model preset for every recipe (default: the recipe's)")
parser.add_argument("--profile", help="profile JSON (default: the built-in one)")
args = parser.parse_args()
print_header(header("planner_smoke.py"))
profile = zellige.load_profile(args.profile)

GPU_COUNTS = (8, 16, 32)
PLANNERS = ("dp-tokens", "dp-cost", "static-cp:4", "knapformer:g4n{n}", "megatron-dcp", "zellige")

for recipe in zellige.recipe_names():
    model = args.model or zellige.load_recipe(recipe).model
    for gpus in GPU_COUNTS:
        for seed in range(2):
            batch = zellige.generate(recipe, gpus, seed)
            cost_model = zellige.make_cost_model(model, gpus=gpus, profile=profile)
            for planner in PLANNERS:
                name = planner.format(n=gpus // 4)
                print(f"{recipe}/{gpus}/{seed} {name}: ", end="", flush=True)
                try:
                    plan = _core.make_plan(name, batch, cost_model)
                    print(f"{plan.predicted.makespan_s:.4f} s")
                except ValueError as error:  # refusals are answers, not failures
                    print(f"refused: {str(error)[:90]}")
print("planner smoke: done", file=sys.stderr)
