"""bench vision (radixserve/bench/vision.py, vision_files.py) at a tiny shape: the random pair of files (a gemma3 text
GGUF in the Q4_K_M mix and a float16 gemma3 mmproj, llama.cpp's layout) loads as one vision-language model and the
radixserve side measures a 1-image prompt; the real Gemma-3-4B shape is the benchmark's (README)."""

from __future__ import annotations

import gguf
import pytest

from radixserve.bench import vision, vision_files

TINY = vision_files.VisionShape(name="tiny", hidden=256, layers=2, heads=2, kv_heads=1, head_dim=128, ffn=512,
                                vocab=49152 + 3, window=16, v_hidden=32, v_layers=2, v_heads=4, v_ffn=64, image=64,
                                patch=4)


def test_the_pair_loads_and_a_one_image_prompt_is_measured(tmp_path) -> None:
    text, mmproj = vision_files.vision_files(str(tmp_path), TINY)
    tokens = gguf.GGUFReader(text).fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data[-3:]] == list(vision_files.IMAGE_TOKENS)
    assert {t.name for t in gguf.GGUFReader(mmproj).tensors} >= {"mm.input_projection.weight", "v.blk.1.ffn_down.weight"}
    res = vision.measure_radixserve(text, mmproj, threads=1, repeats=2)
    assert 0 < res["encode_s"] < res["ttft_s"]  # the tower ran for each new image, inside the first token's time


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit, match="at least 1"):
        vision.main(["--repeats", "0"])
