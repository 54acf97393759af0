"""LLaVA through the real scheduler (Engine) against transformers' LlavaForConditionalGeneration in float32 on
the same tiny random weights: greedy tokens and logprobs with 1 and 2 images, with chunked prefill cutting an
image span, with a radix hit on a repeated image (and a miss on another image), in one batch with a text-only
request; LLaVA-1.5's pair of llama.cpp files (text GGUF + the legacy converter's mmproj); and the refusals (placeholders vs images, a text-only model, absurd counts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import radixserve
from tests.models.vision_checkpoints import assert_logprobs_close, hf_greedy

IMAGE_TOKEN = 11  # SmolLM2's `<jupyter_start>`: one token of the default model's tokenizer stands in for <image>
NEW = 8
SPAN = 25  # (30 / 6)^2 patches, CLS dropped


def make_tiny_llava(path) -> None:
    import transformers

    torch.manual_seed(0)
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                       image_size=30, patch_size=6, projection_dim=32)
    tc = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg = transformers.LlavaConfig(vision_config=vc, text_config=tc, image_token_index=IMAGE_TOKEN,
                                   projector_hidden_act="gelu", vision_feature_layer=-2,
                                   vision_feature_select_strategy="default")
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(path)
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}
                                       ).save_pretrained(path)


def image(seed: int, size: tuple[int, int] = (50, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava") / "hf"
    make_tiny_llava(path)
    return str(path)


@pytest.fixture(scope="module")
def oracle(tiny_llava):
    """prompt ids (one IMAGE_TOKEN per image) + images -> transformers' greedy tokens and their logprobs."""
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
    proc = transformers.CLIPImageProcessorPil.from_pretrained(tiny_llava)

    def run(ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[float]]:
        expanded = [t for x in ids for t in ([IMAGE_TOKEN] * SPAN if x == IMAGE_TOKEN else [x])]
        inputs = torch.tensor([expanded])
        kwargs = {}
        if images:
            kwargs["pixel_values"] = proc(images=images, return_tensors="pt")["pixel_values"]
        return hf_greedy(model, NEW, inputs, attention_mask=torch.ones_like(inputs), **kwargs)[:2]

    return run


def prompt(seed: int, n_images: int, length: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(20, 49000, (length,), generator=g).tolist()
    for k in range(n_images):
        ids.insert(3 + 4 * k, IMAGE_TOKEN)
    return ids


GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("args", [
    {}, {"chunked_prefill_size": 7},
    {"page_size": 4, "mm_encoder_cache_mb": 0, "speculative_algorithm": "ngram", "speculative_num_draft_tokens": 3},
], ids=["whole", "chunk-cuts-image", "paged-no-encoder-cache-ngram"])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_llava, default_model_path, oracle, args) -> None:
    a, b = image(1), image(2, (64, 48))
    # the last prompt ends with the 3 tokens before its image: an n-gram draft would copy the image span
    cases = [(prompt(0, 1), [a]), (prompt(1, 2), [a, b]), (prompt(2, 0), []), (prompt(3, 1) + prompt(3, 1)[:3], [b])]
    refs = [oracle(ids, imgs) for ids, imgs in cases]
    with radixserve.Engine(model_path=tiny_llava, tokenizer_path=default_model_path, max_total_tokens=2048,
                           quantization="none", dtype="float32", check_invariants=True, show_progress=False,
                           **args) as eng:
        # one batch: a text-only request beside the image ones
        outs = eng.generate(input_ids=[ids for ids, _ in cases], image_data=[imgs for _, imgs in cases],
                            sampling_params=GREEDY, return_logprob=True)
        # the same image again: its span comes from the radix cache; another image: a miss at its span
        again = eng.generate(input_ids=cases[0][0], image_data=[a], sampling_params=GREEDY, return_logprob=True)
        other = eng.generate(input_ids=cases[0][0], image_data=[b], sampling_params=GREEDY, return_logprob=True)
        encoder = eng.get_server_info()["mm_encoder_cache"]
    if args.get("mm_encoder_cache_mb") == 0:  # nothing kept: every step that computes a span runs the tower
        assert encoder["images"] == 0 and encoder["hits"] == 0 and encoder["misses"] >= 5
    else:  # each image encoded once, whatever the chunks and requests that read it
        assert encoder["images"] == 2 and encoder["misses"] == 2 and encoder["hits"] >= 3
    for out, (tokens, logprobs), (ids, imgs) in zip(outs, refs, cases):
        assert out["output_ids"] == tokens
        assert_logprobs_close(out, logprobs)
        assert out["meta_info"]["prompt_tokens"] == len(ids) + (SPAN - 1) * len(imgs)  # image tokens count
    assert again["output_ids"] == refs[0][0]
    page = args.get("page_size", 1)
    assert again["meta_info"]["cached_tokens"] >= (3 + SPAN) // page * page  # past the image span
    ref_other = oracle(cases[0][0], [b])
    assert other["output_ids"] == ref_other[0]
    assert other["meta_info"]["cached_tokens"] <= 3  # the text before the image, not a's span


def test_refusals(tiny_llava, default_model_path) -> None:
    with radixserve.Engine(model_path=tiny_llava, tokenizer_path=default_model_path, max_total_tokens=1024,
                           quantization="none", dtype="float32", show_progress=False,
                           max_images_per_request=2) as eng:
        with pytest.raises(ValueError, match="image_data: the prompt has 1 image placeholder"):
            eng.generate(input_ids=prompt(0, 1), image_data=[image(1), image(2)], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="image_data: the prompt has 2 image placeholder"):
            eng.generate(input_ids=prompt(0, 2), image_data=[image(1)], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="image"):  # the count bound, before anything is decoded
            eng.generate(input_ids=prompt(0, 1), image_data=[b"x"] * 10**6, sampling_params=GREEDY)
        with pytest.raises(ValueError, match="image 0"):
            eng.generate(input_ids=prompt(0, 1), image_data=[b"not an image"], sampling_params=GREEDY)
        # a pad value sent as a token id is not an image
        with pytest.raises(ValueError, match="input_ids"):
            eng.generate(input_ids=[1, 2, 49152 + 5], sampling_params=GREEDY)
        # the server still serves
        assert len(eng.generate(input_ids=prompt(0, 1), image_data=[image(1)], sampling_params=GREEDY)
                   ["output_ids"]) == NEW


def test_a_text_model_refuses_images(default_model_path) -> None:
    from radixserve.managers.io_struct import GenerateReqInput
    from radixserve.managers.request_normalizer import RequestLimits, RequestNormalizer
    from radixserve.server_args import ServerArgs

    limits = RequestLimits.build(ServerArgs(), 2048, 49152, 4096)
    norm = RequestNormalizer(None, limits)
    with pytest.raises(ValueError, match="image_data: this model takes no images"):
        norm.normalize(GenerateReqInput(input_ids=[1, 2, 3], image_data=[image(1)]))


def test_ngram_drafts_stop_at_an_image_span() -> None:
    from radixserve.managers.req import Req
    from radixserve.multimodal.mm_inputs import MultimodalDataItem, MultimodalInputs
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.speculative.ngram import NgramProposer

    pad = 100 + 7
    ids = [5, 6, 7, 8, pad, pad, pad, 9, 5, 6]
    mm = MultimodalInputs([MultimodalDataItem("image", 7, pad, 4, 3)], IMAGE_TOKEN)
    req = Req("r", ids, SamplingParams(), mm_inputs=mm, vocab_size=100)
    req.output_ids = [7]
    assert NgramProposer(2, 8).propose([req], [4])[0].tokens == [8]  # [8, pad, pad, pad] cut at the span
    text = Req("t", [5, 6, 7, 8, 1, 2, 3, 9, 5, 6], SamplingParams())
    text.output_ids = [7]
    assert NgramProposer(2, 8).propose([text], [4])[0].tokens == [8, 1, 2, 3]


def test_tensor_parallel_and_pipeline_stages_give_the_same_tokens(tiny_llava, default_model_path, oracle) -> None:
    """tp 2 (the tower replicated on both ranks, the decoder split) and pp 2 (the tower on the first stage only)."""
    a, b = image(1), image(2, (64, 48))
    cases = [(prompt(0, 1), [a]), (prompt(1, 2), [a, b])]
    refs = [oracle(ids, imgs)[0] for ids, imgs in cases]
    for parallel in ({"tp_size": 2}, {"pp_size": 2}):
        with radixserve.Engine(model_path=tiny_llava, tokenizer_path=default_model_path, max_total_tokens=1024,
                               quantization="none", dtype="float32", check_invariants=True, show_progress=False,
                               chunked_prefill_size=16, **parallel) as eng:
            outs = eng.generate(input_ids=[ids for ids, _ in cases], image_data=[imgs for _, imgs in cases],
                                sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs, parallel


def test_a_lora_adapter_on_the_decoder_equals_peft(tiny_llava, default_model_path, tmp_path) -> None:
    """A PEFT adapter of the LLaVA's language model (its names: model.language_model.layers...) applies per request
    beside the image, as peft's model gives; one of the vision tower's projections is refused by name."""
    import copy

    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    base = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_llava, dtype=torch.float32).eval()
    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)",
                     lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(tmp_path / "dec")
    ref_model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "dec").eval()
    proc = transformers.CLIPImageProcessorPil.from_pretrained(tiny_llava)
    ids = prompt(0, 1)
    expanded = torch.tensor([[t for x in ids for t in ([IMAGE_TOKEN] * SPAN if x == IMAGE_TOKEN else [x])]])
    with torch.no_grad():
        out = ref_model.generate(input_ids=expanded, attention_mask=torch.ones_like(expanded), max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 pixel_values=proc(images=[image(1)], return_tensors="pt")["pixel_values"])
    want = out[0, expanded.shape[1]:].tolist()
    vision = LoraConfig(r=4, lora_alpha=8, target_modules=r".*vision_tower.*\.q_proj", init_lora_weights=False)
    get_peft_model(copy.deepcopy(base), vision).save_pretrained(tmp_path / "vis")
    with radixserve.Engine(model_path=tiny_llava, tokenizer_path=default_model_path, max_total_tokens=1024,
                           quantization="none", dtype="float32", show_progress=False,
                           lora_paths=(f"dec={tmp_path / 'dec'}",)) as eng:
        plain = eng.generate(input_ids=ids, image_data=[image(1)], sampling_params=GREEDY)
        adapted = eng.generate(input_ids=ids, image_data=[image(1)], sampling_params=GREEDY, lora_path="dec")
    assert adapted["output_ids"] == want and plain["output_ids"] != want
    with pytest.raises(Exception, match="vision_tower"):  # adapters apply to the decoder only
        radixserve.Engine(model_path=tiny_llava, tokenizer_path=default_model_path, max_total_tokens=1024,
                          quantization="none", dtype="float32", show_progress=False,
                          lora_paths=(f"vis={tmp_path / 'vis'}",))


LLAMA_CPP = Path(sys.executable).parents[1] / "llama.cpp"  # make setup puts llama.cpp's converters there
# The legacy converter was written for transformers 4, whose CLIPVisionModel held the tower as `.vision_model`
# (state dict names `vision_model.*`); transformers 5 flattened it. The script runs unchanged over that layout.
LEGACY_UNDER_TRANSFORMERS_5 = """
import runpy, sys, torch, transformers
from transformers.models.clip import modeling_clip
Flat = modeling_clip.CLIPVisionModel
class CLIPVisionModel(torch.nn.Module):
    def __init__(self, tower):
        super().__init__()
        self.vision_model = tower
    @classmethod
    def from_pretrained(cls, path):
        return cls(Flat.from_pretrained(path))
transformers.CLIPVisionModel = modeling_clip.CLIPVisionModel = CLIPVisionModel  # (transformers re-reads the module's)
script = sys.argv.pop(1)
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
"""


def test_llama_cpp_text_gguf_and_legacy_mmproj_give_the_folders_tokens(tmp_path, default_model_path) -> None:
    """LLaVA-1.5's pair as llama.cpp makes it (docs/multimodal/llava.md): the text GGUF by convert_hf_to_gguf.py,
    the CLIP tower and MLP projector by the legacy convert_image_encoder_to_gguf.py, which drops the tower's last
    layer (the features are layer -2's), drops the post-norm, writes fc1 as ffn_down and keeps the projector and the
    patch embedding in float16. Served with --mmproj, the pair gives the folder's tokens and logprobs, on a
    non-square image (padded to a square with the mean colour, as clip.cpp and transformers' do_pad do)."""
    import transformers

    from radixserve.model_loader import get_tokenizer

    text_conv = LLAMA_CPP / "convert_hf_to_gguf.py"
    legacy = LLAMA_CPP / "tools" / "mtmd" / "legacy-models" / "convert_image_encoder_to_gguf.py"
    assert text_conv.is_file() and legacy.is_file(), f"llama.cpp's converters are missing under {LLAMA_CPP}: make setup"
    folder = tmp_path / "hf"
    tok = get_tokenizer(default_model_path)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(folder)
    torch.manual_seed(1)
    vc = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=30, patch_size=6, projection_dim=32)
    tc = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        vision_config=vc, text_config=tc, image_token_index=tok.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default")).eval()
    with torch.no_grad():  # float16 values, so the legacy converter's float16 tensors hold them exactly
        for p in model.parameters():
            p.copy_(p.half().float())
    model.save_pretrained(folder)
    improc = transformers.LlavaImageProcessorPil(do_pad=True, size={"shortest_edge": 30},
                                                 crop_size={"height": 30, "width": 30}, resample=3)
    improc.save_pretrained(folder)
    model.model.vision_tower.save_pretrained(tmp_path / "clip")
    projector = {k.removeprefix("model."): v for k, v in model.state_dict().items() if "multi_modal_projector" in k}
    torch.save(projector, tmp_path / "llava.projector")  # what llava_surgery writes
    text, out = tmp_path / "text.gguf", tmp_path / "mmproj"
    subprocess.run([sys.executable, str(text_conv), str(folder), "--outtype", "f32", "--outfile", str(text)],
                   check=True, capture_output=True, timeout=300)
    args = ["-m", str(tmp_path / "clip"), "--clip-model-is-vision", "--llava-projector", str(tmp_path / "llava.projector"),
            "--projector-type", "mlp", "--use-f32", "--output-dir", str(out)]
    res = subprocess.run([sys.executable, "-c", LEGACY_UNDER_TRANSFORMERS_5, str(legacy), *args], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    mmproj = out / "mmproj-model-f32.gguf"
    prompt_text, img = "User: look<image>What is it?", image(4, (50, 36))
    ids = tok(prompt_text)["input_ids"]
    expanded = torch.tensor([[t for x in ids for t in ([model.config.image_token_index] * SPAN
                                                        if x == model.config.image_token_index else [x])]])
    tokens, logprobs, n = hf_greedy(model, NEW, expanded, attention_mask=torch.ones_like(expanded),
                                    pixel_values=improc(images=[img], return_tensors="pt")["pixel_values"])
    with radixserve.Engine(model_path=str(text), mmproj=str(mmproj), max_total_tokens=1024, quantization="none",
                           dtype="float32", show_progress=False) as eng:
        got = eng.generate(prompt=prompt_text, image_data=[img], sampling_params=GREEDY, return_logprob=True)
    assert got["output_ids"] == tokens and got["meta_info"]["prompt_tokens"] == n
    assert_logprobs_close(got, logprobs)
    from radixserve.model_loader import get_model_config
    from radixserve.model_loader.mmproj import with_mmproj

    with pytest.raises(ValueError, match="its projector maps 32 -> 64; the text model needs 32 -> 576"):
        with_mmproj(get_model_config(default_model_path), str(mmproj), get_tokenizer(default_model_path))
