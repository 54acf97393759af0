"""What the vision tests read back from a saved transformers model: its tensors by checkpoint name."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def saved_tensors(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """save_pretrained `model` to `path`, then every tensor of the written safetensors files."""
    model.save_pretrained(path)
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not iterable)
    return tensors


def sub(tensors: dict[str, torch.Tensor], prefix: str, new_prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors under `prefix`, renamed to start with `new_prefix` instead."""
    return [(new_prefix + k[len(prefix) :], v) for k, v in tensors.items() if k.startswith(prefix)]


def hf_greedy(model: torch.nn.Module, new: int, input_ids: torch.Tensor, **inputs) -> tuple[list[int], list[float], int]:
    """transformers' greedy run of exactly `new` tokens: the tokens, each one's logprob and the prompt's length
    (the oracle of every vision test)."""
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True, **inputs)
    n = input_ids.shape[1]
    tokens = out.sequences[0, n:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs, n


def assert_logprobs_close(out: dict, logprobs: list[float]) -> None:
    """An Engine output's sampled-token logprobs equal the oracle's to float32 rounding."""
    got = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(logprobs), atol=2e-4, rtol=0)
