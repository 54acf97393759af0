"""Multi-turn stays cached: a finished request's prompt and output enter the radix tree, so turn N+1 (turn N's
prompt + answer + a new user message) hits all of turn N's computed KV, down to the page boundary. The chat-API
version of this runs on a real server in tests/entrypoints/test_http_hicache.py."""

from __future__ import annotations

import pytest

from tests.managers.driver import greedy, run


@pytest.mark.parametrize("page", [1, 16])
def test_each_turn_hits_the_previous_turns_prompt_and_answer(make_scheduler, page) -> None:
    sched = make_scheduler(page_size=page, check_invariants=False)
    prompt = list(range(2000, 2037))  # a system prompt and the first user message
    previous = None
    for turn in range(4):
        out = run(sched, {f"t{turn}": prompt}, greedy(4 + turn), logprobs=False)[f"t{turn}"]
        cached = out.meta["cached_tokens"]
        if previous is not None:
            # turn N's last sampled token never ran (no KV); the tree keeps whole pages of the rest
            assert cached >= previous - page, (turn, cached, previous)
            assert cached <= previous - 1
        previous = len(prompt) + len(out.output_ids)
        prompt = prompt + out.output_ids + list(range(3000 + 10 * turn, 3005 + 10 * turn))  # the next user turn
