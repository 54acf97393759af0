"""llama.cpp's pair of files for a vision-language model: the text GGUF (served as usual: mapped, low-bit) plus an
`mmproj` GGUF with the vision tower and projector (`--mmproj FILE`, llama.cpp's flag; written by
`convert_hf_to_gguf.py --mmproj`; LLaVA-1.5's by its legacy `convert_image_encoder_to_gguf.py`, projector type
"mlp", which that converter does not cover).

The mmproj file's `clip.*` metadata becomes the HF-style config the vision model and its processor read
(ModelConfig.mm_config, with the image processor's settings under "preprocessor"); its `v.*` / `mm.*` tensors
map onto the vision modules' names. One record per projector type; a file of another type is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from radixserve.model_loader.gguf_file import GGUFFile, open_gguf
from radixserve.model_loader.model_config import ModelConfig

if TYPE_CHECKING:  # the HTTP process reads the mmproj's config; only the scheduler reads its weights
    import torch

# clip.projector_type -> the architecture whose vision modules it fills
PROJECTORS = {"idefics3": "Idefics3ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration",
              "qwen2.5vl_merger": "Qwen2_5_VLForConditionalGeneration", "mlp": "LlavaForConditionalGeneration"}

# llama.cpp tensor name -> ours, per projector type: the tower's (SigLIP, or CLIP with its class embedding and
# pre-norm; the attribute differs), then the projector's
_TOWER = {"v.patch_embd.weight": "embeddings.patch_embedding.weight", "v.patch_embd.bias": "embeddings.patch_embedding.bias",
          "v.position_embd.weight": "embeddings.position_embedding.weight", "v.post_ln.weight": "post_layernorm.weight",
          "v.post_ln.bias": "post_layernorm.bias", "v.class_embd": "embeddings.class_embedding",
          "v.pre_ln.weight": "pre_layrnorm.weight", "v.pre_ln.bias": "pre_layrnorm.bias"}
_TOWER_ATTR = {"idefics3": "vision_model", "gemma3": "vision_tower", "mlp": "vision_tower"}
_PROJECTOR_NAMES = {
    "idefics3": {"mm.model.fc.weight": "connector.modality_projection.proj.weight"},
    "gemma3": {"mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
               "mm.soft_emb_norm.weight": "multi_modal_projector.mm_soft_emb_norm.weight"},
    "mlp": {f"mm.{i}.{part}": f"multi_modal_projector.linear_{1 + i // 2}.{part}" for i in (0, 2)
            for part in ("weight", "bias")},
}
_BLOCK = {"ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_out": "self_attn.out_proj"}
_BLOCK_RE = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


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


def _token(tokenizer: Any, text: str, mmproj: str) -> int:
    token = tokenizer.convert_tokens_to_ids(text)
    if not isinstance(token, int) or token in (tokenizer.unk_token_id, None):
        raise ValueError(f"--mmproj {mmproj}: the text model's tokenizer has no {text} token")
    return token


def with_mmproj(cfg: ModelConfig, mmproj: str, tokenizer: Any) -> ModelConfig:
    """The text model's ModelConfig as the vision-language model the pair of files is (`tokenizer`: the text
    file's, which names the image tokens)."""
    f = _open(mmproj)
    kind = f.get("clip.projector_type")
    arch = PROJECTORS[kind]
    hidden = f.get("clip.vision.embedding_length")
    size, patch = int(f.get("clip.vision.image_size")), int(f.get("clip.vision.patch_size"))
    vision = {"hidden_size": hidden, "intermediate_size": f.get("clip.vision.feed_forward_length"),
              "num_hidden_layers": f.get("clip.vision.block_count"),
              "num_attention_heads": f.get("clip.vision.attention.head_count"), "image_size": size,
              "patch_size": patch, "layer_norm_eps": f.get("clip.vision.attention.layer_norm_epsilon"),
              "hidden_act": _activation(f)}
    mean, std = f.get("clip.vision.image_mean"), f.get("clip.vision.image_std")
    if kind == "idefics3":
        proj_in = f.tensors["mm.model.fc.weight"].shape  # ggml order: [in, out]
        scale = int(f.get("clip.vision.projector.scale_factor"))
        if int(proj_in[1]) != cfg.hidden_size or int(proj_in[0]) != hidden * scale * scale:
            raise ValueError(f"--mmproj {mmproj}: its projector maps {int(proj_in[0])} -> {int(proj_in[1])}; the "
                             f"text model needs {hidden * scale * scale} -> {cfg.hidden_size} (another model's mmproj?)")
        preprocessor = {"image_processor_type": "Idefics3ImageProcessor", "image_mean": mean, "image_std": std,
                        "size": {"longest_edge": int(f.get("clip.vision.preproc_image_size", 4 * size))},
                        "max_image_size": {"longest_edge": size}}
        mm: dict[str, Any] = {"scale_factor": scale, "image_token_id": _token(tokenizer, "<image>", mmproj)}
    elif kind == "gemma3":  # llama.cpp's converter writes the pool's factor only where it is not 4
        proj = f.tensors["mm.input_projection.weight"].shape  # ggml order of the [vision, text] matrix
        if {int(proj[0]), int(proj[1])} != {hidden, cfg.hidden_size}:
            raise ValueError(f"--mmproj {mmproj}: its projector is {int(proj[1])} x {int(proj[0])}; the text model "
                             f"needs {hidden} x {cfg.hidden_size} (another model's mmproj?)")
        pool = int(f.get("clip.vision.projector.scale_factor", 4))
        side = size // patch // pool
        if side < 1 or (size // patch) % pool:
            raise ValueError(f"--mmproj {mmproj}: a {size // patch}-patch grid does not pool by {pool}")
        boi, eoi, image = (_token(tokenizer, t, mmproj) for t in _GEMMA3_IMAGE_TOKENS)
        preprocessor = {"image_processor_type": "Gemma3ImageProcessor", "image_mean": mean, "image_std": std,
                        "size": {"height": size, "width": size}}
        mm = {"mm_tokens_per_image": side * side, "boi_token_index": boi, "eoi_token_index": eoi,
              "image_token_index": image}
        vision["model_type"] = "siglip_vision_model"  # plain SigLIP positions (no NaViT buckets)
    elif kind == "qwen2.5vl_merger":
        vision, mm, preprocessor = _qwen25vl(f, cfg, mmproj, tokenizer, mean, std)
    elif kind == "mlp":
        mm, preprocessor = _llava(f, cfg, mmproj, tokenizer, vision, mean, std)
    mm.update({"architectures": [arch], "vision_config": vision, "text_config": {"hidden_size": cfg.hidden_size},
               "preprocessor": preprocessor})
    return replace(cfg, architecture=arch, mm_config=mm)


def _activation(f: GGUFFile) -> str:
    """The tower's activation as clip.cpp reads the flags: GELU (tanh form in ggml, as SigLIP's gelu_pytorch_tanh),
    SiLU, or, with neither flag set, quick GELU (CLIP's)."""
    if f.get("clip.use_gelu", False):
        return "gelu_pytorch_tanh"
    return "silu" if f.get("clip.use_silu", False) else "quick_gelu"


def _llava(f: GGUFFile, cfg: ModelConfig, mmproj: str, tokenizer: Any, vision: dict[str, Any], mean: Any, std: Any
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """LLaVA-1.5's CLIP tower and MLP projector, as the legacy converter writes them: the layers past the feature
    layer are already dropped (`block_count` is the tower's N - 1), so the features are the file's last layer's
    output, or the hidden states `clip.vision.feature_layer` lists (0: the embeddings); the CLS row is dropped, as
    clip.cpp does. Images are padded to a square with the mean colour, then resized (clip.cpp, and LLaVA-1.5's own
    `expand2square`): transformers' LlavaImageProcessor with do_pad."""
    if "v.class_embd" not in f.tensors or "mm.0.weight" not in f.tensors:
        raise ValueError(f"--mmproj {mmproj}: an mlp projector needs a CLIP tower (v.class_embd) and mm.0")
    layers = f.get("clip.vision.feature_layer", None)
    feature: int | list[int] = -1 if layers is None else [int(i) for i in layers]
    n_features = 1 if isinstance(feature, int) else len(feature)
    w0 = f.tensors["mm.0.weight"].shape  # ggml order: [in, out]
    w2 = f.tensors["mm.2.weight"].shape if "mm.2.weight" in f.tensors else None
    if w2 is None or int(w0[0]) != vision["hidden_size"] * n_features or int(w2[1]) != cfg.hidden_size:
        got = f"{int(w0[0])} -> {int(w2[1]) if w2 is not None else '?'}"
        raise ValueError(f"--mmproj {mmproj}: its projector maps {got}; the text model needs "
                         f"{vision['hidden_size'] * n_features} -> {cfg.hidden_size} (another model's mmproj?)")
    vision["model_type"] = "clip_vision_model"
    mm = {"image_token_index": _token(tokenizer, "<image>", mmproj), "vision_feature_layer": feature,
          "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
          "multimodal_projector_bias": "mm.0.bias" in f.tensors}
    size = vision["image_size"]
    preprocessor = {"image_processor_type": "LlavaImageProcessor", "do_pad": True, "image_mean": mean,
                    "image_std": std, "size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size},
                    "resample": 3}  # bicubic, as CLIP's processor
    return mm, preprocessor


def _qwen25vl(f: GGUFFile, cfg: ModelConfig, mmproj: str, tokenizer: Any, mean: Any, std: Any
              ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Qwen2.5-VL's vision config, image tokens and image processor from an mmproj file, with llama.cpp's defaults
    for what the converter does not write (clip.cpp: window 112 pixels, merge 2, two frames a patch) and
    transformers' Qwen2VLImageProcessor pixel bounds (4 to 1280 merged tokens)."""
    if cfg.mrope_section is None:
        raise ValueError(f"--mmproj {mmproj}: a Qwen2.5-VL projector needs its qwen2vl text file (M-RoPE), not a "
                         f"{cfg.architecture} one")
    depth, patch = int(f.get("clip.vision.block_count")), int(f.get("clip.vision.patch_size"))
    merge, every = int(f.get("clip.vision.spatial_merge_size", 2)), int(f.get("clip.vision.n_wa_pattern", 0))
    out = int(f.tensors["mm.2.weight"].shape[1])  # ggml order: [in, out]
    if out != cfg.hidden_size:
        raise ValueError(f"--mmproj {mmproj}: its merger gives {out} wide tokens; the text model is {cfg.hidden_size} "
                         "wide (another model's mmproj?)")
    vision = {"depth": depth, "hidden_size": f.get("clip.vision.embedding_length"),
              "intermediate_size": f.get("clip.vision.feed_forward_length"),
              "num_heads": f.get("clip.vision.attention.head_count"), "patch_size": patch, "temporal_patch_size": 2,
              "spatial_merge_size": merge, "window_size": int(f.get("clip.vision.window_size", 112)),
              "fullatt_block_indexes": [i for i in range(depth) if every and (i + 1) % every == 0],
              "out_hidden_size": out, "hidden_act": "silu", "in_channels": 3}
    unit = (patch * merge) ** 2
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "image_mean": mean, "image_std": std,
                    "patch_size": patch, "merge_size": merge, "temporal_patch_size": 2, "min_pixels": 4 * unit,
                    "max_pixels": 1280 * unit}
    return vision, {"image_token_id": _token(tokenizer, "<|image_pad|>", mmproj)}, preprocessor


_QWEN_BLOCK = {"attn_out": "attn.proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "ln1": "norm1", "ln2": "norm2"}
_QWEN_NAMES = {"v.post_ln.weight": "visual.merger.ln_q.weight", "mm.0.weight": "visual.merger.mlp.0.weight",
               "mm.0.bias": "visual.merger.mlp.0.bias", "mm.2.weight": "visual.merger.mlp.2.weight",
               "mm.2.bias": "visual.merger.mlp.2.bias"}


def _qwen25vl_weights(f: GGUFFile, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The converter's split tensors joined back: the patch embedding's two frames (one Conv3d), each block's q, k
    and v (one qkv projection)."""
    import torch  # lazy: the scheduler's weight load only (see the top)

    def read(name: str) -> torch.Tensor:
        return torch.from_numpy(f.dequantize(name).copy()).float()

    blocks: set[str] = set()
    for name in f.tensors:
        m = _BLOCK_RE.match(name)
        if name in _QWEN_NAMES or name in ("v.patch_embd.weight", "v.patch_embd.weight.1"):
            continue
        if m is not None and (m.group(2) in _QWEN_BLOCK or m.group(2) in ("attn_q", "attn_k", "attn_v")):
            blocks.add(m.group(1))
            continue
        raise ValueError(f"--mmproj {path}: tensor {name!r} is not one this projector type has")
    yield "visual.patch_embed.proj.weight", torch.stack([read("v.patch_embd.weight"), read("v.patch_embd.weight.1")],
                                                        dim=2)
    for name, ours in _QWEN_NAMES.items():
        yield ours, read(name)
    for i in sorted(blocks, key=int):
        for part in ("weight", "bias"):
            yield f"visual.blocks.{i}.attn.qkv.{part}", torch.cat([read(f"v.blk.{i}.attn_{x}.{part}") for x in "qkv"])
        for stem, ours in _QWEN_BLOCK.items():
            for part in ("weight", "bias"):
                if f"v.blk.{i}.{stem}.{part}" in f.tensors:
                    yield f"visual.blocks.{i}.{ours}.{part}", read(f"v.blk.{i}.{stem}.{part}")


def iterate_mmproj_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, float32 tensor) for every tensor of the mmproj file; an unknown name is an error before any
    tensor is read."""
    import torch  # lazy: the scheduler's weight load only (see the top)

    f = _open(path)
    kind = f.get("clip.projector_type")
    if kind == "qwen2.5vl_merger":
        yield from _qwen25vl_weights(f, path)
        return
    tower, projector = _TOWER_ATTR[kind], _PROJECTOR_NAMES[kind]
    plan = []
    for name in f.tensors:
        ours = projector.get(name) or (f"{tower}.{_TOWER[name]}" if name in _TOWER else None)
        m = _BLOCK_RE.match(name)
        if ours is None and m is not None and m.group(2) in _BLOCK:
            stem = m.group(2)
            if stem in ("ffn_up", "ffn_down") and _ffn_swapped(f, m.group(1)):
                stem = "ffn_down" if stem == "ffn_up" else "ffn_up"
            ours = f"{tower}.encoder.layers.{m.group(1)}.{_BLOCK[stem]}.{m.group(3)}"
        if ours is None:
            raise ValueError(f"--mmproj {path}: tensor {name!r} is not one this projector type has")
        plan.append((name, ours))
    if kind == "mlp" and "v.post_ln.weight" not in f.tensors:
        # the legacy converter drops CLIP's post-norm, which only feeds CLIP's pooled output: an identity fills it
        hidden = _vision_hidden(f)
        yield f"{tower}.post_layernorm.weight", torch.ones(hidden)
        yield f"{tower}.post_layernorm.bias", torch.zeros(hidden)
    for name, ours in plan:
        t = torch.from_numpy(f.dequantize(name).copy()).float()
        if ours.endswith("mm_soft_emb_norm.weight"):
            t = t - 1.0  # llama.cpp stores Gemma's norm as 1 + w; ours adds the 1 (GemmaRMSNorm)
        elif ours.endswith("mm_input_projection_weight") and t.shape[0] != _vision_hidden(f):
            t = t.t().contiguous()
        yield ours, t


def _ffn_swapped(f: GGUFFile, block: str) -> bool:
    """Older converters (LLaVA's legacy one among them) wrote CLIP's fc1 as ffn_down and fc2 as ffn_up; clip.cpp
    tells them by shape (ffn_down reading the embedding width), and so do we."""
    down = f.tensors.get(f"v.blk.{block}.ffn_down.weight")
    return down is not None and int(down.shape[0]) == _vision_hidden(f)


def _vision_hidden(f: GGUFFile) -> int:
    return int(f.get("clip.vision.embedding_length"))
