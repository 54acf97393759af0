"""VisionLanguageModel: a vision tower and a projector beside any text decoder the engine already runs.

The text decoder is the CausalLM of `text_config` (Llama, Mistral, Qwen2 ...): this class adds the vision
modules beside it and swaps the input embeddings of the image spans (multimodal/mm_embedding.py); everything
after the embedding (attention backends, the native decode stack, low-bit kernels, TP) is the text model's.

The vision modules run on the float weights in the runner's activation dtype, on the pipeline's first stage,
replicated on every TP rank (they are small beside the decoder and run once per image). A subclass names its
modules (`vision_modules`: attribute -> builder), how checkpoint names map onto ours (`checkpoint_renames`, first
matching prefix wins) and how one image item becomes its rows (`encode_image`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from radixserve.mem_cache.multimodal_cache import MultiModalCache
from radixserve.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from radixserve.model_loader.model_config import ModelConfig
from radixserve.models.base import CausalLM
from radixserve.multimodal.mm_embedding import embed_with_images
from radixserve.multimodal.mm_inputs import MultimodalDataItem

VisionBuilders = dict[str, Callable[[dict[str, Any]], nn.Module]]  # attribute -> its module from the HF config


class VisionLanguageModel(CausalLM):
    vision_modules: ClassVar[VisionBuilders] = {}
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, cfg: ModelConfig, ps: Any) -> None:
        self.non_text_prefixes = tuple(f"{name}." for name in self.vision_modules)
        super().__init__(cfg, ps)
        self.has_vision = ps.is_first_stage  # the stage that embeds
        for name, build in self.vision_modules.items():
            setattr(self, name, build(cfg.mm_config or {}) if self.has_vision else None)
        self.encoder_cache = MultiModalCache(0)  # the runner sets one of --mm-encoder-cache-mb
        self.vision_from_mmproj = False  # --mmproj: the vision tensors come from their own file (load_vision_weights)

    def encode_image(self, item: MultimodalDataItem) -> torch.Tensor:
        """[span length, text hidden]: the tower's projected rows for one image item."""
        raise NotImplementedError

    @property
    def vision_dtype(self) -> torch.dtype:
        return next(getattr(self, next(iter(self.vision_modules))).parameters()).dtype

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
        pp_proxy: PPProxyTensors | None = None,
    ) -> Any:
        embeds = None
        if pp_proxy is None and forward_batch.mm_inputs is not None:
            embeds = embed_with_images(input_ids, forward_batch, self.config.vocab_size, self.model.embed,
                                       self.encode_image, self.encoder_cache)
        hidden = self.model(input_ids, positions, forward_batch, pp_proxy, input_embeds=embeds)
        if isinstance(hidden, PPProxyTensors):
            return hidden
        return self.logits_processor(hidden, self.lm_head, forward_batch)

    # ------------------------------------------------------------------ checkpoint
    def checkpoint_name(self, name: str) -> str:
        for old, new in self.checkpoint_renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def holds_checkpoint_tensor(self, name: str) -> bool:
        name = self.checkpoint_name(name)
        if name.startswith(self.non_text_prefixes):
            return self.has_vision
        return super().holds_checkpoint_tensor(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        vision: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in self.vision_modules}

        def text() -> Iterator[tuple[str, torch.Tensor]]:
            for ckpt_name, tensor in weights:
                name = self.checkpoint_name(ckpt_name)
                head = name.split(".", 1)[0]
                if head in vision and "." in name:
                    vision[head].append((name.split(".", 1)[1], tensor))
                else:
                    yield name, tensor

        super().load_weights(text())
        if self.has_vision and not self.vision_from_mmproj:
            self.load_vision_weights(t for name, tensors in vision.items() for t in
                                     ((f"{name}.{n}", x) for n, x in tensors))

    def load_vision_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every vision module's tensors (our names), strictly: each module refuses unknown or missing ones."""
        parts: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in self.vision_modules}
        for name, tensor in weights:
            head, _, rest = name.partition(".")
            if head not in parts:
                raise ValueError(f"vision tensor {name!r} belongs to no vision module of {type(self).__name__}")
            parts[head].append((rest, tensor))
        for head, tensors in parts.items():
            getattr(self, head).load_weights(tensors)


def attach_vision(model: nn.Module, server_args: Any) -> None:
    """A runner's vision-language model: its encoder cache (--mm-encoder-cache-mb), and whether its vision tensors
    come from an --mmproj file (then the text checkpoint's loader leaves them to load_vision_weights)."""
    model.encoder_cache = MultiModalCache(int(server_args.mm_encoder_cache_mb * 2**20))
    model.vision_from_mmproj = bool(server_args.mmproj)
