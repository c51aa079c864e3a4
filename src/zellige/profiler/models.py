"""What the profiler runs for a model: a core preset's runnable model from the registry
(zellige.model.MODELS), or a user's ModelSpec at its sizes, and the blocks it measures."""

from __future__ import annotations

import dataclasses
import math
import sys

import torch

from zellige import _core
from zellige.model.config import MODELS, DiTConfig, dit_from_spec, with_layers
from zellige.model_spec import model_spec_to_dict


def model_name(model: str | _core.ModelSpec) -> str:
    return model if isinstance(model, str) else model.name


def model_flag(model: str | _core.ModelSpec) -> str:
    """How a command line named the model (for the profile's provenance)."""
    return f"--model {model}" if isinstance(model, str) else f"--model-spec ({model.name})"


def quick_model(model: str) -> str:
    """The preset a --quick (CPU smoke) run measures for `model`: the tiny preset of the same
    kind ("tiny" for a Wan-style model, "mmdit-tiny" for a joint-attention one), so the run
    goes through the same blocks, runtime and cost model in seconds, with numbers that mean
    nothing (as every quick run's)."""
    return "mmdit-tiny" if _core.model_preset(model).joint_attention else "tiny"


def model_to_run(
    model: str | _core.ModelSpec | None, quick: bool, command: str
) -> str | _core.ModelSpec:
    """What `zellige profile` / `validate-profile` measure for --model (default wan-14b): with
    --quick, the tiny preset of its kind (quick_model), said on stderr. A spec file's model runs
    at its own sizes (the user chose them; --quick only shortens the measurements)."""
    model = model or "wan-14b"
    if not quick or not isinstance(model, str):
        return model
    tiny = quick_model(model)
    if tiny != model:
        print(
            f"[{command}] --quick: {model} runs as {tiny} (its kind of blocks at tiny sizes)",
            file=sys.stderr,
        )
    return tiny


def dit_config(model: str | _core.ModelSpec, num_layers: int | None = None) -> DiTConfig:
    """The reference model of core preset `model`, or of a user's ModelSpec (a spec file): the
    reference blocks at its sizes stand for its blocks (VideoDiT blocks for cross-attention,
    MMDiT blocks for joint attention). Cut to `num_layers` blocks (an MMDiT keeps its share of
    double-stream blocks: model.config.with_layers)."""
    if isinstance(model, _core.ModelSpec):
        config = dit_from_spec(model)
    else:  # the registry's entry of this core preset (zellige.model.MODELS)
        entry = next((entry for entry in MODELS if entry.preset == model), None)
        if entry is None:
            allowed = ", ".join(entry.preset for entry in MODELS)
            raise ValueError(
                f"model '{model}' has no runnable reference model (allowed: {allowed})"
            )
        config = entry.dit_config()
    return config if num_layers is None else with_layers(config, num_layers)


def stack_layers(model: str | _core.ModelSpec) -> int:
    """Layers of the stack that the profiler's memory and host-time probes and validate-profile
    run by default: 2 for a cross-attention model; for an MMDiT the fewest layers (at least 2)
    whose double/single split is the model's own (3 for mmdit-11b: 1 double + 2 single, as its
    19 + 38), so that per-layer rows measured on the stack are the model's average layer. A mix
    that needs more than 4 layers falls back to 2 (one of each kind)."""
    config = dit_config(model)
    if not config.num_double_layers:
        return 2
    layers = config.num_layers // math.gcd(config.num_layers, config.num_double_layers)
    layers = layers * 2 if layers == 1 else layers
    return layers if layers <= 4 else 2


def block_kinds(model: str | _core.ModelSpec) -> list[tuple[str, DiTConfig, float]]:
    """(name, one-block config, share of the model's layers) per kind of block: ("block",
    config, 1.0) for a Wan-style model; an MMDiT's double- and single-stream blocks with their
    shares of its layers, so that per-token times measured block by block are mixed as the
    model runs them."""
    config = dit_config(model)
    if not config.joint_attention:
        return [("block", dataclasses.replace(config, num_layers=1), 1.0)]
    double, single = config.num_double_layers, config.num_single_layers
    kinds = []
    if double:
        one = dataclasses.replace(config, num_layers=1, num_double_layers=1)
        kinds.append(("double-stream", one, double / config.num_layers))
    if single:
        one = dataclasses.replace(config, num_layers=1, num_double_layers=0)
        kinds.append(("single-stream", one, single / config.num_layers))
    return kinds


def model_spec(model: str | _core.ModelSpec, num_layers: int | None = None) -> _core.ModelSpec:
    """The core's spec of `model` (a preset name or a ModelSpec), cut to `num_layers` layers.
    Parameters scale with the layers for Wan-style models; an MMDiT's cut keeps double and
    single blocks as dit_config does and scales its count by the blocks' weight matrices kept
    (for a preset: exactly the cut blocks' matrices, what the preset counts)."""
    if isinstance(model, str):
        spec = _core.model_preset(model)
    else:  # a copy: the cut below must not change the caller's spec
        spec = _core.ModelSpec(**model_spec_to_dict(model))
    if num_layers is not None:
        if num_layers <= 0 or num_layers > spec.num_layers:
            raise ValueError(f"num_layers must be in 1..{spec.num_layers} for {model}")
        if spec.joint_attention:
            config = dit_config(model, num_layers)
            spec.num_double_layers = config.num_double_layers
            kept = block_matrix_params(config)
            spec.param_count = spec.param_count * kept // block_matrix_params(dit_config(model))
        else:
            spec.param_count = spec.param_count * num_layers // spec.num_layers
        spec.num_layers = num_layers
    return spec


def load_block_factory(target: str):
    """`module:factory` -> the factory, for `zellige profile --block`. The factory takes the
    ModelSpec being profiled and returns one block of the user's model as an nn.Module whose
    `forward(x_TD, attention)` maps [T, D] tokens to [T, D], calling `attention(q_TNH, k_TNH,
    v_TNH) -> o_TNH` for its attention (the profiler passes a stand-in without the attention
    core, which the profile measures separately)."""
    import importlib
    import sys

    if "" not in sys.path:  # as `python -m`: the user's module lives where the command runs
        sys.path.insert(0, "")
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--block must be module:factory (e.g. my_dit:make_block), got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--block {target}: cannot import {module_name}: {error}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"--block {target}: {module_name} has no callable {attribute!r}")
    return factory


def block_matrix_params(config: DiTConfig) -> int:
    """Weight-matrix parameters of the model's blocks (no biases or norms), as the planning
    core's presets count them (cpp/src/model_spec.cc)."""
    from zellige.model import build_model

    with torch.device("meta"):
        blocks = build_model(config).blocks
    return sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
