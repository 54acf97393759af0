"""LoRA under --tp-size 2 (two real scheduler processes on gloo, --check-invariants comparing every step's
digest across ranks): A and B are cut like their layers (column-parallel q/k/v, gate/up: B's output rows;
row-parallel o/down: A's input columns, the [rows, rank] product all-reduced), and four adapters plus the
base model in one batch give peft's tokens, logprobs within 1e-4."""

from __future__ import annotations

import random

import radixserve
from tests.lora.lora_driver import reference
from tests.lora.peft_adapters import peft_reference

N = 6


def test_four_adapters_and_base_at_tp2_match_peft(tiny_hf, tiny_adapters, default_model_path):
    path, base = tiny_hf
    rng = random.Random(8)
    prompts = [[rng.randrange(10, 49000) for _ in range(n)] for n in (5, 13)]
    names = [None, "a", "b", "c", "d"]
    models = {None: base} | {n: peft_reference(base, tiny_adapters[n]) for n in names if n}
    params = {"max_new_tokens": N, "temperature": 0.0, "ignore_eos": True}
    with radixserve.Engine(model_path=path, tokenizer_path=default_model_path, tp_size=2, quantization="none",
                           dtype="float32", max_total_tokens=2048, check_invariants=True, show_progress=False,
                           num_threads=1, lora_paths=tuple(f"{n}={p}" for n, p in tiny_adapters.items()),
                           max_loras_per_batch=4) as eng:
        # all five at once (one batch of mixed adapters); the Engine takes one lora_path per call
        import threading

        outs: dict[str | None, list] = {}

        def go(name: str | None) -> None:
            outs[name] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                      lora_path=name)

        threads = [threading.Thread(target=go, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for name in names:
        for p, out in zip(prompts, outs[name]):
            ids, lps = reference(models[name], p, N)
            assert out["output_ids"] == ids, name
            got = [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]
            assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, name
