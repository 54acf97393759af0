"""OpenAIServingBase: what /v1/completions and /v1/chat/completions share.

Model-name check, OpenAI fields -> a GenerateReqInput for the one normalisation path (which fans
prompts x n out into sub-requests; choice j of a prompt gets seed + j), token strings for
logprobs, and usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.openai_protocol import PromptTokensDetails, UsageInfo
from radixserve.entrypoints.openai_serving import OPENAI_RENAMES, APIError, RequestGroup
from radixserve.lora.lora_config import LoRANotFound
from radixserve.lora.lora_registry import front_registry
from radixserve.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.server_args import ServerArgs

# OpenAI request field -> SamplingParams field, copied when the client sent them (None = unset).
_PARAM_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "logit_bias": "logit_bias",
    "seed": "seed",
    "n": "n",
    "ignore_eos": "ignore_eos",
    "min_tokens": "min_new_tokens",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
}


# Fields refused with a 400 naming them (a feature asked for and not built is an error, not a no-op).
UNSUPPORTED_CHAT = {
    "functions": "the deprecated functions API is not supported: use tools",
    "function_call": "the deprecated functions API is not supported: use tool_choice",
    "audio": "audio output is not supported (a text model)", "modalities": "only text is supported",
    "prediction": "predicted outputs are not supported", "web_search_options": "web search is not supported",
    # reasoning (docs/reasoning.md): a budget in tokens is thinking_budget; a reply without the thinking is not built
    "reasoning_effort": "is not supported: give thinking_budget (tokens) with a --reasoning-parser",
    "include_reasoning": "is not supported: separate_reasoning false keeps the thinking in content",
}
UNSUPPORTED_COMPLETIONS: dict[str, str] = {}

# client field -> the SamplingParams constraint it sets (constrained/grammar_spec.py)
_CONSTRAINT_FIELDS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf", "guided_json": "json_schema",
                      "guided_regex": "regex", "guided_grammar": "ebnf"}
_REGEX_META = set("\\^$.|?*+()[]{}")


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in _REGEX_META else ch for ch in text)


@dataclass
class ServingRun:
    """One call through the pipeline, as the OpenAI routes and the API surfaces that translate onto them
    (entrypoints/surfaces.py) read it. Non-streamed: the response object and the scheduler's final outputs
    (their meta_info has ttft, e2e_latency); streamed: the chunk objects in order, and the group to cancel
    when the stream ends (a GroupStreamingResponse does)."""

    response: Any = None
    outs: list[dict[str, Any]] = field(default_factory=list)
    chunks: AsyncIterator[Any] | None = None
    group: RequestGroup | None = None


class OpenAIServingBase:
    def __init__(self, tm: TokenizerManager, server_args: ServerArgs, metrics: Any = None) -> None:
        self.tm = tm
        self.tokenizer = tm.tokenizer
        self.server_args = server_args
        self.model_name = server_args.model_name()
        self.model_names = server_args.model_names()
        self.metrics = metrics
        self._token_text: dict[int, str] = {}

    def check_model(self, model: str | None) -> str | None:
        """An absent model means the served one; so do its aliases and 'default'. A LoRA adapter's name
        (or base:adapter) selects it: returned, None for the base (lora/lora_registry.py). Anything else is
        a 404, as in OpenAI's API."""
        try:
            known, adapter = front_registry(self.tm).resolve_model(model, self.model_names)
        except LoRANotFound as e:
            raise APIError(404, f"The model `{model}` does not exist: {e}", "model", "model_not_found") from None
        if not known:
            message = f"The model `{model}` does not exist (this server serves `{self.model_name}`)."
            raise APIError(404, message, "model", "model_not_found")
        return adapter

    @staticmethod
    def check_unsupported(req: Any, fields: dict[str, str]) -> None:
        """OpenAI fields this server does not implement are refused (400 naming the field), never
        silently dropped: a client asking for a feature must not get a plain answer instead."""
        extra = getattr(req, "model_extra", None) or {}
        for name, why in fields.items():
            value = extra.get(name)
            if value is not None:
                raise APIError(400, f"{name}: {why}", name, "unsupported_parameter")

    def sampling_dict(self, req: Any, max_new_tokens: int | None) -> dict[str, Any]:
        """OpenAI request fields -> a sampling-params dict (None = unset; the normalizer checks values)."""
        d: dict[str, Any] = {dst: getattr(req, src) for src, dst in _PARAM_FIELDS.items()}
        # NOTE: temperature 0 must reach the scheduler as greedy, so only None means "unset".
        d["max_new_tokens"] = max_new_tokens
        return d

    @staticmethod
    def constraint(req: Any, structural_tag: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """The request's one grammar constraint as sampling params, and the rename that makes an
        error about it name the field the client sent. Two constraints are a 400."""
        given: list[tuple[str, str, Any]] = []  # (client field, SamplingParams field, value)
        rf = req.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", "json_schema", {"type": "object"}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise APIError(400, "response_format: json_schema is required when type is json_schema",
                               "response_format")
            given.append(("response_format", "json_schema", rf.json_schema.schema_ or {"type": "object"}))
        for name, kind in _CONSTRAINT_FIELDS.items():
            value = getattr(req, name, None)
            if value is not None:
                given.append((name, kind, value))
        if req.guided_choice is not None:
            if not req.guided_choice or not all(req.guided_choice):
                raise APIError(400, "guided_choice: must be a non-empty list of non-empty strings", "guided_choice")
            given.append(("guided_choice", "regex", "(" + "|".join(map(_regex_literal, req.guided_choice)) + ")"))
        if structural_tag is not None:
            given.append(("tool_choice", "structural_tag", structural_tag))
        if not given:
            return {}, {}
        if len(given) > 1:
            raise APIError(400, f"{given[1][0]}: cannot be combined with {given[0][0]} (one constraint per request)",
                           given[1][0])
        name, kind, value = given[0]
        return {kind: value}, {kind: name}

    async def normalize(self, obj: GenerateReqInput, renames: dict[str, str] | None = OPENAI_RENAMES
                        ) -> tuple[list[TokenizedGenerateReqInput], bool]:
        """The one request-normalisation path (RequestNormalizer), with errors as OpenAI 400s that
        name the field the client sent."""
        try:
            return await self.tm.normalize_async(obj)
        except ValueError as e:
            raise APIError.from_value_error(e, renames) from None

    def check_top_logprobs(self, value: int | None, param: str) -> int:
        if value is None:
            return 0
        limit = self.tm.limits.max_top_logprobs
        if not 0 <= value <= limit:
            raise APIError(400, f"{param} must be in [0, {limit}], got {value}", param)
        return value

    def token_text(self, token_id: int) -> str:
        """The text one token contributes (decoded alone, as OpenAI shows tokens)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text

    @staticmethod
    def usage(outs: list[dict[str, Any]], n: int) -> UsageInfo:
        """Prompts count once per prompt (not once per sample), completions once per choice."""
        metas = [o.get("meta_info", {}) for o in outs]
        firsts = metas[::n]
        prompt = sum(m.get("prompt_tokens", 0) for m in firsts)
        completion = sum(m.get("completion_tokens", 0) for m in metas)
        cached = sum(m.get("cached_tokens", 0) for m in firsts)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
