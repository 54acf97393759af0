"""The memory budget's weight estimate, made from the file's types before anything is read, against the bytes the
loaded kernels' layout holds: exact for the default file's own blocks (a legacy type's float16 scales count 2
bytes, as qweight._half_if_exact keeps them), an upper bound when blocks are quantised at load."""

from __future__ import annotations

from radixserve.layers.quantization.gguf_formats import FORMATS
from radixserve.model_loader.gguf import GGUFBlocks
from radixserve.model_loader.gguf_loader import estimate_weight_bytes


def test_the_default_files_estimate_is_its_loaded_size(fast_runner, default_model_path) -> None:
    est = estimate_weight_bytes(fast_runner.model, GGUFBlocks(default_model_path), fast_runner.quantization, 4)
    assert est == fast_runner.weight_bytes


def test_scales_quantised_at_load_count_four_bytes() -> None:
    q41 = FORMATS["Q4_1"]
    # 32 weights: 16 bytes of nibbles, a scale and a min
    assert q41.kernel_bytes(32) == 16 + 2 * 2
    assert q41.kernel_bytes(32, file_scales=False) == 16 + 2 * 4
