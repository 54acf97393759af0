"""Idefics3 / SmolVLM through the real scheduler (Engine) against transformers' Idefics3ForConditionalGeneration and
Idefics3Processor in float32 on the same tiny random weights: a split image (2 x 2 crops + the global view, each a
tower input), an unsplit one and two images in one prompt; with chunked prefill and radix hits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import radixserve
from tests.models.test_llava_engine import image
from tests.models.vision_checkpoints import assert_logprobs_close, hf_greedy

NEW = 8
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
           *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]


def tiny_config(config_cls, path, default_model_path: str, seed: int):
    """An Idefics3-family config of the tests' size (a 2-layer 32-wide SigLIP, a 2-layer Llama over SmolLM2's
    vocabulary plus the image tokens, whose tokenizer is saved to `path`), the torch seed set for its weights."""
    from radixserve.model_loader import get_tokenizer

    tok = get_tokenizer(default_model_path)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.save_pretrained(path)
    torch.manual_seed(seed)
    return config_cls(
        vision_config={"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "image_size": 32, "patch_size": 4},
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 1024},
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))


@pytest.fixture(scope="module")
def tiny_idefics3(tmp_path_factory, default_model_path):
    import transformers

    path = tmp_path_factory.mktemp("idefics3") / "hf"
    cfg = tiny_config(transformers.Idefics3Config, path, default_model_path, seed=0)
    transformers.Idefics3ForConditionalGeneration(cfg).save_pretrained(path)
    # SmolVLM's own config names its text model so; llama.cpp's converter picks the text class by it
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    proc = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    proc.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def oracle(tiny_idefics3):
    import transformers

    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_idefics3)
    proc = transformers.Idefics3Processor(transformers.Idefics3ImageProcessorPil.from_pretrained(tiny_idefics3), tok,
                                          image_seq_len=16)

    def run(text: str, images: list) -> tuple[list[int], list[float], int]:
        inputs = proc(text=[text], images=[images] if images else None, return_tensors="pt")
        return hf_greedy(model, NEW, inputs.pop("input_ids"), **inputs)

    return run


GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("args", [{}, {"chunked_prefill_size": 11, "page_size": 4}], ids=["whole", "chunked-paged"])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny_idefics3, oracle, args) -> None:
    wide, small = image(7, (80, 50)), image(8, (20, 24))  # split 2 x 2 (+ global); not split
    cases = [("User:<image>Describe it.", [wide]), ("User: one<image>two<image>end", [small, wide]),
             ("User: text only", [])]
    refs = [oracle(text, imgs) for text, imgs in cases]
    assert refs[0][2] > 5 * 16  # four crops and the global view, 16 tokens each
    with radixserve.Engine(model_path=tiny_idefics3, max_total_tokens=4096, quantization="none", dtype="float32",
                           check_invariants=True, show_progress=False, **args) as eng:
        outs = eng.generate(prompt=[t for t, _ in cases], image_data=[imgs for _, imgs in cases],
                            sampling_params=GREEDY, return_logprob=True)
        again = eng.generate(prompt=cases[0][0], image_data=[wide], sampling_params=GREEDY)
    for out, (tokens, logprobs, n) in zip(outs, refs):
        assert out["output_ids"] == tokens
        assert out["meta_info"]["prompt_tokens"] == n
        assert_logprobs_close(out, logprobs)
    assert again["output_ids"] == refs[0][0]
    assert again["meta_info"]["cached_tokens"] >= refs[0][2] - 4  # every crop's span from the radix cache


CONVERTER = Path(sys.executable).parents[1] / "llama.cpp" / "convert_hf_to_gguf.py"  # make setup puts it there


def test_llama_cpp_text_gguf_and_mmproj_give_the_folders_tokens(tiny_idefics3, oracle, tmp_path) -> None:
    """The folder converted by llama.cpp's convert_hf_to_gguf.py (a text GGUF, and --mmproj) serves with --mmproj as
    the folder does: transformers' tokens, the vision tensors read from the mmproj file."""
    assert CONVERTER.is_file(), f"{CONVERTER} is missing: run `make setup`"
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    for out, extra in ((text, []), (mmproj, ["--mmproj"])):
        subprocess.run([sys.executable, str(CONVERTER), tiny_idefics3, "--outtype", "f32", "--outfile", str(out),
                        *extra], check=True, capture_output=True, timeout=300)
    wide = image(7, (80, 50))
    tokens, _, n = oracle("User:<image>Describe it.", [wide])
    with radixserve.Engine(model_path=str(text), mmproj=str(mmproj), max_total_tokens=2048, quantization="none",
                           dtype="float32", show_progress=False) as eng:
        out = eng.generate(prompt="User:<image>Describe it.", image_data=[wide], sampling_params=GREEDY)
    assert out["output_ids"] == tokens and out["meta_info"]["prompt_tokens"] == n


def test_a_bad_mmproj_is_refused_by_name(tiny_idefics3, tmp_path, default_model_path) -> None:
    from radixserve.model_loader import get_model_config, get_tokenizer
    from radixserve.model_loader.mmproj import with_mmproj
    from radixserve.server_args import ServerArgs

    cfg, tok = get_model_config(default_model_path), get_tokenizer(default_model_path)
    with pytest.raises(ValueError, match="not an mmproj file"):  # a text GGUF given as the projector
        with_mmproj(cfg, default_model_path, tok)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(default_model_path).read_bytes()[:5000])
    with pytest.raises(ValueError, match="truncated"):
        with_mmproj(cfg, str(cut), tok)
    with pytest.raises(ValueError, match="mmproj"):  # an HF folder carries its own tower
        ServerArgs(model_path=tiny_idefics3, mmproj=default_model_path)
    with pytest.raises(ValueError, match="mmproj"):
        ServerArgs(model_path=default_model_path, mmproj=str(tmp_path / "missing.gguf"))


def test_smolvlm2_equals_transformers(tmp_path, default_model_path) -> None:
    """SmolVLMForConditionalGeneration (SmolVLM2) with its own image processor, against transformers' SmolVLM model,
    image processor and prompt string: a split image."""
    import transformers

    # transformers' own prompt string (its SmolVLMProcessor also wants a video processor, which needs torchvision)
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    path = tmp_path / "smolvlm"
    cfg = tiny_config(transformers.SmolVLMConfig, path, default_model_path, seed=1)
    model = transformers.SmolVLMForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    improc = transformers.SmolVLMImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    improc.save_pretrained(path)
    wide = image(9, (70, 60))
    pix = improc(images=[[wide]], return_tensors="pt", return_row_col_info=True)
    text = "User:" + get_image_prompt_string(pix["rows"][0][0], pix["cols"][0][0], 16, "<fake_token_around_image>",
                                             "<image>", "<global-img>") + "What is it?"
    ids = transformers.AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pix["pixel_values"],
                             pixel_attention_mask=pix["pixel_attention_mask"], max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    n = ids.shape[1]
    assert n > 5 * 16  # split: four crops and the global view
    with radixserve.Engine(model_path=str(path), max_total_tokens=2048, quantization="none", dtype="float32",
                           show_progress=False) as eng:
        got = eng.generate(prompt="User:<image>What is it?", image_data=[wide], sampling_params=GREEDY)
    assert got["output_ids"] == out[0, n:].tolist() and got["meta_info"]["prompt_tokens"] == n
