"""llama.cpp GGUF LoRA adapters: a file written here from a peft adapter, as convert_lora_to_gguf.py writes
it (general.type adapter, blk.N.<stem>.weight.lora_a / .lora_b, adapter.lora.alpha, q/k rows of lora_b
permuted for llama.cpp's RoPE), gives peft's tokens and logprobs; a truncated file and a file that is not an
adapter are clear errors, after which requests still run."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.lora.lora_driver import assert_matches, reference, run
from tests.lora.peft_adapters import peft_reference

_STEMS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
          "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's LlamaModel.permute (what convert_lora_to_gguf applies to lora_b of q/k)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_lora(peft_dir: str, out_path: str, alpha: float, heads: int, kv_heads: int,
                    general_type: str = "adapter") -> str:
    import gguf

    tensors = load_file(os.path.join(peft_dir, "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(out_path, arch="llama")
    writer.add_type(general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for key, t in sorted(tensors.items()):
        module, part = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        layer = int(module.split(".")[2])
        short = module.rsplit(".", 1)[-1]
        suffix = "lora_a" if part.startswith("A") else "lora_b"
        if suffix == "lora_b" and short in ("q_proj", "k_proj"):
            t = _llama_cpp_permute(t, heads if short == "q_proj" else kv_heads)
        writer.add_tensor(f"blk.{layer}.{_STEMS[short]}.weight.{suffix}", t.float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


@pytest.fixture(scope="module")
def gguf_lora(tiny_adapters, tmp_path_factory) -> str:
    # adapter "a": r 8, alpha 16, every projection (scale alpha / r, as in llama.cpp)
    return write_gguf_lora(tiny_adapters["a"], str(tmp_path_factory.mktemp("gguf-lora") / "a.gguf"), 16.0, 4, 2)


def test_gguf_adapter_matches_peft(make_lora_scheduler, tiny_hf, tiny_adapters, gguf_lora):
    _, base = tiny_hf
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 49000) for _ in range(n)] for n in (7, 19)]
    ref_model = peft_reference(base, tiny_adapters["a"])
    sched = make_lora_scheduler()
    sched.lora.control("load", "ga", gguf_lora, 0)
    out = run(sched, {f"g{i}": (p, "ga") for i, p in enumerate(prompts)} | {"base": (prompts[0], None)})
    for i, p in enumerate(prompts):
        assert_matches(out[f"g{i}"], reference(ref_model, p), what=f"gguf prompt {i}")
    assert_matches(out["base"], reference(base, prompts[0]), what="base beside gguf")


def test_bad_gguf_adapters_are_errors_naming_them(make_lora_scheduler, tiny_adapters, gguf_lora, tmp_path):
    sched = make_lora_scheduler()
    with open(gguf_lora, "rb") as f:
        data = f.read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 300])
    not_adapter = write_gguf_lora(tiny_adapters["a"], str(tmp_path / "model.gguf"), 16.0, 4, 2, general_type="model")
    for name, path, phrase in (("cut", str(cut), "truncated"), ("notadapter", not_adapter, "not a GGUF LoRA")):
        with pytest.raises(ValueError, match=phrase) as e:
            sched.lora.control("load", name, path, 0)
        assert repr(name) in str(e.value)
        assert run(sched, {"x": ([5, 6, 7], name)})["x"].error[0] == 404
    assert run(sched, {"ok": ([5, 6, 7], "a")})["ok"].error is None
