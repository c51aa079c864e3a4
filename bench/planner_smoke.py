"""Every planner on every recipe at a few cluster sizes, in this process: a smoke test of a fresh
build (the device machine compiles its own extension). Prints one line per case; a crash shows up
as the process dying on the case named last.

    python3 bench/planner_smoke.py
"""

import sys

import zellige
from zellige import _core

GPU_COUNTS = (8, 16, 32)
PLANNERS = ("dp-tokens", "dp-cost", "static-cp:4", "knapformer:g4n{n}", "megatron-dcp", "zellige")

for recipe in zellige.recipe_names():
    model = zellige.load_recipe(recipe).model
    for gpus in GPU_COUNTS:
        for seed in range(2):
            batch = zellige.generate(recipe, gpus, seed)
            cost_model = zellige.make_cost_model(model, gpus=gpus)
            for planner in PLANNERS:
                name = planner.format(n=gpus // 4)
                print(f"{recipe}/{gpus}/{seed} {name}: ", end="", flush=True)
                try:
                    plan = _core.make_plan(name, batch, cost_model)
                    print(f"{plan.predicted.makespan_s:.4f} s")
                except ValueError as error:  # refusals are answers, not failures
                    print(f"refused: {str(error)[:90]}")
print("planner smoke: done", file=sys.stderr)
