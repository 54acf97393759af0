"""Continuous batching is exact: 32 prompts (5 to 1,500 tokens) submitted together, or arriving
at staggered steps, produce the tokens each produces alone, under every scheduling config."""

from __future__ import annotations

import random

import pytest

from tests.managers.driver import compare, greedy, run

WORDS = ("river mountain engine cache token prefix radix request batch decode prefill memory page "
         "slot kernel tensor matrix window garden violin market winter summer ocean forest signal "
         "number letter answer question story village harbor captain lantern").split()


def make_text(rng: random.Random, n_sentences: int) -> str:
    return " ".join(
        f"{rng.choice(WORDS).capitalize()} {rng.choice(WORDS)} {rng.choice(WORDS)} near the {rng.choice(WORDS)}."
        for _ in range(n_sentences)
    )


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    rng = random.Random(7)
    shared = tokenizer.encode(make_text(rng, 40), add_special_tokens=False)  # a common prefix for some
    base = tokenizer.encode(make_text(rng, 400), add_special_tokens=False)
    # mostly short, a few long: 5 .. 1500 tokens (keeps the suite's prefill work bounded)
    lens = [5, 6, 7, 8, 9, 10, 12, 14, 16, 18, 20, 23, 26, 30, 34, 38, 43, 48, 54, 60, 68, 76, 86, 96,
            108, 122, 138, 156, 176, 200, 300, 1500]
    out = {}
    for i, n in enumerate(lens):
        if i % 4 == 1 and n > len(shared) + 5:
            ids = shared + base[i * 7 : i * 7 + n - len(shared)]
        else:
            ids = base[i * 5 : i * 5 + n]
        assert len(ids) == n
        out[f"r{i:02d}"] = ids
    return out


@pytest.fixture(scope="module")
def alone(make_scheduler, prompts):
    """Reference: every prompt run on its own, radix cache off, nothing else in the batch."""
    sched = make_scheduler(disable_radix_cache=True)
    ref = {}
    for rid, ids in prompts.items():
        ref.update(run(sched, {rid: ids}, greedy()))
    return ref


CONFIGS = {
    "radix": dict(),
    "no_radix": dict(disable_radix_cache=True),
    "chunk64": dict(chunked_prefill_size=64),
    "page16": dict(page_size=16),
    "mixed_chunk": dict(enable_mixed_chunk=True, chunked_prefill_size=128),
    "max_running4": dict(max_running_requests=4),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_together_equals_alone(make_scheduler, prompts, alone, name):
    sched = make_scheduler(**CONFIGS[name])
    together = run(sched, prompts, greedy())
    excused = compare(alone, together)
    print(f"{name}: {excused} near-tie divergences excused of {len(prompts)} requests")
    assert sched.get_server_info()["num_used_tokens"] == 0


@pytest.mark.parametrize("name", ["radix", "mixed_chunk"])
def test_staggered_arrivals_equal_alone(make_scheduler, prompts, alone, name):
    sched = make_scheduler(**{**CONFIGS[name], "chunked_prefill_size": 128})
    arrive = {rid: (i % 8) * 3 for i, rid in enumerate(prompts)}  # new requests join running decodes
    excused = compare(alone, run(sched, prompts, greedy(), arrive=arrive))
    print(f"staggered {name}: {excused} near-tie divergences excused")


def test_small_pool_retracts_and_output_is_unchanged(make_scheduler, prompts, tokenizer):
    # A pool that holds the longest prompt but not everyone's decode growth, and no
    # reservation for future tokens: decode must run out of slots and retract.
    subset = {rid: ids for rid, ids in list(prompts.items())[::2] if len(ids) <= 300}
    alone_sched = make_scheduler(disable_radix_cache=True)
    ref = {}
    for rid, ids in subset.items():
        ref.update(run(alone_sched, {rid: ids}, greedy(16)))
    sched = make_scheduler(max_total_tokens=450, init_new_token_ratio=0.0, min_new_token_ratio=0.0,
                           chunked_prefill_size=128)
    together = run(sched, subset, greedy(16))
    info = sched.get_server_info()
    assert info["num_retractions"] > 0, "the pool was meant to force retraction"
    excused = compare(ref, together)
    print(f"retraction: {info['num_retractions']} retractions, {excused} near-tie divergences excused")
