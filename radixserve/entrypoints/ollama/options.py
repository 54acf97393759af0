"""Ollama's `options` -> the sampling fields of the OpenAI requests the Ollama routes translate into.

Every option is honoured, or refused with a 400 naming it; none is accepted and dropped, except where
Ollama's own server ignores it too (below). Value ranges are the pipeline's (SamplingParams.verify); its
errors come back naming the Ollama option (OPTION_RENAMES).

    num_predict        -> max_tokens (-1 and -2, Ollama's "no limit" / "fill the context": until EOS or the
                          context is full)
    temperature, top_k, top_p, min_p, seed, stop, presence_penalty, frequency_penalty -> the same
    repeat_penalty     -> repetition_penalty (over prompt + output: repeat_last_n -1; 0 turns it off)
    num_ctx            -> accepted up to the server's --context-length (the window stays the server's),
                          refused above it
    typical_p 1, tfs_z 1, mirostat 0 -> accepted: each is that sampler turned off
    mirostat_tau, mirostat_eta, penalize_newline -> accepted and unused, as Ollama does without mirostat /
                          since it dropped penalize_newline
    the load-time options (num_gpu, num_thread, use_mmap, ...) and num_keep -> refused: the server's start-up
                          flags place the model, and it never shifts the context
"""

from __future__ import annotations

import math
from typing import Any

from radixserve.entrypoints.openai_serving import APIError

# Ollama option -> the OpenAI request field it sets, with the JSON types it takes
_DIRECT: dict[str, tuple[str, tuple[type, ...]]] = {
    "temperature": ("temperature", (int, float)),
    "top_k": ("top_k", (int,)),
    "top_p": ("top_p", (int, float)),
    "min_p": ("min_p", (int, float)),
    "seed": ("seed", (int,)),
    "presence_penalty": ("presence_penalty", (int, float)),
    "frequency_penalty": ("frequency_penalty", (int, float)),
    "repeat_penalty": ("repetition_penalty", (int, float)),
}
# accepted at the one value that turns the sampler off (what this server does)
_OFF_VALUES = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
_UNUSED = frozenset({"mirostat_tau", "mirostat_eta", "penalize_newline"})
_LOAD_TIME = frozenset({"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                        "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_gqa",
                        "rope_frequency_base", "rope_frequency_scale"})

# the field a pipeline error names (OpenAI's or SamplingParams') -> the Ollama field the client sent
OPTION_RENAMES = {
    **{openai: f"options.{name}" for name, (openai, _) in _DIRECT.items()},
    "max_tokens": "options.num_predict", "max_new_tokens": "options.num_predict", "stop": "options.stop",
    "top_k": "options.top_k", "response_format": "format", "json_schema": "format", "tools": "tools",
    "top_logprobs": "top_logprobs", "thinking_budget": "think", "chat_template_kwargs": "think",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    ok = not isinstance(value, bool) and isinstance(value, types)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if not ok:
        kind = "an integer" if types == (int,) else "a number"
        raise APIError(400, f"options.{name}: must be {kind}, got {value!r}", f"options.{name}")


def sampling_fields(options: dict[str, Any] | None, context_len: int) -> dict[str, Any]:
    """The OpenAI request fields (ChatCompletionRequest / CompletionRequest) that `options` asks for."""
    fields: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if value is None:  # JSON null: unset, as Ollama reads it
            continue
        param = f"options.{name}"
        if name in _DIRECT:
            _check_type(name, value, _DIRECT[name][1])
            fields[_DIRECT[name][0]] = value
        elif name == "num_predict":
            _check_type(name, value, (int,))
            if value < -2:
                raise APIError(400, f"{param}: must be >= 0, or -1 / -2 for no limit; got {value}", param)
            fields["max_tokens"] = None if value < 0 else value
        elif name == "stop":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise APIError(400, f"{param}: must be a list of strings", param)
            fields["stop"] = value
        elif name == "num_ctx":
            _check_type(name, value, (int,))
            if not 1 <= value <= context_len:
                raise APIError(400, f"{param}: {value} is outside [1, {context_len}], this server's context "
                               "length (--context-length sets it at start-up)", param)
        elif name == "repeat_last_n":
            _check_type(name, value, (int,))
            if value != -1 and value != 0:
                raise APIError(400, f"{param}: only -1 (the whole context, the window repeat_penalty uses here) "
                               f"or 0 (off) are supported, got {value}", param)
        elif name in _OFF_VALUES:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != _OFF_VALUES[name]:
                raise APIError(400, f"{param}: only {_OFF_VALUES[name]} (off) is supported, got {value!r}", param)
        elif name in _UNUSED:
            continue
        elif name in _LOAD_TIME or name == "num_keep":
            why = ("this server never shifts the context" if name == "num_keep"
                   else "a load-time option: the server's start-up flags place and run the model")
            raise APIError(400, f"{param}: is not supported ({why})", param)
        else:
            raise APIError(400, f"{param}: unknown option", param)
    if (options or {}).get("repeat_last_n") == 0:  # Ollama's "off" wins over a repeat_penalty given with it
        fields["repetition_penalty"] = 1.0
    return fields


def embedding_options(options: dict[str, Any] | None, context_len: int) -> None:
    """An embedding call's options: num_ctx is checked as above; sampling options are refused (nothing is
    sampled), and so are the load-time ones."""
    for name, value in (options or {}).items():
        if value is None:
            continue
        if name == "num_ctx":
            sampling_fields({name: value}, context_len)
        else:
            raise APIError(400, f"options.{name}: is not supported on an embedding call", f"options.{name}")
