"""SiglipVisionTower + Idefics3Connector against transformers' Idefics3 (and plain SigLIP) in float32, loaded from
a saved checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    LlamaConfig,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from radixserve.models.vision.idefics3_connector import Idefics3Connector, idefics3_image_features
from radixserve.models.vision.siglip import SiglipVisionTower, navit_position_ids
from tests.models.vision_checkpoints import saved_tensors, sub

# transformers 5 saves Idefics3ForConditionalGeneration as model.vision_model.*, model.connector.*,
# model.text_model.*, lm_head.*
TOWER, CONN = "model.vision_model.", "model.connector."


def _config(image_size: int, patch_size: int, scale_factor: int) -> Idefics3Config:
    vc = {
        "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
        "image_size": image_size, "patch_size": patch_size,
    }  # fmt: skip
    tc = LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return Idefics3Config(vision_config=vc, text_config=tc, scale_factor=scale_factor, image_token_id=199)


VARIANTS = {
    "grid8_s2": _config(32, 4, 2),
    # A 25x25 grid: Idefics3's bucketed position ids are not arange there (they repeat and skip ids)
    "grid25_s5": _config(50, 2, 5),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(hf model, config, {checkpoint name: tensor}) as save_pretrained wrote it."""
    cfg = VARIANTS[request.param]
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(cfg).eval()
    return model, cfg, saved_tensors(model, tmp_path_factory.mktemp(request.param))


def _build(
    cfg: Idefics3Config, tensors: dict[str, torch.Tensor]
) -> tuple[SiglipVisionTower, Idefics3Connector]:
    tower = SiglipVisionTower(cfg.vision_config).eval()
    tower.load_weights(sub(tensors, TOWER))
    connector = Idefics3Connector.from_config(cfg).eval()
    connector.load_weights(sub(tensors, CONN))
    return tower, connector


def test_checkpoint_layout(saved) -> None:
    _, _, tensors = saved
    prefixes = {k.split(".")[0] if k.startswith("lm_head") else ".".join(k.split(".")[:2]) for k in tensors}
    assert prefixes == {"model.vision_model", "model.connector", "model.text_model", "lm_head"}


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_features_match_transformers(saved, n_images: int) -> None:
    model, cfg, tensors = saved
    tower, connector = _build(cfg, tensors)
    size = cfg.vision_config.image_size
    torch.manual_seed(n_images)
    pixels = torch.randn(n_images, 3, size, size)
    tokens = (size // cfg.vision_config.patch_size) ** 2 // cfg.scale_factor**2
    with torch.no_grad():
        ours = idefics3_image_features(tower, connector, pixels)
        # transformers 5: an output object; pooler_output is a list (one per batch row) of the row's images'
        # tokens flattened to [images * tokens, text_hidden]. Both layouts: all images in one row, one per row.
        mask = torch.ones(1, n_images, size, size, dtype=torch.bool)
        out = model.model.get_image_features(pixel_values=pixels[None], pixel_attention_mask=mask)
        per_row = model.model.get_image_features(
            pixel_values=pixels[:, None], pixel_attention_mask=mask.transpose(0, 1)
        ).pooler_output
        hidden = tower(pixels)
    assert ours.shape == (n_images, tokens, 64)
    assert len(out.pooler_output) == 1
    torch.testing.assert_close(ours.reshape(-1, 64), out.pooler_output[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, torch.stack(list(per_row)), atol=1e-5, rtol=1e-5)
    # The tower alone is Idefics3VisionTransformer's last_hidden_state (post_layernorm applied)
    torch.testing.assert_close(hidden, out.last_hidden_state, atol=1e-5, rtol=1e-5)


def test_position_ids_are_transformers_bucketing(saved) -> None:
    model, cfg, _ = saved
    g = cfg.vision_config.image_size // cfg.vision_config.patch_size
    emb = model.model.vision_model.embeddings
    seen = []
    hook = emb.position_embedding.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    try:
        with torch.no_grad():
            emb(
                torch.randn(2, 3, g * emb.patch_size, g * emb.patch_size),
                torch.ones(2, g, g, dtype=torch.bool),
            )
    finally:
        hook.remove()
    ours = navit_position_ids(g)
    assert torch.equal(seen[0], ours.expand(2, -1))
    assert torch.equal(ours, torch.arange(g * g)) == (g != 25)  # the 25 grid exercises the non-arange case


def test_config_dict_and_old_prefix(saved) -> None:
    model, cfg, tensors = saved
    tower = SiglipVisionTower(cfg.vision_config.to_dict())
    loaded = tower.load_weights(sub(tensors, TOWER, "vision_model."))
    assert loaded == {n for n, _ in tower.named_parameters()}
    connector = Idefics3Connector.from_config(cfg.to_dict())
    connector.load_weights(sub(tensors, CONN))
    assert connector.scale_factor == cfg.scale_factor
    size = cfg.vision_config.image_size
    pixels = torch.randn(1, 3, size, size)
    with torch.no_grad():
        ref = model.model.get_image_features(pixel_values=pixels[None]).pooler_output[0]
        torch.testing.assert_close(
            idefics3_image_features(tower, connector, pixels)[0], ref, atol=1e-5, rtol=1e-5
        )


def test_plain_siglip_uses_arange_positions() -> None:
    # A plain SiglipVisionConfig (model_type siglip_vision_model) indexes position embeddings with arange; on a
    # 25x25 grid that differs from Idefics3's bucketing, so this checks the model_type switch
    vc = SiglipVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=50,
        patch_size=2, vision_use_head=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = SiglipVisionModel(vc).eval()
    tower = SiglipVisionTower(vc.to_dict())
    tower.load_weights(model.state_dict().items())  # vision_model.* names
    pixels = torch.randn(2, 3, 50, 50)
    with torch.no_grad():
        torch.testing.assert_close(
            tower(pixels), model(pixel_values=pixels).last_hidden_state, atol=1e-5, rtol=1e-5
        )


def test_wrong_image_size() -> None:
    tower = SiglipVisionTower(VARIANTS["grid8_s2"].vision_config)
    with pytest.raises(ValueError, match="image size 36x36"):
        tower(torch.randn(1, 3, 36, 36))
    with pytest.raises(ValueError, match=r"\[N, C, H, W\]"):
        tower(torch.randn(3, 32, 32))


def test_unknown_tensor_name(saved) -> None:
    _, cfg, tensors = saved
    tower = SiglipVisionTower(cfg.vision_config)
    weights = sub(tensors, TOWER) + [("encoder.layers.0.bogus.weight", torch.zeros(3))]
    with pytest.raises(ValueError, match="bogus"):
        tower.load_weights(weights)
    # The whole-model prefix is not stripped: callers pass tower-relative names
    with pytest.raises(ValueError, match="model.vision_model.embeddings"):
        tower.load_weights(sub(tensors, TOWER, TOWER))
    connector = Idefics3Connector.from_config(cfg)
    with pytest.raises(ValueError, match="modality_projection.proj.bias"):
        connector.load_weights(sub(tensors, CONN) + [("modality_projection.proj.bias", torch.zeros(64))])


def test_shape_mismatch_names_shapes(saved) -> None:
    _, cfg, tensors = saved
    tower = SiglipVisionTower(cfg.vision_config)
    weights = [
        (k, torch.zeros(32, 33) if k == "encoder.layers.0.mlp.fc2.weight" else v)
        for k, v in sub(tensors, TOWER)
    ]
    with pytest.raises(ValueError, match=r"fc2\.weight.*\(32, 33\).*\(32, 37\)"):
        tower.load_weights(weights)
    # A connector built with the wrong scale_factor has a different projection width
    s = cfg.scale_factor
    connector = Idefics3Connector(32, 64, scale_factor=s + 1)
    with pytest.raises(ValueError, match=rf"\(64, {32 * s * s}\).*\(64, {32 * (s + 1) ** 2}\)"):
        connector.load_weights(sub(tensors, CONN))


def test_missing_tensor(saved) -> None:
    _, cfg, tensors = saved
    tower = SiglipVisionTower(cfg.vision_config)
    weights = [(k, v) for k, v in sub(tensors, TOWER) if k != "embeddings.patch_embedding.bias"]
    with pytest.raises(ValueError, match=r"missing.*embeddings\.patch_embedding\.bias"):
        tower.load_weights(weights)
    connector = Idefics3Connector.from_config(cfg)
    with pytest.raises(ValueError, match=r"missing.*modality_projection\.proj\.weight"):
        connector.load_weights([])


def test_bad_config_values() -> None:
    vc = VARIANTS["grid8_s2"].vision_config.to_dict()
    with pytest.raises(ValueError, match="vision_config.hidden_act"):
        SiglipVisionTower(vc | {"hidden_act": "gelu_new"})
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        SiglipVisionTower(vc | {"image_size": 30})
    with pytest.raises(ValueError, match="non-square"):
        SiglipVisionTower(vc | {"image_size": [32, 16]})
    tower = SiglipVisionTower(vc)  # 8x8 patch grid
    with pytest.raises(ValueError, match="scale_factor=3"):
        idefics3_image_features(tower, Idefics3Connector(32, 64, scale_factor=3), torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="hidden_size=32"):
        idefics3_image_features(tower, Idefics3Connector(48, 64), torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="square patch grid"):
        Idefics3Connector(32, 64).pixel_shuffle(torch.randn(1, 60, 32))
