"""Model loading: config, float32 weights under Hugging Face names, and tokenizer.

A model path is either a `.gguf` file (llama.cpp format) or a Hugging Face model folder; every entry
point dispatches on which it is, so callers never need to know.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from radixserve.model_loader.chat_template import with_chat_template
from radixserve.model_loader.default_model import default_model_path
from radixserve.model_loader.model_config import ModelConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ModelConfig",
    "default_model_path",
    "get_model_config",
    "get_tokenizer",
    "iterate_weights",
    "model_kind",
]

_GGUF_MAGIC = b"GGUF"


def model_kind(model_path: str) -> Literal["gguf", "hf"]:
    """Whether `model_path` is a GGUF file ("gguf") or a Hugging Face folder ("hf").

    A file counts as GGUF when it ends in `.gguf` (so a corrupt one still gets a GGUF error message)
    or starts with the GGUF magic. Anything else raises ValueError.
    """
    model_path = os.fspath(model_path)  # tolerate pathlib.Path from callers
    if os.path.isdir(model_path):
        return "hf"
    if os.path.isfile(model_path):
        if model_path.lower().endswith(".gguf"):
            return "gguf"
        with open(model_path, "rb") as fh:
            if fh.read(4) == _GGUF_MAGIC:
                return "gguf"
        raise ValueError(f"model path {model_path} is neither a .gguf file nor a Hugging Face model folder")
    raise ValueError(
        f"model path {model_path} does not exist (expected a .gguf file or a Hugging Face folder)"
    )


def get_model_config(model_path: str, context_length: int | None = None) -> ModelConfig:
    """The model's ModelConfig; `context_length` overrides the trained maximum context length."""
    if model_kind(model_path) == "gguf":
        from radixserve.model_loader.gguf_config import get_gguf_config  # lazy: this format's reader

        return get_gguf_config(model_path, context_length)
    from radixserve.model_loader.hf import get_hf_config  # lazy: torch + this format's reader

    return get_hf_config(model_path, context_length)


def iterate_weights(
    model_path: str, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_parameter_name, float32 CPU tensor)` pairs, in HF layout ([out, in] for linears).

    Tensors are produced one at a time so peak memory stays near one tensor beyond the model itself.
    `lm_head.weight` is absent when the embeddings are tied. `keep(name)` False skips a tensor before it is
    read or dequantised (a pipeline stage loads only its layers).
    """
    if model_kind(model_path) == "gguf":
        from radixserve.model_loader.gguf import iterate_gguf_weights  # lazy: torch + this format's reader

        return iterate_gguf_weights(model_path, keep)
    from radixserve.model_loader.hf import iterate_hf_weights  # lazy: torch + this format's reader

    return iterate_hf_weights(model_path, keep)


def get_tokenizer(model_path: str, tokenizer_path: str | None = None,
                  chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model's fast tokenizer, with its chat template set when the model has one.

    `tokenizer_path` (a .gguf file or HF folder) overrides where the tokenizer comes from; `chat_template`
    (a Jinja file, ServerArgs.chat_template) replaces the template. The object may be cached and shared
    between callers, so treat it as read-only.
    """
    path = tokenizer_path or model_path
    if model_kind(path) == "gguf":
        from radixserve.model_loader.gguf_tokenizer import get_gguf_tokenizer  # lazy: this format's reader

        return with_chat_template(get_gguf_tokenizer(path), chat_template)
    from radixserve.model_loader.hf import get_hf_tokenizer  # lazy: this format's reader

    return with_chat_template(get_hf_tokenizer(path), chat_template)


class LazyTokenizer:
    """get_tokenizer(...)'s tokenizer, built at its first use. The scheduler needs text only for stop strings, a
    grammar or a reasoning budget, and building a tokenizer imports transformers (~1 s of a scheduler process's
    ~3.5 s start): a process that never sees such a request never pays it. The TokenizerManager loads the same
    tokenizer eagerly, so a broken one still fails the start."""

    def __init__(self, *args: str | None) -> None:
        self._lazy_args = args
        self._lazy_tokenizer: PreTrainedTokenizerBase | None = None

    def resolve(self) -> PreTrainedTokenizerBase:
        if self._lazy_tokenizer is None:
            self._lazy_tokenizer = get_tokenizer(*self._lazy_args)  # type: ignore[arg-type]
        return self._lazy_tokenizer

    def __getattr__(self, name: str) -> Any:  # only what the proxy itself lacks: the tokenizer's API
        if name.startswith("__") or name.startswith("_lazy_"):  # protocol probes (copy, pickle) load nothing
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __len__(self) -> int:
        return len(self.resolve())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


def resolved_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer itself, for a consumer that checks its type (xgrammar reads a transformers tokenizer)."""
    return tokenizer.resolve() if isinstance(tokenizer, LazyTokenizer) else tokenizer
