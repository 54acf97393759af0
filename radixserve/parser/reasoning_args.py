"""The reasoning knobs' rules, written once: ServerArgs (`--reasoning-parser`, `--thinking-budget`), the
chat route (`thinking_budget` / `max_thinking_tokens`) and raw sampling params (`/generate`,
`Engine.generate`) all call these."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.parser.reasoning_parser import REASONING_PARSER_NAMES

# The server default's bound before the model (and so its context length) is known; no context is longer.
MAX_THINKING_BUDGET = 1 << 20


def thinking_budget_error(value: Any, limit: int) -> str | None:
    """Why `value` is not a thinking budget (an int in [1, limit]), or None when it is one."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        return f"must be an int in [1, {limit}] (tokens of thinking, at most the context length), got {value!r}"
    return None


def check_thinking_budget(value: Any, limit: int, name: str = "thinking_budget") -> None:
    """A ValueError naming the field when `value` is set and is not a budget within `limit`."""
    if value is not None and (why := thinking_budget_error(value, limit)) is not None:
        raise ValueError(f"{name}: {why}")


def check_reasoning_args(args: Any, bad: Callable[[str, str], None]) -> None:
    """ServerArgs' reasoning block; `bad(field, why)` raises."""
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSER_NAMES:
        bad("reasoning_parser", f"unknown parser {args.reasoning_parser!r}; known: {', '.join(REASONING_PARSER_NAMES)}")
    if args.thinking_budget is not None:
        if args.reasoning_parser is None:
            bad("thinking_budget", "needs --reasoning-parser (there is no thinking to budget without one)")
        why = thinking_budget_error(args.thinking_budget, args.context_length or MAX_THINKING_BUDGET)
        if why is not None:
            bad("thinking_budget", why)
