"""OpenAIServingBase: what /v1/completions and /v1/chat/completions share.

Model-name check, OpenAI fields -> SamplingParams, fan-out of prompts x n into sub-requests
(choice j of a prompt gets seed + j), token strings for logprobs, and usage.
"""

from __future__ import annotations

from typing import Any

from radixserve.entrypoints.openai_protocol import PromptTokensDetails, UsageInfo
from radixserve.entrypoints.openai_serving import OPENAI_RENAMES, APIError, SubRequest
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on alternatives per token

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


class OpenAIServingBase:
    def __init__(self, tm: TokenizerManager, server_args: ServerArgs, metrics: Any = None) -> None:
        self.tm = tm
        self.tokenizer = tm.tokenizer
        self.server_args = server_args
        self.model_name = server_args.model_name()
        self.metrics = metrics
        self._token_text: dict[int, str] = {}

    def check_model(self, model: str | None) -> None:
        """An absent model means the served one; any other name is a 404, as in OpenAI's API."""
        if model and model != self.model_name:
            message = f"The model `{model}` does not exist (this server serves `{self.model_name}`)."
            raise APIError(404, message, "model", "model_not_found")

    def sampling_params(self, req: Any, max_new_tokens: int | None) -> SamplingParams:
        """OpenAI request -> SamplingParams (values are verified per prompt in fan_out)."""
        d: dict[str, Any] = {dst: getattr(req, src) for src, dst in _PARAM_FIELDS.items()}
        # NOTE: temperature 0 must reach the scheduler as greedy, so only None means "unset".
        d["max_new_tokens"] = max_new_tokens
        try:
            return SamplingParams.from_dict(d)
        except ValueError as e:
            raise APIError.from_value_error(e, OPENAI_RENAMES) from None

    def fan_out(self, prompts: list[list[int]], params: SamplingParams, rid: str,
                renames: dict[str, str] | None = OPENAI_RENAMES) -> list[SubRequest]:
        """prompts x n sub-requests in OpenAI's choice order; every prompt is validated first, so
        a bad one rejects the whole call before anything is scheduled."""
        for ids in prompts:
            try:
                self.tm.validate(ids, params)
            except ValueError as e:
                raise APIError.from_value_error(e, renames) from None
        subs: list[SubRequest] = []
        total = len(prompts) * params.n
        for ids in prompts:
            for j in range(params.n):
                p = SamplingParams.from_dict(
                    {**params.to_dict(), "n": 1, "seed": None if params.seed is None else params.seed + j}
                )
                subs.append(SubRequest(ids, p, rid if total == 1 else f"{rid}-{len(subs)}"))
        return subs

    def tokenize_prompt(self, text: str | None, ids: list[int] | None) -> list[int]:
        try:
            return self.tm.tokenize(text, ids)
        except ValueError as e:
            raise APIError.from_value_error(e) from None

    @staticmethod
    def check_top_logprobs(value: int | None, param: str) -> int:
        if value is None:
            return 0
        if not 0 <= value <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {value}", param)
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
