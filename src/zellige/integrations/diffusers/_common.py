"""What every packed diffusers transformer shares: installing Zellige's attention processors and
refusing what they cannot run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from zellige.balancer import BalancedStep


class StepSlot:
    """The step the installed processors attend with. The packed forward sets it; it stays set
    after the forward, so a block recomputed in the backward (gradient checkpointing) attends
    with the same step."""

    def __init__(self) -> None:
        self.step: BalancedStep | None = None

    def get(self) -> BalancedStep:
        if self.step is None:
            raise ValueError(
                "a Zellige attention processor ran outside a packed forward: call the packed "
                "model (packed(step, ...)), not the diffusers model, while its processors are "
                "installed (packed.remove() restores the model's own)"
            )
        return self.step


def refuse_mask(attention_mask: object) -> None:
    if attention_mask is not None:
        raise ValueError(
            "Zellige's attention takes no attention mask: each sequence attends to all of its "
            "own tokens (and its own text), never to another's; drop padding instead of masking it"
        )


class PackedTransformer(nn.Module):
    """A diffusers transformer whose attention layers run Zellige's processors; its forward takes a
    BalancedStep and this rank's held tokens. The diffusers model is `self.model`, its code and
    weights unedited; wrap this module (not the model) with FSDP2 or DDP so that their hooks see
    the forward that runs."""

    default_processor: type  # the diffusers processor class this integration replaces

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        _check_processors(model, self.default_processor)
        self.model = model
        self._slot = StepSlot()
        self._saved_processors = dict(model.attn_processors)
        model.set_attn_processor(self._processor(self._slot))

    def _processor(self, slot: StepSlot) -> object:
        raise NotImplementedError

    def remove(self) -> nn.Module:
        """Restores the model's own attention processors and returns the model."""
        self.model.set_attn_processor(dict(self._saved_processors))
        return self.model

    def _begin(self, step: BalancedStep, joint: bool) -> None:
        if step.joint_attention != joint:
            kind = "joint attention" if joint else "cross-attention"
            raise ValueError(
                f"{type(self.model).__name__} attends to text by {kind}, but the step's model "
                f"spec says joint_attention = {str(step.joint_attention).lower()}: build the "
                "Balancer with zellige.integrations.diffusers.model_spec(model)"
            )
        self._slot.step = step


def _check_processors(model: nn.Module, default: type) -> None:
    """ValueError naming the first attention layer whose processor is not the model's default one
    (an IP-adapter or a user's processor computes something Zellige's would not) or that runs
    diffusers' own context parallelism."""
    processors = model.attn_processors
    if not processors:
        raise ValueError(f"{type(model).__name__} has no attention processors to replace")
    for name, processor in processors.items():
        if type(processor) is not default:
            raise ValueError(
                f"{name} is {type(processor).__name__}: Zellige replaces only diffusers' "
                f"{default.__name__} (model.set_attn_processor({default.__name__}()) restores it)"
            )
        if getattr(processor, "_parallel_config", None) is not None:
            raise ValueError(
                f"{name} runs diffusers' context parallelism: Zellige places the sequences "
                "itself; build the model without enable_parallelism"
            )
