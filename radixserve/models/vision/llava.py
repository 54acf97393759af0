"""LLaVA-1.5: a CLIP vision tower, a 2-layer MLP projector, and any text decoder the engine already runs.

The text decoder is the CausalLM of `text_config` (Llama, Mistral, Qwen2 ...): this class adds the tower
and the projector beside it and swaps the input embeddings of the image spans; everything after the
embedding (attention backends, the native decode stack, low-bit kernels, TP) is the text model's.

The tower runs on the float weights in the runner's activation dtype, on the pipeline's first stage, and is
replicated on every TP rank (it is small beside the decoder and runs once per image).

Checkpoint names come in three layouts, all mapped here:
    language_model.model.* / language_model.lm_head.*    (transformers 4 saves, llava-hf)
    model.language_model.* / lm_head.*                   (transformers 5 in memory)
    vision_tower.vision_model.* / vision_tower.* / model.vision_tower.*, multi_modal_projector.* (+ model.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from radixserve.mem_cache.multimodal_cache import MultiModalCache
from radixserve.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from radixserve.model_loader.model_config import ModelConfig
from radixserve.models.base import CausalLM
from radixserve.models.vision.clip import CLIPVisionTower
from radixserve.models.vision.llava_projector import (
    SELECT_STRATEGIES,
    LlavaMultiModalProjector,
    llava_image_features,
)
from radixserve.multimodal.mm_embedding import embed_with_images
from radixserve.multimodal.mm_inputs import MultimodalDataItem


class LlavaForConditionalGeneration(CausalLM):
    non_text_prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, cfg: ModelConfig, ps) -> None:
        super().__init__(cfg, ps)
        mm = cfg.mm_config or {}
        self.feature_layer = mm.get("vision_feature_layer", -2)
        self.select_strategy = mm.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in SELECT_STRATEGIES:
            raise ValueError(f"model config vision_feature_select_strategy {self.select_strategy!r} is not one of "
                             f"{SELECT_STRATEGIES}")
        self.vision_tower = self.multi_modal_projector = None
        if ps.is_first_stage:  # the stage that embeds
            self.vision_tower = CLIPVisionTower(mm["vision_config"])
            self.multi_modal_projector = LlavaMultiModalProjector.from_config(mm)
        # the runner replaces it with one of --mm-encoder-cache-mb
        self.encoder_cache = MultiModalCache(0)

    def encode_image(self, item: MultimodalDataItem) -> torch.Tensor:
        """[span length, hidden]: the projected tower output of one image."""
        dtype = self.multi_modal_projector.linear_1.weight.dtype
        pixels = item.features["pixel_values"].to(dtype)
        return llava_image_features(self.vision_tower, self.multi_modal_projector, pixels, self.feature_layer,
                                    self.select_strategy)[0]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ):
        embeds = None
        if pp_proxy is None and forward_batch.mm_inputs is not None:
            embeds = embed_with_images(input_ids, forward_batch, self.config.vocab_size, self.model.embed,
                                       self.encode_image, self.encoder_cache)
        hidden = self.model(input_ids, positions, forward_batch, pp_proxy, input_embeds=embeds)
        if isinstance(hidden, PPProxyTensors):
            return hidden
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    # ------------------------------------------------------------------ checkpoint
    @staticmethod
    def _our_name(name: str) -> str:
        for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                         ("model.language_model.", "model."), ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def holds_checkpoint_tensor(self, name: str) -> bool:
        name = self._our_name(name)
        if name.startswith(self.non_text_prefixes):
            return self.vision_tower is not None
        return super().holds_checkpoint_tensor(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: list[tuple[str, torch.Tensor]] = []
        projector: list[tuple[str, torch.Tensor]] = []

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for ckpt_name, tensor in weights:
                name = self._our_name(ckpt_name)
                if name.startswith("vision_tower."):
                    vision.append((name.removeprefix("vision_tower."), tensor))
                elif name.startswith("multi_modal_projector."):
                    projector.append((name.removeprefix("multi_modal_projector."), tensor))
                else:
                    yield name, tensor

        super().load_weights(text())
        if self.vision_tower is not None:
            self.vision_tower.load_weights(vision)
            self.multi_modal_projector.load_weights(projector)
