"""CLIPVisionTower + LlavaMultiModalProjector against transformers' LLaVA in float32, loaded from a saved checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from radixserve.models.vision.clip import CLIPVisionTower
from radixserve.models.vision.llava_projector import LlavaMultiModalProjector, llava_image_features
from tests.models.vision_checkpoints import saved_tensors, sub

TOWER, PROJ = "vision_tower.", "multi_modal_projector."


def _config(layers: int, feature_layer: int | list[int], strategy: str, act: str) -> LlavaConfig:
    vc = CLIPVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=layers, num_attention_heads=4,
        image_size=30, patch_size=6, projection_dim=32, hidden_act=act,
    )  # fmt: skip
    tc = LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return LlavaConfig(
        vision_config=vc, text_config=tc, image_token_index=199, projector_hidden_act="gelu",
        vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
    )  # fmt: skip


VARIANTS = {
    "llava15": _config(2, -2, "default", "quick_gelu"),
    "multi_layer_full": _config(3, [-2, -1], "full", "gelu"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(hf model, config, {checkpoint name: tensor}) as save_pretrained wrote it."""
    cfg = VARIANTS[request.param]
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(cfg).eval()
    return model, cfg, saved_tensors(model, tmp_path_factory.mktemp(request.param))


def _build(
    cfg: LlavaConfig, tensors: dict[str, torch.Tensor]
) -> tuple[CLIPVisionTower, LlavaMultiModalProjector]:
    tower = CLIPVisionTower(cfg.vision_config).eval()
    tower.load_weights(sub(tensors, TOWER))
    projector = LlavaMultiModalProjector.from_config(cfg).eval()
    projector.load_weights(sub(tensors, PROJ))
    return tower, projector


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_features_match_transformers(saved, n_images: int) -> None:
    model, cfg, tensors = saved
    tower, projector = _build(cfg, tensors)
    torch.manual_seed(n_images)
    pixels = torch.randn(n_images, 3, 30, 30)
    with torch.no_grad():
        ours = llava_image_features(
            tower, projector, pixels, cfg.vision_feature_layer, cfg.vision_feature_select_strategy
        )
        # transformers 5: an output object whose pooler_output is a list of per-image [tokens, hidden] tensors
        ref = torch.stack(list(model.model.get_image_features(pixel_values=pixels).pooler_output))
    tokens = 25 if cfg.vision_feature_select_strategy == "default" else 26
    assert ours.shape == (n_images, tokens, 64)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_hidden_state_indexing_matches_transformers(saved) -> None:
    model, cfg, tensors = saved
    tower, _ = _build(cfg, tensors)
    pixels = torch.randn(2, 3, 30, 30)
    with torch.no_grad():
        ref = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states
        n = len(ref)
        for idx in [0, 1, -1, -2, -n]:
            torch.testing.assert_close(tower(pixels, idx), ref[idx], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            tower(pixels, [-1, 0]), torch.cat([ref[-1], ref[0]], -1), atol=1e-5, rtol=1e-5
        )
    with pytest.raises(ValueError, match="out of range"):
        tower(pixels, n)


def test_deeper_layers_are_not_run(saved) -> None:
    _, cfg, tensors = saved
    tower, _ = _build(cfg, tensors)

    def boom(*_args: object) -> None:
        raise AssertionError("last encoder layer ran for feature_layer=-2")

    tower.encoder.layers[-1].forward = boom  # type: ignore[method-assign]
    with torch.no_grad():
        tower(torch.randn(1, 3, 30, 30), -2)


def test_config_dict_and_old_prefix(saved) -> None:
    model, cfg, tensors = saved
    tower = CLIPVisionTower(cfg.vision_config.to_dict())
    # Old (transformers 4) checkpoints nest the tower under vision_model. and still carry the position_ids buffer
    old = sub(tensors, TOWER, "vision_model.")
    old.append(("vision_model.embeddings.position_ids", torch.arange(26)[None]))
    loaded = tower.load_weights(old)
    assert loaded == {n for n, _ in tower.named_parameters()}
    pixels = torch.randn(1, 3, 30, 30)
    with torch.no_grad():
        ref = model.model.vision_tower(pixels, output_hidden_states=True).hidden_states[-2]
        torch.testing.assert_close(tower(pixels, -2), ref, atol=1e-5, rtol=1e-5)


def test_wrong_image_size() -> None:
    tower = CLIPVisionTower(VARIANTS["llava15"].vision_config)
    with pytest.raises(ValueError, match="image size"):
        tower(torch.randn(1, 3, 36, 36), -2)


def test_unknown_tensor_name(saved) -> None:
    _, cfg, tensors = saved
    tower = CLIPVisionTower(cfg.vision_config)
    weights = sub(tensors, TOWER) + [("encoder.layers.0.bogus.weight", torch.zeros(3))]
    with pytest.raises(ValueError, match="bogus"):
        tower.load_weights(weights)


def test_shape_mismatch_names_shapes(saved) -> None:
    _, cfg, tensors = saved
    tower = CLIPVisionTower(cfg.vision_config)
    weights = [
        (k, torch.zeros(32, 33) if k == "encoder.layers.0.mlp.fc2.weight" else v)
        for k, v in sub(tensors, TOWER)
    ]
    with pytest.raises(ValueError, match=r"fc2\.weight.*\(32, 33\).*\(32, 37\)"):
        tower.load_weights(weights)


def test_missing_tensor(saved) -> None:
    _, cfg, tensors = saved
    tower = CLIPVisionTower(cfg.vision_config)
    weights = [(k, v) for k, v in sub(tensors, TOWER) if k != "post_layernorm.bias"]
    with pytest.raises(ValueError, match="missing.*post_layernorm.bias"):
        tower.load_weights(weights)
    projector = LlavaMultiModalProjector.from_config(cfg)
    with pytest.raises(ValueError, match="missing.*linear_2.weight"):
        projector.load_weights([(k, v) for k, v in sub(tensors, PROJ) if k != "linear_2.weight"])


def test_bad_config_values() -> None:
    vc = VARIANTS["llava15"].vision_config.to_dict() | {"hidden_act": "gelu_new"}
    with pytest.raises(ValueError, match="vision_config.hidden_act"):
        CLIPVisionTower(vc)
    with pytest.raises(ValueError, match="projector_hidden_act"):
        LlavaMultiModalProjector(32, 64, hidden_act="gelu_new")
    tower = CLIPVisionTower(VARIANTS["llava15"].vision_config)
    projector = LlavaMultiModalProjector(32, 64)
    with pytest.raises(ValueError, match="vision_feature_select_strategy"):
        llava_image_features(tower, projector, torch.randn(1, 3, 30, 30), -2, "cls_patch")
