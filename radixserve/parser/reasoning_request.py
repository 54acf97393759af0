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

from radixserve.entrypoints.openai_protocol import CompletionTokensDetails
from radixserve.entrypoints.openai_serving import APIError
from radixserve.parser.reasoning_args import check_thinking_budget
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


def _budget(req: Any, context_len: int, default: int | None) -> tuple[int | None, str | None]:
    """(the budget, the request field that gave it; None when it is the server's default)."""
    given = [(n, v) for n in ("thinking_budget", "max_thinking_tokens") if (v := getattr(req, n, None)) is not None]
    if len(given) > 1:
        raise APIError(400, "max_thinking_tokens: is an alias of thinking_budget; give one", "max_thinking_tokens")
    if not given:
        return default, None
    name, value = given[0]
    try:
        check_thinking_budget(value, context_len, name)
    except ValueError as e:
        raise APIError(400, str(e), name) from None
    return value, name


class ChatReasoning:
    """One chat request's reasoning: the template kwargs, the gate's sampling params, the split."""

    def __init__(self, req: Any, server_args: Any, chat_template: str | None, context_len: int) -> None:
        self.template_kwargs = check_template_kwargs(getattr(req, "chat_template_kwargs", None))
        self.parser_name = resolve_reasoning_parser(server_args.reasoning_parser, chat_template)
        self.separate = getattr(req, "separate_reasoning", True) is not False
        self.budget, field = _budget(req, context_len, server_args.thinking_budget)
        if self.parser_name is None:
            if field is not None:  # asked for by the client: refused, not dropped
                raise APIError(400, f"{field}: this server splits no reasoning (start it with --reasoning-parser; "
                               "with auto, the chat template has no <think> convention)", field)
            self.budget = None  # --reasoning-parser auto on a template that does not think: nothing to budget
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
        """A fresh split for one choice (None without a reasoning parser). With separate_reasoning false
        the thinking comes back verbatim, to be kept in the content."""
        if not self.active:
            return None
        return ReasoningParser(self.parser_name, self.state, raw=not self.separate)

    def split(self, text: str) -> tuple[str | None, str, str]:
        """A finished output -> (reasoning_content, the thinking kept in content, the answer). The answer
        alone goes to the tool parser: a call written inside the thinking is never a call."""
        parser = self.parser()
        if parser is None:
            return None, "", text
        thought, answer = parser.parse(text)
        return (thought, "", answer) if self.separate else (None, thought or "", answer)

    def feed(self, parser: ReasoningParser | None, text: str, finished: bool) -> tuple[dict[str, Any] | None, str]:
        """One streamed delta -> (the reasoning delta to send first, or None; the answer text)."""
        if parser is None:
            return None, text
        split = parser.feed(text)
        if finished:
            rest = parser.finish()
            split = ReasoningDelta(split.reasoning + rest.reasoning, split.content + rest.content)
        if not split.reasoning:
            return None, split.content
        if not self.separate:
            return {"content": split.reasoning}, split.content
        return {"reasoning_content": split.reasoning, "reasoning": split.reasoning}, split.content

    def add_usage(self, usage: Any, outs: list[dict[str, Any]]) -> Any:
        """usage.completion_tokens_details.reasoning_tokens, with a reasoning parser (the scheduler's
        ThinkingGate counts them; 0 for an output that did not think)."""
        if self.active:
            count = sum((o.get("meta_info") or {}).get("reasoning_tokens", 0) for o in outs)
            usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)
        return usage
