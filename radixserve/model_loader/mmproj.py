"""llama.cpp's pair of files for a vision-language model: the text GGUF (served as usual: mapped, low-bit) plus an
`mmproj` GGUF with the vision tower and projector (`--mmproj FILE`, llama.cpp's flag; written by
`convert_hf_to_gguf.py --mmproj`).

The mmproj file's `clip.*` metadata becomes the HF-style config the vision model and its processor read
(ModelConfig.mm_config, with the image processor's settings under "preprocessor"); its `v.*` / `mm.*` tensors
map onto the vision modules' names. One record per projector type; a file of another type is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from radixserve.model_loader.gguf_file import GGUFFile, open_gguf
from radixserve.model_loader.model_config import ModelConfig

# clip.projector_type -> (the architecture whose vision modules it fills, the text of its image placeholder token)
PROJECTORS = {"idefics3": ("Idefics3ForConditionalGeneration", "<image>")}

# llama.cpp tensor name -> ours (Idefics3: SigLIP + pixel-shuffle connector); {i} = a block
_IDEFICS3_NAMES = {
    "v.patch_embd.weight": "vision_model.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_model.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_model.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_model.post_layernorm.weight",
    "v.post_ln.bias": "vision_model.post_layernorm.bias",
    "mm.model.fc.weight": "connector.modality_projection.proj.weight",
}
_BLOCK = {"ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj"}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _open(path: str) -> GGUFFile:
    f = open_gguf(path, light=True)
    if f.get("general.architecture", None) != "clip" or not f.get("clip.has_vision_encoder", False):
        raise ValueError(f"--mmproj {path}: not an mmproj file with a vision encoder (general.architecture "
                         f"{f.get('general.architecture', None)!r})")
    kind = f.get("clip.projector_type", None)
    if kind not in PROJECTORS:
        raise ValueError(f"--mmproj {path}: clip.projector_type {kind!r} is not supported (supported: "
                         f"{', '.join(PROJECTORS)})")
    return f


def with_mmproj(cfg: ModelConfig, mmproj: str, tokenizer: Any) -> ModelConfig:
    """The text model's ModelConfig as the vision-language model the pair of files is (`tokenizer`: the text
    file's, which names the image placeholder token)."""
    f = _open(mmproj)
    arch, placeholder = PROJECTORS[f.get("clip.projector_type")]
    image_token_id = tokenizer.convert_tokens_to_ids(placeholder)
    if not isinstance(image_token_id, int) or image_token_id in (tokenizer.unk_token_id, None):
        raise ValueError(f"--mmproj {mmproj}: the text model's tokenizer has no {placeholder} token")
    hidden = f.get("clip.vision.embedding_length")
    proj_in = f.tensors["mm.model.fc.weight"].shape  # ggml order: [in, out]
    scale = int(f.get("clip.vision.projector.scale_factor"))
    if int(proj_in[1]) != cfg.hidden_size or int(proj_in[0]) != hidden * scale * scale:
        raise ValueError(f"--mmproj {mmproj}: its projector maps {int(proj_in[0])} -> {int(proj_in[1])}; the text "
                         f"model needs {hidden * scale * scale} -> {cfg.hidden_size} (another model's mmproj?)")
    size = int(f.get("clip.vision.image_size"))
    vision = {"hidden_size": hidden, "intermediate_size": f.get("clip.vision.feed_forward_length"),
              "num_hidden_layers": f.get("clip.vision.block_count"),
              "num_attention_heads": f.get("clip.vision.attention.head_count"), "image_size": size,
              "patch_size": f.get("clip.vision.patch_size"),
              "layer_norm_eps": f.get("clip.vision.attention.layer_norm_epsilon"),
              # llama.cpp's GELU is the tanh form, as SigLIP's gelu_pytorch_tanh
              "hidden_act": "gelu_pytorch_tanh" if f.get("clip.use_gelu", True) else "silu"}
    preprocessor = {"image_processor_type": "Idefics3ImageProcessor", "image_mean": f.get("clip.vision.image_mean"),
                    "image_std": f.get("clip.vision.image_std"),
                    "size": {"longest_edge": int(f.get("clip.vision.preproc_image_size", 4 * size))},
                    "max_image_size": {"longest_edge": size}}
    mm: dict[str, Any] = {"architectures": [arch], "vision_config": vision, "scale_factor": scale,
                          "image_token_id": image_token_id, "text_config": {"hidden_size": cfg.hidden_size},
                          "preprocessor": preprocessor}
    return replace(cfg, architecture=arch, mm_config=mm)


def iterate_mmproj_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, float32 tensor) for every tensor of the mmproj file; an unknown name is an error before any
    tensor is read."""
    f = _open(path)
    plan = []
    for name in f.tensors:
        ours = _IDEFICS3_NAMES.get(name)
        m = _BLOCK_RE.match(name)
        if ours is None and m is not None and m.group(2) in _BLOCK:
            ours = f"vision_model.encoder.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"
        if ours is None:
            raise ValueError(f"--mmproj {path}: tensor {name!r} is not one this projector type has")
        plan.append((name, ours))
    for name, ours in plan:
        yield ours, torch.from_numpy(f.dequantize(name).copy()).float()
