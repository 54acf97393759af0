"""ChatReasoning: what one chat request asks of the reasoning, on the HTTP side.

The request fields (`separate_reasoning`, `chat_template_kwargs`, `thinking_budget` and its alias
`max_thinking_tokens`) are checked here, once; the rendered prompt says where the output starts
(reasoning_parser.prompt_state); the sampling params it adds make the scheduler's ThinkingGate count
the reasoning tokens, force `</think>` at the budget and hold the request's grammar back until the
answer. The finished text (or each streamed delta) is split by a ReasoningParser.
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.entrypoints.openai_serving import APIError
from radixserve.parser.reasoning_parser import (
    PromptState,
    ReasoningDelta,
    ReasoningParser,
    prompt_state,
    resolve_reasoning_parser,
    starts_in_reasoning,
)
from radixserve.parser.thinking_gate import PENDING, THINKING

MAX_TEMPLATE_KWARGS_CHARS = 16_384  # enable_thinking and friends are a few bytes; a template is not a store
MAX_TEMPLATE_KWARGS = 32
# keys the server itself passes to apply_chat_template: a client must not replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                                      "tokenize", "chat_template", "continue_final_message", "return_dict",
                                      "tokenizer_kwargs", "padding", "truncation", "max_length",
                                      "return_tensors", "return_assistant_tokens_mask"})


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """chat_template_kwargs: a small object of JSON values for the template, or a 400 naming it."""
    if value is None:
        return {}
    name = "chat_template_kwargs"
    if not isinstance(value, dict):
        raise APIError(400, f"{name}: must be an object, got {type(value).__name__}", name)
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise APIError(400, f"{name}: at most {MAX_TEMPLATE_KWARGS} keys, got {len(value)}", name)
    size = len(json.dumps(value))
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise APIError(400, f"{name}: at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON, got {size}", name)
    for key in value:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise APIError(400, f"{name}: key {key!r} is not allowed (reserved, or not a template variable name)",
                           name)
    return dict(value)


def _budget(req: Any, context_len: int, default: int | None) -> tuple[int | None, str]:
    given = [(n, getattr(req, n, None)) for n in ("thinking_budget", "max_thinking_tokens")]
    given = [(n, v) for n, v in given if v is not None]
    if len(given) > 1:
        raise APIError(400, "max_thinking_tokens: is an alias of thinking_budget; give one", "max_thinking_tokens")
    if not given:
        return default, "thinking_budget"
    name, value = given[0]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= context_len:
        raise APIError(400, f"{name}: must be an int in [1, {context_len}] (the context length), got {value!r}",
                       name)
    return value, name


class ChatReasoning:
    def __init__(self, req: Any, server_args: Any, chat_template: str | None, context_len: int) -> None:
        self.template_kwargs = check_template_kwargs(getattr(req, "chat_template_kwargs", None))
        self.parser_name = resolve_reasoning_parser(server_args.reasoning_parser, chat_template)
        self.separate = getattr(req, "separate_reasoning", True) is not False
        self.budget, self.budget_field = _budget(req, context_len, server_args.thinking_budget)
        if self.parser_name is None and self.budget is not None:
            raise APIError(400, f"{self.budget_field}: this server has no reasoning parser (--reasoning-parser)",
                           self.budget_field)
        self.state = PromptState.NONE

    @property
    def active(self) -> bool:
        return self.parser_name is not None

    def sampling(self, prompt: str) -> dict[str, Any]:
        """The sampling params that start the request's thinking gate (none when thinking is off)."""
        if not self.active:
            return {}
        self.state = prompt_state(prompt)
        start = starts_in_reasoning(self.parser_name, self.state)
        if start is False:
            return {}  # the template closed the thinking (enable_thinking: false): a plain answer
        return {"reasoning_start": THINKING if start else PENDING, "thinking_budget": self.budget}

    def parser(self) -> ReasoningParser | None:
        """A fresh split for one choice; None when the text is not split (no parser, or
        separate_reasoning false: the thinking stays in content)."""
        if not self.active or not self.separate:
            return None
        return ReasoningParser(self.parser_name, self.state)

    def split(self, text: str) -> tuple[str | None, str]:
        parser = self.parser()
        return (None, text) if parser is None else parser.parse(text)

    @staticmethod
    def stream_delta(delta: ReasoningDelta) -> dict[str, Any] | None:
        if not delta.reasoning:
            return None
        return {"reasoning_content": delta.reasoning, "reasoning": delta.reasoning}

    def reasoning_tokens(self, outs: list[dict[str, Any]]) -> int | None:
        if not self.active:
            return None
        return sum(o.get("meta_info", {}).get("reasoning_tokens", 0) for o in outs)

    def add_usage(self, usage: Any, outs: list[dict[str, Any]]) -> Any:
        """usage.completion_tokens_details.reasoning_tokens, with a reasoning parser."""
        from radixserve.entrypoints.openai_protocol import CompletionTokensDetails

        count = self.reasoning_tokens(outs)
        if count is not None:
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)
        return usage
