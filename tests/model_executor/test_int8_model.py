"""--quantization int8 on the real model: batch-1 decodes take the int8 path and stay close to the
exact mode; a model whose shapes do not fit the kernel is refused at load, naming the layer."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.server_args import ServerArgs
from tests.managers.driver import greedy

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "A radix tree is a data structure that",
           "List five fruits:"]


def _alone(sched, tokenizer, n: int = 16) -> list[list[int]]:
    outs = []
    for i, p in enumerate(PROMPTS):
        ids: list[int] = []
        sched.add_request(TokenizedGenerateReqInput(f"r{i}", tokenizer.encode(p, add_special_tokens=False), greedy(n)))
        while sched.has_work():
            for o in sched.step():
                ids.extend(o.new_token_ids)
        outs.append(ids)
    return outs


def test_int8_decode_stays_close_to_exact(make_scheduler, tokenizer) -> None:
    from radixserve.managers.scheduler import Scheduler

    exact = _alone(make_scheduler(check_invariants=False), tokenizer)
    q8 = Scheduler(ServerArgs(quantization="int8", max_total_tokens=4096))
    assert q8.model_runner.q8_ops is not None
    got = _alone(q8, tokenizer)
    agree = sum(a == b for x, y in zip(exact, got) for a, b in zip(x, y)) / sum(len(x) for x in exact)
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(exact, got)]
    print(f"int8 vs exact: {agree:.0%} of greedy tokens agree; first divergence at {first}")
    assert all(x[:2] == y[:2] for x, y in zip(exact, got)), first
    assert agree >= 0.5


def test_shapes_the_kernel_cannot_take_are_refused(tmp_path) -> None:
    import transformers

    from radixserve.model_executor.model_runner import ModelRunner

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=48, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.\S+ has in_features 48"):
        ModelRunner(ServerArgs(model_path=str(tmp_path), quantization="int8", max_total_tokens=512))
