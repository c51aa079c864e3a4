"""Writes the generated reference pages, docs/api.md (the public names' signatures and
docstrings) and docs/cli.md (every command's --help), so that both read as they stand in the
repository. tests/python/test_docs_current.py fails when a page differs from what this writes.

    python scripts/gen_docs.py          # rewrite both pages
    python scripts/gen_docs.py --check  # exit 1 naming the stale page
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (section title, intro, qualified names); a class lists its public methods and properties.
API_SECTIONS: list[tuple[str, str, list[str]]] = [
    (
        "Planning",
        "Place one step's batch with any planner, or compare planners on it.",
        ["zellige.api.plan", "zellige.api.compare", "zellige.api.CompareRow"],
    ),
    (
        "Cost model and profiles",
        "A cost model prices placements from a model's sizes, a cluster and a hardware profile. "
        'The built-in profiles are named "h200" (the default) and "h100".',
        [
            "zellige.costs.make_cost_model",
            "zellige.costs.set_gradient_bytes",
            "zellige.profile.load_profile",
            "zellige.profile.builtin_profile_for_device",
            "zellige.profile.save_profile",
        ],
    ),
    (
        "Model shapes",
        "A preset name, a TOML/JSON spec file or a ModelSpec: one registry of model shapes.",
        [
            "zellige.model_spec.resolve_model",
            "zellige.model_spec.load_model_spec",
            "zellige.model_spec.save_model_spec",
            "zellige.model_spec.model_spec_from_dict",
            "zellige.model_spec.model_spec_to_dict",
            "zellige.model_spec.model_spec_from_module",
        ],
    ),
    (
        "Building a plan by hand",
        "A custom planner for the Balancer is a function (batch, cost_model) -> Plan: build one "
        "Placement per sequence with make_placement, put them in a Plan, and the Balancer "
        "predicts and validates it (predict, validate_plan) before any rank runs it. A Plan JSON "
        "file (plan_from_dict / load_plan) is the same value.",
        [
            "zellige.make_placement",
            "zellige.Placement",
            "zellige.Plan",
            "zellige.Strategy",
            "zellige.predict",
            "zellige.validate_plan",
            "zellige.plan_io.plan_from_dict",
            "zellige.plan_io.plan_to_dict",
        ],
    ),
    (
        "Files",
        "Batch, Plan and Profile JSON (docs/formats.md); every reader checks its input and "
        "raises ValueError with one line.",
        [
            "zellige.workload.load_batch",
            "zellige.workload.batch_from_dict",
            "zellige.plan_io.load_plan",
            "zellige.plan_io.save_plan",
        ],
    ),
    (
        "Training loop",
        "Zellige in a training loop of your own (docs/training.md); these classes need PyTorch.",
        [
            "zellige.balancer.Balancer",
            "zellige.balancer.PendingStep",
            "zellige.balancer.BalancedStep",
            "zellige.balancer.Sample",
            "zellige.balancer.HeldInputs",
        ],
    ),
    (
        "Latent datasets",
        "Pre-computed latents and text embeddings on disk (docs/formats.md, Latent dataset): "
        "written through your VAE and text encoder, read by zellige.train --data and by your "
        "loader for the Balancer; a damaged or missing shard raises LatentDataError.",
        [
            "zellige.data.encode.write_latent_dataset",
            "zellige.data.encode.RawSample",
            "zellige.data.encode.media_samples",
            "zellige.data.latents.open_latent_dataset",
            "zellige.data.latents.LatentDataset",
            "zellige.data.latents.LatentDataError",
            "zellige.data.latents.patchify",
        ],
    ),
    (
        "Step pipeline",
        "The one path of a step: plan() -> compile() -> load() -> route(). The loader worker, the "
        "Balancer, the reference trainer and zellige.plan / compare all go through it; plan and "
        "compile need neither torch's process group nor a GPU (docs/architecture.md).",
        [
            "zellige.pipeline.StepPipeline",
            "zellige.pipeline.PreparedStep",
            "zellige.pipeline.StepRecord",
            "zellige.pipeline.make_step_plan",
        ],
    ),
    (
        "Runtime",
        "What the Balancer runs underneath: a plan compiled into one rank's step program, loaded "
        "as device tables, tokens routed to their ranks and the attention callables bound to it.",
        [
            "zellige.runtime.compile_step",
            "zellige.runtime.load_step",
            "zellige.runtime.prepare_step",
            "zellige.runtime.route",
            "zellige.runtime.reverse_route",
            "zellige.runtime.route_text",
            "zellige.runtime.attention_fn",
            "zellige.runtime.cross_attention_fn",
            "zellige.runtime.end_rank_process",
            "zellige.runtime.ops.StepOps",
        ],
    ),
]

API_HEADER = """# API reference

Generated from the docstrings by `python scripts/gen_docs.py` (a test keeps it current).
`import zellige` re-exports the public names; the training-loop classes need PyTorch and load
on first use.
"""

CLI_HEADER = """# Command line reference

Every command takes the batch from a built-in workload (`--workload NAME`) or a
[Batch JSON](formats.md#batch-json) file (`--batch FILE`), the model as a preset (`--model`) or
a [model spec file](model-spec.md) (`--model-spec FILE`), and the cluster (`--gpus`,
`--gpus-per-node`, `--links`, `--profile`, `--gpu-memory-gib`). Bad input gets one line
`zellige: error: ...` on stderr and exit status 2. This page is each command's `--help`, written
by `python scripts/gen_docs.py` (a test keeps it current).
"""


def _resolve(qualified: str):
    module_name, _, attribute = qualified.rpartition(".")
    module = __import__(module_name, fromlist=[attribute])
    return getattr(module, attribute)


def _signature(name: str, obj) -> str:
    signatures = getattr(obj, "__nb_signature__", None)
    if signatures:  # a nanobind function: its own rendering, one line per overload
        return "\n".join(s[0].removeprefix("def ").replace("\\", "") for s in signatures)
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    # annotations are strings (postponed evaluation): shown as written, not quoted
    parameters = [
        p.replace(annotation=_Written(p.annotation)) if isinstance(p.annotation, str) else p
        for p in signature.parameters.values()
    ]
    returns = signature.return_annotation
    signature = signature.replace(
        parameters=parameters,
        return_annotation=_Written(returns) if isinstance(returns, str) else returns,
    )
    return f"{name}{signature}"


class _Written(str):
    def __repr__(self) -> str:
        return str(self)


def _doc(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    if getattr(obj, "__nb_signature__", None):  # nanobind puts the signature first
        doc = doc.split("\n\n", 1)[1] if "\n\n" in doc else ""
    return doc.strip()


def _members(cls) -> list[tuple[str, object]]:
    if dataclasses.is_dataclass(cls):  # its fields in declaration order, then its methods
        members = [(field.name, None) for field in dataclasses.fields(cls)]
        return members + [
            (name, value)
            for name, value in vars(cls).items()
            if not name.startswith("_") and callable(value) and name not in dict(members)
        ]
    if issubclass(cls, enum.Enum):
        return [(member.name, None) for member in cls]
    members = []
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if callable(value) or isinstance(value, property | staticmethod | classmethod):
            members.append((name, value))
        elif type(value).__name__ == "nb_property" or hasattr(value, "__get__"):
            members.append((name, value))
    return members


def _api_entry(qualified: str) -> list[str]:
    obj = _resolve(qualified)
    short = qualified.rpartition(".")[2]
    lines = [f"### {short}", "", "```python"]
    if inspect.isclass(obj):
        lines.append(f"class {short}")
    else:
        lines.append(_signature(short, obj))
    lines += ["```", ""]
    doc = _doc(obj)
    if doc:
        lines += [doc, ""]
    if inspect.isclass(obj):
        for name, member in _members(obj):
            target = member.fget if isinstance(member, property) else member
            member_doc = _doc(target) if target is not None else ""
            if member is None or isinstance(member, property) or not callable(member):
                lines.append(
                    f"- `{name}`" + (f": {member_doc.splitlines()[0]}" if member_doc else "")
                )
                continue
            lines += [f"- `{_signature(name, member)}`"]
            if member_doc:
                lines += ["", *("  " + line if line else "" for line in member_doc.splitlines())]
            lines.append("")
        lines.append("")
    return lines


def api_page() -> str:
    lines = [API_HEADER]
    for title, intro, names in API_SECTIONS:
        lines += [f"## {title}", "", intro, ""]
        for qualified in names:
            lines += _api_entry(qualified)
    return "\n".join(lines).rstrip() + "\n"


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    result = subprocess.run(
        [sys.executable, "-m", "zellige.cli", *args, "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return result.stdout.rstrip()


def cli_page() -> str:
    from zellige.cli import COMMANDS

    parts = [CLI_HEADER, "```text", _help(), "```", ""]
    for name in COMMANDS:
        parts += [f"## zellige {name}", "", "```text", _help(name), "```", ""]
    return "\n".join(parts).rstrip() + "\n"


PAGES = {"docs/api.md": api_page, "docs/cli.md": cli_page}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = parser.parse_args()
    stale = []
    for path, make in PAGES.items():
        text = make()
        target = REPO / path
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(path)
        else:
            target.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run python scripts/gen_docs.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
