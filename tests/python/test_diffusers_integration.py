"""zellige.integrations.diffusers: what it refuses, its layouts and spec, and on one rank the
packed forward and backward of each supported model against the unmodified model (the examples'
training, whose multi-rank runs tests/distributed/test_diffusers_examples.py checks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (zellige[diffusers])")

from diffusers import WanTransformer3DModel  # noqa: E402

import zellige  # noqa: E402
from zellige.integrations import diffusers as zd  # noqa: E402
from zellige.runtime import verify  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import diffusers_flux  # noqa: E402
import diffusers_wan  # noqa: E402


@pytest.fixture
def one_process_group():
    verify.init_process_group(0, 1, verify.free_port(), "cpu")
    yield
    dist.destroy_process_group()


def test_unsupported_classes_are_refused() -> None:
    class MyWan(WanTransformer3DModel):
        pass

    for model in (torch.nn.Linear(2, 2), MyWan(**diffusers_wan.CONFIG)):
        with pytest.raises(ValueError, match="is not supported \\(supported: diffusers' Wan"):
            zd.pack(model)


def test_image_conditioned_wan_is_refused() -> None:
    model = WanTransformer3DModel(**diffusers_wan.CONFIG, image_dim=8, added_kv_proj_dim=48)
    with pytest.raises(ValueError, match="image_dim = 8 \\(image conditioning, I2V\\)"):
        zd.pack(model)


def test_a_layer_with_another_processor_is_refused() -> None:
    class MyProcessor:
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return hidden_states

    model = diffusers_flux.build_model(0)
    model.single_transformer_blocks[0].attn.set_processor(MyProcessor())
    with pytest.raises(
        ValueError, match="single_transformer_blocks.0.attn.processor is MyProcessor: Zellige"
    ):
        zd.pack(model)


def test_attention_mask_and_calls_outside_a_packed_forward_are_refused() -> None:
    model = diffusers_wan.build_model(0)
    zd.pack(model)
    x = torch.randn(1, 3, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match="takes no attention mask"):
        model.blocks[0].attn1(x, None, torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="outside a packed forward"):
        model.blocks[0].attn1(x)


def test_remove_restores_the_models_own_processors() -> None:
    model = diffusers_flux.build_model(0)
    before = {name: type(p) for name, p in model.attn_processors.items()}
    packed = zd.pack(model)
    assert {type(p).__name__ for p in model.attn_processors.values()} == {"_FluxZelligeProcessor"}
    assert packed.remove() is model
    assert {name: type(p) for name, p in model.attn_processors.items()} == before


def test_model_specs_come_from_the_configs() -> None:
    wan = zd.model_spec(diffusers_wan.build_model(0), text_tokens=6)
    assert (wan.width, wan.num_heads, wan.head_dim, wan.num_layers, wan.ffn_width) == (
        48, 4, 12, 2, 64,
    )  # fmt: skip
    assert not wan.joint_attention
    flux = zd.model_spec(diffusers_flux.build_model(0), text_tokens=6)
    assert (flux.width, flux.num_heads, flux.num_layers, flux.num_double_layers) == (48, 3, 2, 1)
    assert flux.joint_attention and flux.ffn_width == 4 * 48


def test_patchify_rows_are_the_models_patches_and_unpatchify_inverts_the_output_layout() -> None:
    model = diffusers_wan.build_model(0)
    latents = torch.randn(4, 3, 4, 6, dtype=torch.float64)
    patch = diffusers_wan.PATCH
    rows = zd.patchify(latents, patch)  # [t*h*w, C*p_t*p_h*p_w]
    assert rows.shape == (3 * 2 * 3, 16)
    whole = model.patch_embedding(latents[None]).flatten(2).transpose(1, 2)[0]
    each = model.patch_embedding(rows.unflatten(1, (4, *patch))).flatten(1)
    torch.testing.assert_close(each, whole, rtol=0, atol=1e-14)
    out = zd.patchify(latents, patch, channels_last=True)
    assert torch.equal(zd.unpatchify(out, (3, 2, 3), patch), latents)
    with pytest.raises(ValueError, match="do not divide into patches of 1x2x2"):
        zd.patchify(latents[:, :, :3], patch)


@pytest.mark.parametrize("example", [diffusers_wan, diffusers_flux], ids=["wan", "flux"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_one_rank_matches_the_unmodified_model(one_process_group, example, checkpointing) -> None:
    """Two steps on a world of one (every sequence whole, packed together); with gradient
    checkpointing the blocks are recomputed in the backward, attending with the same step."""
    losses, gradients, _ = example.train(2, "dp-cost", checkpointing=checkpointing)
    reference = example.reference(2, 1)
    worst, what = example.worst_difference(losses, gradients, *reference)
    assert worst <= example.TOLERANCE, what


def test_a_step_for_the_other_attention_kind_is_refused(one_process_group) -> None:
    wan, flux = diffusers_wan.build_model(0), zd.pack(diffusers_flux.build_model(0))
    balancer = zellige.Balancer(zd.model_spec(wan, text_tokens=6), planner="dp-cost")
    step = balancer.step(diffusers_wan.draw_samples(0, 0))
    with pytest.raises(ValueError, match="by joint attention, but the step's model spec says"):
        flux(step, None, None, None, None)
    balancer.close()
