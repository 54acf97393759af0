"""Load a model from a Hugging Face folder: config.json, safetensors weights (single or sharded), tokenizer."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from radixserve.model_loader.model_config import ModelConfig, merge_token_ids

if TYPE_CHECKING:  # torch only where weights are read: the HTTP process reads configs and never imports it
    import torch
    from transformers import PreTrainedTokenizerBase

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Buffers some old checkpoints saved alongside the parameters; the engine computes them itself.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_json(path: str) -> dict[str, Any]:
    """Parse a JSON object file, turning a missing or malformed file into a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = json.load(fh)
    except FileNotFoundError as exc:
        raise ValueError(f"{path} does not exist") from exc
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(value, dict):
        # ValueError, not TypeError: the loader's contract is ValueError for any unusable model file.
        raise ValueError(f"{path} does not hold a JSON object")  # noqa: TRY004
    return value


def get_hf_config(folder: str, context_length: int | None = None) -> ModelConfig:
    """The ModelConfig of an HF model folder.

    EOS ids are gathered from config.json, generation_config.json and the tokenizer's eos token, since
    chat models often stop on a token that only one of them names.
    """
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{config_path} does not exist: {folder} is not a Hugging Face model folder")
    cfg = read_json(config_path)
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"{config_path}: quantised checkpoints ({method}) are not supported")
    gen_path = os.path.join(folder, "generation_config.json")
    gen_eos = read_json(gen_path).get("eos_token_id") if os.path.isfile(gen_path) else None
    cfg = {
        **cfg,
        "eos_token_id": list(merge_token_ids(cfg.get("eos_token_id"), gen_eos, _tokenizer_eos_id(folder))),
    }
    return ModelConfig.from_hf_config(cfg, context_length)


def _tokenizer_eos_id(folder: str) -> int | None:
    """The id of tokenizer_config.json's eos token, looked up in tokenizer.json (None if unknown)."""
    tc_path, tok_path = os.path.join(folder, "tokenizer_config.json"), os.path.join(folder, "tokenizer.json")
    if not (os.path.isfile(tc_path) and os.path.isfile(tok_path)):
        return None
    eos = read_json(tc_path).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    tok = read_json(tok_path)
    for added in tok.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    vocab = tok.get("model", {}).get("vocab")
    return int(vocab[eos]) if isinstance(vocab, dict) and eos in vocab else None


def weight_files(folder: str) -> list[tuple[str, set[str] | None]]:
    """The safetensors files to read, each with the tensor names the index promises it holds.

    Raises ValueError when there are no weights, the index is malformed, or it names a missing shard.
    """
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        shards: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, set()).add(name)
        for shard in shards:
            if not os.path.isfile(os.path.join(folder, shard)):
                raise ValueError(f"shard {shard} named by {index_path} does not exist")
        return [(os.path.join(folder, shard), names) for shard, names in sorted(shards.items())]
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        return [(single, None)]
    raise ValueError(
        f"no weight files in {folder}: expected {SINGLE_FILE} or {INDEX_FILE} (.bin checkpoints are not supported)"
    )


def iterate_hf_weights(folder: str, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, float32 tensor)` for every tensor in the folder's safetensors files, one at a time.

    Every file's header is opened and checked first, so a truncated file or a shard missing promised
    tensors fails before anything is yielded.
    """
    files = weight_files(folder)
    for path, expected in files:
        names = _header_names(path)
        if expected is not None and not expected <= names:
            missing = sorted(expected - names)
            raise ValueError(f"{path} lacks tensors the index assigns to it: {missing[:5]}")
    return _stream(files, keep)


def _header_names(path: str) -> set[str]:
    try:
        with safe_open(path, framework="pt") as fh:
            return set(fh.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError for any malformed header
        raise ValueError(f"{path} is truncated or not a safetensors file ({exc})") from exc


def _stream(
    files: list[tuple[str, set[str] | None]], keep: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for path, _ in files:
        with safe_open(path, framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if name.endswith(_SKIPPED_SUFFIXES) or (keep is not None and not keep(name)):
                    continue
                tensor = fh.get_tensor(name)
                if not tensor.is_floating_point() or tensor.element_size() < 2:
                    # int (GPTQ/AWQ packs) or fp8 weights need their scales; a plain cast would be garbage.
                    raise ValueError(
                        f"tensor {name!r} in {path} has dtype {tensor.dtype}, which we cannot load"
                    )
                yield name, tensor.float().contiguous()


def get_hf_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The folder's fast tokenizer (with its chat template, when it ships one). Cached per folder."""
    return _tokenizer_cached(os.path.realpath(folder))


@functools.lru_cache(maxsize=4)
def _tokenizer_cached(folder: str) -> PreTrainedTokenizerBase:
    # transformers is imported lazily: weights and configs load without paying for it.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError... for a bad folder
        raise ValueError(f"cannot load a tokenizer from {folder}: {exc}") from exc
    if not tokenizer.is_fast:
        raise ValueError(f"the tokenizer in {folder} is not a fast tokenizer")
    return tokenizer
