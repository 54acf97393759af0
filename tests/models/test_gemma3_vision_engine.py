"""Gemma 3 with images through the real scheduler (Engine) against transformers' Gemma3ForConditionalGeneration and
Gemma3Processor in float32 on the same tiny random weights: a 2-layer SigLIP, the average-pool projector, a 3-layer
Gemma 3 text model (sliding, global, sliding; a 24-token window, shorter than the prompts).

The image's 16 soft tokens attend to each other both ways (transformers' token_type_ids mask); the tests check both
attention backends, a chunked prefill whose budget would cut an image span, radix hits on a repeated image, and a
text-only request in the same batch. A control shows the oracle's causal run differs, so the mask is exercised."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import radixserve
from tests.models.test_llava_engine import image
from tests.models.vision_checkpoints import assert_logprobs_close, hf_greedy

NEW = 6
TOKENS = 16  # mm_tokens_per_image
SPECIAL = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


def make_tiny_gemma3(path, default_model_path: str, layer_types: list[str] | None) -> str:
    """A tiny random Gemma 3 VLM folder at `path` (the hub's tensor names; None layer_types: Gemma 3's own
    pattern, five sliding layers to one global, which is what a GGUF can say)."""
    import transformers

    from radixserve.model_loader import get_tokenizer

    tok = get_tokenizer(default_model_path)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    cfg = transformers.Gemma3Config(
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 37,
                       "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 32, "patch_size": 4,
                       "vision_use_head": False},
        text_config={"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
                     "sliding_window": 24, "max_position_embeddings": 1024, "layer_types": layer_types},
        mm_tokens_per_image=TOKENS, boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(3)
    transformers.Gemma3ForConditionalGeneration(cfg).save_pretrained(path)
    # the hub's files (google/gemma-3-4b-it) name the tower vision_tower.vision_model.*, which llama.cpp's converter
    # expects too; transformers 5 saves vision_tower.*: rewrite to the hub's layout (both load here). The projection
    # is made float16-exact: llama.cpp's converter always writes it in float16, so the pair of files holds the same
    file = path / "model.safetensors"
    tensors = load_file(file)
    key = "multi_modal_projector.mm_input_projection_weight"
    tensors[key] = tensors[key].half().float()
    save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in tensors.items()}, file, metadata={"format": "pt"})
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    pre = json.loads((path / "preprocessor_config.json").read_text())  # as the hub's file has it (256 there)
    (path / "preprocessor_config.json").write_text(json.dumps({**pre, "image_seq_length": TOKENS}))
    return str(path)


def make_oracle(path: str):
    """transformers' model and processor on the folder: run(text, images, causal=False) -> (tokens, logprobs, n)."""
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    proc = transformers.Gemma3Processor(transformers.Gemma3ImageProcessorPil.from_pretrained(path), tok,
                                        image_seq_length=TOKENS)

    def run(text: str, images: list, causal: bool = False) -> tuple[list[int], list[float], int]:
        inputs = proc(text=[text], images=[images] if images else None, return_tensors="pt")
        if causal:  # the control: no image block in the mask
            inputs.pop("token_type_ids", None)
        return hf_greedy(model, NEW, inputs.pop("input_ids"), **inputs)

    return run


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, default_model_path):
    # a global layer between two sliding ones: both kinds see the image both ways
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "hf", default_model_path,
                            ["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def oracle(tiny_gemma3):
    return make_oracle(tiny_gemma3)


CASES = [("User: look at this\n<start_of_image>What is in the picture, in a few words?", [image(1, (50, 40))]),
         ("Compare<start_of_image>and<start_of_image>then answer briefly.", [image(2, (30, 60)), image(3)]),
         ("User: text only, long enough to pass the sliding window of the local layers", [])]


@pytest.mark.parametrize("args", [
    {},
    {"attention_backend": "torch_native"},
    {"chunked_prefill_size": 12, "page_size": 4},
    {"chunked_prefill_size": 12, "page_size": 4, "attention_backend": "torch_native"},
], ids=["cpu-paged", "torch-native", "chunked-paged", "torch-native-chunked-paged"])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_gemma3, oracle, args) -> None:
    refs = [oracle(text, imgs) for text, imgs in CASES]
    assert refs[0][2] > 24 and refs[1][2] > 2 * TOKENS  # past the sliding window
    with radixserve.Engine(model_path=tiny_gemma3, max_total_tokens=2048, quantization="none", dtype="float32",
                           check_invariants=True, show_progress=False, **args) as eng:
        outs = eng.generate(prompt=[t for t, _ in CASES], image_data=[imgs for _, imgs in CASES],
                            sampling_params=GREEDY, return_logprob=True)
        again = eng.generate(prompt=CASES[0][0], image_data=CASES[0][1], sampling_params=GREEDY,
                             return_logprob=True)
    for out, (tokens, logprobs, n) in zip(outs, refs):
        assert out["output_ids"] == tokens
        assert out["meta_info"]["prompt_tokens"] == n
        assert_logprobs_close(out, logprobs)
    assert again["output_ids"] == refs[0][0]
    assert again["meta_info"]["cached_tokens"] >= refs[0][2] - 4  # the image span from the radix cache
    assert_logprobs_close(again, refs[0][1])


def test_tensor_parallel_and_pipeline_stages_give_the_same_tokens(tiny_gemma3, oracle) -> None:
    """tp 2 (the tower replicated, the decoder's heads split: each rank masks its heads the same way) and pp 2 (the
    tower on the first stage; every stage's attention reads the step's image spans), with a chunk budget that would
    cut a span."""
    refs = [oracle(text, imgs)[0] for text, imgs in CASES[:2]]
    for parallel in ({"tp_size": 2}, {"pp_size": 2}):
        with radixserve.Engine(model_path=tiny_gemma3, max_total_tokens=1024, quantization="none", dtype="float32",
                               check_invariants=True, show_progress=False, chunked_prefill_size=12, page_size=4,
                               **parallel) as eng:
            outs = eng.generate(prompt=[t for t, _ in CASES[:2]], image_data=[imgs for _, imgs in CASES[:2]],
                                sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs, parallel


def test_the_image_span_really_attends_both_ways(oracle) -> None:
    """The control: transformers without the image block in its mask gives other logprobs on these prompts, so the
    equality above needs the bidirectional span."""
    for text, imgs in CASES[:2]:
        _, both_ways, _ = oracle(text, imgs)
        _, causal, _ = oracle(text, imgs, causal=True)
        assert max(abs(a - b) for a, b in zip(both_ways, causal)) > 1e-3


def test_a_step_never_ends_inside_a_span_and_deterministic_mode_is_refused(tiny_gemma3) -> None:
    from radixserve.model_executor.forward_batch_info import image_span_key_limits
    from radixserve.multimodal.mm_inputs import MultimodalDataItem, MultimodalInputs

    mm = MultimodalInputs([MultimodalDataItem("image", 1, 99999, 3, 4)], 7)
    pos = torch.arange(2, 8)  # positions 2..7 of one request: the span [3, 7) whole
    assert image_span_key_limits(pos, [mm], [2], [6], torch.device("cpu")).tolist() == [2, 6, 6, 6, 6, 7]
    assert image_span_key_limits(torch.arange(8, 10), [mm], [8], [2], torch.device("cpu")) is None  # after it
    with pytest.raises(ValueError, match="inside image span"):
        image_span_key_limits(torch.arange(0, 5), [mm], [0], [5], torch.device("cpu"))
    with pytest.raises(ValueError, match="enable_deterministic_inference"):
        radixserve.Engine(model_path=tiny_gemma3, max_total_tokens=1024, dtype="float32",
                          enable_deterministic_inference=True, show_progress=False)


def test_llama_cpp_text_gguf_and_mmproj_give_the_folders_tokens(tmp_path, default_model_path) -> None:
    """The folder converted by llama.cpp's convert_hf_to_gguf.py (a Gemma 3 text GGUF, and --mmproj: projector type
    gemma3, its soft-embedding norm stored as 1 + w, the projection in float16) serves with --mmproj as the folder
    does."""
    import subprocess
    import sys

    from tests.models.test_idefics3_engine import CONVERTER

    assert CONVERTER.is_file(), f"{CONVERTER} is missing: run `make setup`"
    # Gemma 3's own layer pattern: a GGUF has no per-layer types, llama.cpp's loader assumes it
    (tmp_path / "hf").mkdir()
    folder = make_tiny_gemma3(tmp_path / "hf", default_model_path, None)
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    for out, extra in ((text, []), (mmproj, ["--mmproj"])):
        subprocess.run([sys.executable, str(CONVERTER), folder, "--outtype", "f32", "--outfile", str(out),
                        *extra], check=True, capture_output=True, timeout=300)
    tokens, _, n = make_oracle(folder)(*CASES[0])
    with radixserve.Engine(model_path=str(text), mmproj=str(mmproj), max_total_tokens=2048, quantization="none",
                           dtype="float32", show_progress=False) as eng:
        out = eng.generate(prompt=CASES[0][0], image_data=CASES[0][1], sampling_params=GREEDY)
    assert out["output_ids"] == tokens and out["meta_info"]["prompt_tokens"] == n


# Gemma 3's turn format with its image marker (the shape of google/gemma-3-4b-it's template)
GEMMA_TEMPLATE = ("{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else "
                  "message['role'] }}\n{% for item in message['content'] %}{% if item['type'] == 'image' %}"
                  "<start_of_image>{% else %}{{ item['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_chat_over_http_equals_transformers_processor(tiny_gemma3, oracle, tmp_path) -> None:
    """/v1/chat/completions with an image part: the template writes <start_of_image> after "user\\n", whose newline
    merges with the expansion's "\\n\\n" (one token), as in transformers' processor on the same rendered text;
    /tokenize counts the same ids."""
    import base64
    import io

    import httpx
    import openai
    from jinja2 import Template

    from tests.server_process import ServerProcess

    (tmp_path / "template.jinja").write_text(GEMMA_TEMPLATE)
    img = image(5, (44, 36))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    rendered = Template(GEMMA_TEMPLATE).render(messages=[{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is this?"}]}], add_generation_prompt=True)
    tokens, _, n = oracle(rendered, [img])
    srv = ServerProcess(["--model-path", tiny_gemma3, "--chat-template", str(tmp_path / "template.jinja"),
                         "--quantization", "none", "--dtype", "float32", "--max-total-tokens", "2048"])
    for s in srv.running():
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none")
        resp = client.chat.completions.create(model="hf", messages=[{"role": "user", "content": content}],
                                              max_tokens=NEW, temperature=0)
        tokenized = httpx.post(s.base_url + "/tokenize", json={"messages": [{"role": "user", "content": content}]})
    assert resp.usage.prompt_tokens == n and tokenized.json()["count"] == n
    from transformers import AutoTokenizer

    stop = next((i for i, t in enumerate(tokens) if t in (1, 2)), len(tokens))  # the config's and SmolLM2's EOS
    want = AutoTokenizer.from_pretrained(tiny_gemma3).decode(tokens[:stop], skip_special_tokens=True)
    assert stop > 0 and resp.choices[0].message.content == want


def test_pan_and_scan_crops_equal_transformers(tiny_gemma3, tmp_path) -> None:
    """do_pan_and_scan: a wide image becomes the original and its crops, each a tower input and a run introduced as
    transformers' processor writes it; a tall one too; a square one has no crops. An id prompt of an image with
    crops is refused by name."""
    import shutil

    import transformers

    folder = tmp_path / "pas"
    shutil.copytree(tiny_gemma3, folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {**pre, "do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 3,
         "pan_and_scan_min_ratio_to_activate": 1.2}))
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    proc = transformers.Gemma3Processor(transformers.Gemma3ImageProcessorPil.from_pretrained(folder), tok,
                                        image_seq_length=TOKENS)
    wide, tall, square = image(6, (90, 30)), image(7, (20, 50)), image(8, (40, 40))
    text = "Look:<start_of_image>and<start_of_image>and<start_of_image>say."
    inputs = proc(text=[text], images=[[wide, tall, square]], return_tensors="pt", do_pan_and_scan=True,
                  pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=3, pan_and_scan_min_ratio_to_activate=1.2)
    assert inputs["pixel_values"].shape[0] > 3  # crops were made
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    n = inputs["input_ids"].shape[1]
    with radixserve.Engine(model_path=str(folder), max_total_tokens=4096, quantization="none", dtype="float32",
                           show_progress=False) as eng:
        got = eng.generate(prompt=text, image_data=[wide, tall, square], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="pan-and-scan"):
            eng.generate(input_ids=[5, tok.convert_tokens_to_ids("<start_of_image>"), 6], image_data=[wide],
                         sampling_params=GREEDY)
    assert got["output_ids"] == out[0, n:].tolist() and got["meta_info"]["prompt_tokens"] == n
