"""Model shapes: the one registry of presets and user spec files, and spec files themselves.

A model spec file describes a DiT by the sizes the planner reads, as TOML or JSON (by suffix):

    name = "my-dit"           # how reports name it
    width = 1152              # model width D
    num_heads = 16
    head_dim = 72             # optional: width / num_heads (head_dim * num_heads must be width)
    num_layers = 28           # all transformer blocks (MMDiT: double + single stream)
    ffn_width = 4608
    text_tokens = 300         # default text length per sample (0: no text)
    joint_attention = false   # optional (false): true when text joins self-attention (MMDiT)
    num_double_layers = 0     # joint only: double-stream blocks (separate text/visual weights)
    param_count = 675000000   # optional: the blocks' count from the sizes

The keys are the fields of `zellige.ModelSpec`, so a spec round-trips through a file unchanged.
Each size has an upper bound (docs/formats.md, "Model spec limits"; `_core.MAX_MODEL_*`), checked
by the core with the rest.
Everywhere a preset name is accepted (`--model`, `model=`), a spec file (`--model-spec`) or a
ModelSpec is too: `resolve_model` is the one place that turns any of them into a ModelSpec.
"""

from __future__ import annotations

import json
from pathlib import Path

from zellige import _core
from zellige._core import ModelSpec
from zellige._files import MAX_TOML_BYTES, read_input
from zellige._json import INT64_MAX, INT64_MIN, parse_json, parse_toml, shown

# key -> type; every key of a spec file is a ModelSpec field
_FIELDS: dict[str, type] = {
    "name": str,
    "width": int,
    "num_heads": int,
    "head_dim": int,
    "num_layers": int,
    "ffn_width": int,
    "text_tokens": int,
    "joint_attention": bool,
    "num_double_layers": int,
    "param_count": int,
}
_REQUIRED = ("name", "width", "num_heads", "num_layers", "ffn_width", "text_tokens")
SPEC_SUFFIXES = (".toml", ".json")


def model_spec_from_dict(data: object, source: str = "model spec") -> ModelSpec:
    """A validated ModelSpec from a spec file's object; ValueError naming `source` and the field
    that is missing, unknown, of the wrong type or out of range."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a table of model sizes, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{source}: unknown field '{unknown[0]}' (allowed: {', '.join(_FIELDS)})")
    for key in _REQUIRED:
        if key not in data:
            raise ValueError(f"{source}: missing field '{key}'")
    for key, value in data.items():
        kind = _FIELDS[key]
        # bool is an int in Python: reject it for sizes, and ints for the flag
        if type(value) is not kind:
            raise ValueError(
                f"{source}: field '{key}' must be {_TYPE_NAMES[kind]}, got {shown(value)}"
            )
        if kind is int and not INT64_MIN <= value <= INT64_MAX:  # the core's integers are int64
            raise ValueError(
                f"{source}: field '{key}' must be in [{INT64_MIN}, {INT64_MAX}], got {shown(value)}"
            )
    try:
        return _core.make_model_spec(**{"joint_attention": False, **data})
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false"}


def model_spec_to_dict(spec: ModelSpec) -> dict:
    """The spec file object of `spec` (every field, so nothing is re-derived on reading)."""
    return {key: getattr(spec, key) for key in _FIELDS}


def load_model_spec(path: str | Path) -> ModelSpec:
    """Reads a TOML or JSON model spec file (see the module docstring); ValueError for an
    unreadable or malformed file, naming the file."""
    path = Path(path)
    if path.suffix not in SPEC_SUFFIXES:
        raise ValueError(f"{path}: a model spec file must end in .toml or .json")
    try:  # capped as run files are (zellige._files.MAX_TOML_BYTES): a spec is a dozen keys
        text = read_input(path, MAX_TOML_BYTES, "model spec")
    except ValueError as error:
        raise ValueError(f"cannot read model spec {error}") from None
    # both parsers refuse deep nesting and strings that are not text in one line
    if path.suffix == ".toml":
        data = parse_toml(text, str(path))
    else:
        try:
            data = parse_json(text, "JSON")
        except ValueError as error:
            raise ValueError(f"{path}: not valid {error}") from None
    return model_spec_from_dict(data, str(path))


def save_model_spec(spec: ModelSpec, path: str | Path) -> None:
    """Writes `spec` as TOML or JSON (by suffix); load_model_spec reads back an equal spec."""
    path = Path(path)
    data = model_spec_to_dict(spec)
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=1) + "\n")
    elif path.suffix == ".toml":
        path.write_text("".join(f"{key} = {_toml_value(value)}\n" for key, value in data.items()))
    else:
        raise ValueError(f"{path}: a model spec file must end in .toml or .json")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return str(value)


def resolve_model(model: str | Path | ModelSpec) -> ModelSpec:
    """Any way of naming a model -> its ModelSpec: a ModelSpec (checked), a preset name
    (`zellige.model_preset_names()`), or the path of a spec file (.toml / .json)."""
    if isinstance(model, ModelSpec):
        _core.validate_model_spec(model)
        return model
    if isinstance(model, Path) or str(model).endswith(SPEC_SUFFIXES):
        return load_model_spec(model)
    if model in _core.model_preset_names():
        return _core.model_preset(model)
    names = ", ".join(_core.model_preset_names())
    raise ValueError(f"unknown model '{model}' (allowed: {names}, or a .toml/.json spec file)")


_HEAD_ATTRIBUTES = ("num_heads", "heads", "n_heads", "num_attention_heads")


def model_spec_from_module(
    module,
    *,
    text_tokens: int,
    joint_attention: bool = False,
    name: str | None = None,
    **sizes: int,
) -> ModelSpec:
    """The ModelSpec of a user's DiT (an nn.Module), derived where its structure shows it.

    Blocks: the items of the module's nn.ModuleLists of blocks (lists not nested in another);
    with joint_attention (default False, as in a spec file) and two such lists, the first holds
    the double-stream blocks. width:
    the most common in_features of the blocks' Linears; ffn_width: the in_features of the
    Linears that project back to the width from a different size; num_heads: a `num_heads`,
    `heads`, `n_heads` or `num_attention_heads` attribute inside the first block (as
    nn.MultiheadAttention has); param_count: all parameters. Any size passed in `sizes`
    (width, num_heads, head_dim, num_layers, num_double_layers, ffn_width, param_count) is taken
    as given; ValueError names a size that cannot be derived, so it can be passed.
    """
    from collections import Counter

    from torch import nn

    unknown = set(sizes) - (set(_FIELDS) - {"name", "text_tokens", "joint_attention"})
    if unknown:
        raise ValueError(f"model_spec_from_module: unknown size {sorted(unknown)[0]!r}")
    lists = [
        child
        for child in module.modules()
        if isinstance(child, nn.ModuleList)
        and len(child) > 0
        and all(any(isinstance(m, nn.Linear) for m in item.modules()) for item in child)
    ]
    nested = {id(inner) for outer in lists for inner in outer.modules() if inner is not outer}
    lists = [blocks for blocks in lists if id(blocks) not in nested]
    blocks = [block for blocks in lists for block in blocks]

    def need(what: str) -> ValueError:
        return ValueError(
            f"cannot derive {what} from {type(module).__name__}: pass {what}=... to "
            "model_spec_from_module"
        )

    linears = [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    derived: dict[str, int] = {"param_count": sum(p.numel() for p in module.parameters())}
    if blocks:
        derived["num_layers"] = len(blocks)
        derived["num_double_layers"] = len(lists[0]) if joint_attention and len(lists) > 1 else 0
    if linears:
        derived["width"] = Counter(m.in_features for m in linears).most_common(1)[0][0]
    width = sizes.get("width", derived.get("width"))
    down = Counter(
        m.in_features for m in linears if m.out_features == width and m.in_features != width
    )
    if down:
        derived["ffn_width"] = down.most_common(1)[0][0]
    for block in blocks[:1]:
        for child in block.modules():
            heads = next((getattr(child, a) for a in _HEAD_ATTRIBUTES if hasattr(child, a)), None)
            if isinstance(heads, int) and heads > 0:
                derived["num_heads"] = heads
                head_dim = getattr(child, "head_dim", None)
                if isinstance(head_dim, int) and head_dim > 0:
                    derived["head_dim"] = head_dim
                break
    values = {**derived, **sizes}
    for key in ("width", "num_heads", "num_layers", "ffn_width"):
        if key not in values:
            raise need(key)
    return model_spec_from_dict(
        {
            "name": name or type(module).__name__,
            "text_tokens": text_tokens,
            "joint_attention": joint_attention,
            **values,
        },
        f"model_spec_from_module({type(module).__name__})",
    )
