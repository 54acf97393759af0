"""Qwen2.5-VL through the real scheduler (Engine) against transformers' Qwen2_5_VLForConditionalGeneration and
Qwen2VLImageProcessor in float32 on the same tiny random weights: a 3-block vision transformer (windows of 2 x 2
merged patches, one full-attention block, 2-D rotary, the patch merger) and a 2-layer Qwen2 decoder with M-RoPE.

Images of two sizes, one and two per prompt, a text-only request in the batch, chunked prefill through an image,
radix hits on a repeated image (its M-RoPE positions come with the prompt, not from the cache); and the native
decode stack reads the requests' shifted positions (bit for bit the layer-by-layer decode)."""

from __future__ import annotations

import pytest
import torch

import radixserve
from tests.models.test_llava_engine import image
from tests.models.vision_checkpoints import assert_logprobs_close, hf_greedy

NEW = 6
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def make_tiny_qwen25vl(path, default_model_path: str, window: int, pixels: tuple[int, int]) -> str:
    """A tiny random Qwen2.5-VL folder at `path`: windows of `window` pixels, images resized to `pixels` bounds."""
    import transformers

    from radixserve.model_loader import get_tokenizer

    tok = get_tokenizer(default_model_path)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    cfg = transformers.Qwen2_5_VLConfig(
        vision_config={"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4, "patch_size": 4,
                       "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": window,
                       "fullatt_block_indexes": [1], "out_hidden_size": 64, "in_channels": 3},
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
                     "bos_token_id": 1, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(5)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=pixels[0],
                                          max_pixels=pixels[1]).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_qwen25vl(tmp_path_factory, default_model_path):
    # 16-pixel windows: 2 x 2 merged patches, so these small images span several
    return make_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl") / "hf", default_model_path, 16, (64, 4096))


def make_oracle(path: str):
    """transformers' model and image processor on the folder: run(text, images) -> (tokens, logprobs, n)."""
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    improc = transformers.Qwen2VLImageProcessorPil.from_pretrained(path)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")

    def run(text: str, images: list) -> tuple[list[int], list[float], int]:
        """transformers' Qwen2_5_VLProcessor's expansion (its video processor wants torchvision): each image pad
        becomes grid / merge^2 of them."""
        kw = {}
        if images:
            pix = improc(images=images, return_tensors="pt")
            for g in pix["image_grid_thw"]:
                text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(g.prod()) // 4), 1)
            text = text.replace("<|placeholder|>", "<|image_pad|>")
            kw = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
        ids = tok(text, return_tensors="pt")["input_ids"]
        return hf_greedy(model, NEW, ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == pad).int(),
                         **kw)

    return run


@pytest.fixture(scope="module")
def oracle(tiny_qwen25vl):
    return make_oracle(tiny_qwen25vl)


CASES = [(f"User: look {IMG}What is it?", [image(1, (52, 40))]),
         (f"Compare {IMG} with {IMG} please.", [image(2, (30, 64)), image(3, (64, 28))]),
         ("User: text only, no picture at all here", [])]


@pytest.mark.parametrize("args", [{}, {"attention_backend": "torch_native"}, {"chunked_prefill_size": 12, "page_size": 4}],
                         ids=["cpu-paged", "torch-native", "chunked-paged"])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_qwen25vl, oracle, args) -> None:
    refs = [oracle(text, imgs) for text, imgs in CASES]
    with radixserve.Engine(model_path=tiny_qwen25vl, max_total_tokens=2048, quantization="none", dtype="float32",
                           check_invariants=True, show_progress=False, **args) as eng:
        outs = eng.generate(prompt=[t for t, _ in CASES], image_data=[imgs for _, imgs in CASES],
                            sampling_params=GREEDY, return_logprob=True)
        again = eng.generate(prompt=CASES[0][0], image_data=CASES[0][1], sampling_params=GREEDY,
                             return_logprob=True)
    for out, (tokens, logprobs, n) in zip(outs, refs):
        assert out["output_ids"] == tokens
        assert out["meta_info"]["prompt_tokens"] == n
        assert_logprobs_close(out, logprobs)
    assert again["output_ids"] == refs[0][0] and again["meta_info"]["cached_tokens"] >= refs[0][2] - 4


def test_tensor_parallel_and_ngram_speculation_give_the_same_tokens(tiny_qwen25vl, oracle) -> None:
    """tp 2 (the tower replicated, the decoder split) and n-gram drafting (its verify rows take the shifted M-RoPE
    positions too) give transformers' tokens."""
    refs = [oracle(text, imgs)[0] for text, imgs in CASES[:2]]
    for extra in ({"tp_size": 2}, {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3}):
        with radixserve.Engine(model_path=tiny_qwen25vl, max_total_tokens=1024, quantization="none", dtype="float32",
                               check_invariants=True, show_progress=False, **extra) as eng:
            outs = eng.generate(prompt=[t for t, _ in CASES[:2]], image_data=[imgs for _, imgs in CASES[:2]],
                                sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs, extra


def test_the_native_decode_stack_reads_the_shifted_positions(tiny_qwen25vl) -> None:
    """Low-bit weights, where decode steps run the whole stack natively: its tokens and logprobs equal the same
    engine's layer-by-layer decode (--disable-cpu-graph) bit for bit, so the stack got each request's M-RoPE
    position (its position + the prompt's delta, not its position)."""
    runs = []
    for extra in ({}, {"disable_cpu_graph": True}):
        with radixserve.Engine(model_path=tiny_qwen25vl, max_total_tokens=2048, quantization="int8", dtype="float32",
                               show_progress=False, **extra) as eng:
            outs = eng.generate(prompt=[t for t, _ in CASES[:2]], image_data=[imgs for _, imgs in CASES[:2]],
                                sampling_params={**GREEDY, "max_new_tokens": 12}, return_logprob=True)
            runs.append([(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]]) for o in outs])
            if not extra:
                assert eng.get_server_info()["native_decode_steps"] > 0  # the stack ran the decode steps
    assert runs[0] == runs[1]


def test_llama_cpp_text_gguf_and_mmproj_give_the_folders_tokens(tmp_path, default_model_path) -> None:
    """The folder converted by llama.cpp's convert_hf_to_gguf.py (a qwen2vl text GGUF with its M-RoPE sections, and
    --mmproj: q / k / v and the patch embedding's two frames split, which load joined again) serves with --mmproj as
    the folder does. The folder keeps what the mmproj file cannot say as llama.cpp assumes it: 112-pixel windows
    (this image spans four) and transformers' default pixel bounds (4 to 1280 merged tokens)."""
    import subprocess
    import sys

    from tests.models.test_idefics3_engine import CONVERTER

    assert CONVERTER.is_file(), f"{CONVERTER} is missing: run `make setup`"
    (tmp_path / "hf").mkdir()
    folder = make_tiny_qwen25vl(tmp_path / "hf", default_model_path, 112, (4 * 64, 1280 * 64))
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    for out, extra in ((text, []), (mmproj, ["--mmproj"])):
        subprocess.run([sys.executable, str(CONVERTER), folder, "--outtype", "f32", "--outfile", str(out), *extra],
                       check=True, capture_output=True, timeout=300)
    prompt, images = f"User: look {IMG}What is it?", [image(9, (130, 120))]
    tokens, logprobs, n = make_oracle(folder)(prompt, images)
    assert n > 200  # 16 x 15 merged patches: windows of 14 x 14
    with radixserve.Engine(model_path=str(text), mmproj=str(mmproj), max_total_tokens=2048, quantization="none",
                           dtype="float32", show_progress=False) as eng:
        out = eng.generate(prompt=prompt, image_data=images, sampling_params=GREEDY, return_logprob=True)
    assert out["output_ids"] == tokens and out["meta_info"]["prompt_tokens"] == n
    assert_logprobs_close(out, logprobs)
    from radixserve.model_loader import get_model_config, get_tokenizer
    from radixserve.model_loader.mmproj import with_mmproj

    with pytest.raises(ValueError, match="qwen2vl text file"):  # beside a text model without M-RoPE
        with_mmproj(get_model_config(default_model_path), str(mmproj), get_tokenizer(default_model_path))
