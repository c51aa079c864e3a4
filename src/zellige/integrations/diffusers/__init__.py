"""diffusers transformers trained under a Zellige step, their code and weights unedited.

    from zellige.integrations import diffusers as zd

    packed = zd.pack(model)                  # installs Zellige's attention processors
    balancer = zellige.Balancer(zd.model_spec(model, text_tokens=64), planner="zellige")
    step = balancer.step(samples)            # this rank's samples (zellige.Sample)
    held = step.inputs()
    out_T = packed(step, held.tokens["patches"], held.samples["timestep"], held.text["text"])
    loss = step.loss((out_T - held.tokens["target"]).square().mean(-1))

`pack` takes a WanTransformer3DModel (text by cross-attention) or a FluxTransformer2DModel (joint
attention) and refuses, with a ValueError that says why, another class, an image-conditioned Wan,
a layer whose attention processor is not the model's default, diffusers' own context parallelism,
and (at the first forward) an attention mask. What each packed forward takes: PackedWan,
PackedFlux; docs/diffusers.md.
"""

from __future__ import annotations

try:
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel
except ImportError as error:  # an optional extra
    raise ImportError(
        "zellige.integrations.diffusers needs diffusers: pip install 'zellige[diffusers]'"
    ) from error
from torch import nn

from zellige import _core
from zellige.integrations.diffusers._common import PackedTransformer
from zellige.integrations.diffusers.flux import PackedFlux
from zellige.integrations.diffusers.wan import PackedWan, patchify, unpatchify
from zellige.model_spec import model_spec_from_dict

__all__ = [
    "PackedFlux",
    "PackedTransformer",
    "PackedWan",
    "SUPPORTED",
    "model_spec",
    "pack",
    "patchify",
    "unpatchify",
]

SUPPORTED: dict[type, type[PackedTransformer]] = {
    WanTransformer3DModel: PackedWan,
    FluxTransformer2DModel: PackedFlux,
}


def _packed_class(model: nn.Module) -> type[PackedTransformer]:
    packed = SUPPORTED.get(type(model))  # exactly: a subclass may change the forward followed
    if packed is None:
        kind = type(model)
        raise ValueError(
            f"{kind.__module__}.{kind.__name__} is not supported (supported: diffusers' "
            f"{', '.join(cls.__name__ for cls in SUPPORTED)})"
        )
    return packed


def pack(model: nn.Module) -> PackedTransformer:
    """The model's packed form for training under a Zellige step: installs Zellige's attention
    processors in `model` (packed.remove() restores its own) and returns the module whose forward
    takes a BalancedStep and this rank's held tokens. ValueError for a model it cannot run."""
    return _packed_class(model)(model)


def model_spec(model: nn.Module, *, text_tokens: int, name: str | None = None) -> _core.ModelSpec:
    """The ModelSpec of a supported diffusers transformer, from its config: the Balancer's head
    count and attention kind, and the cost model's sizes. text_tokens: a typical text length."""
    config = model.config
    kind = _packed_class(model)
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    width = heads * head_dim
    if kind is PackedWan:
        layers = {"num_layers": config.num_layers, "ffn_width": config.ffn_dim}
    else:  # Flux: both block kinds' MLPs are 4 x width
        layers = {
            "num_layers": config.num_layers + config.num_single_layers,
            "num_double_layers": config.num_layers,
            "ffn_width": 4 * width,
        }
    return model_spec_from_dict(
        {
            "name": name or type(model).__name__,
            "width": width,
            "num_heads": heads,
            "head_dim": head_dim,
            "text_tokens": text_tokens,
            "joint_attention": kind is PackedFlux,
            "param_count": sum(p.numel() for p in model.parameters()),
            **layers,
        },
        f"model_spec({type(model).__name__})",
    )
