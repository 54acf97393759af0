"""IncrementalDetokenizer: streamed deltas add up to the whole decode, each update decodes only a
short window, held-back text never leaks a stop string, and finishing trims as documented."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.managers.detokenizer import _CONTEXT_TOKENS, IncrementalDetokenizer
from radixserve.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def sample_ids(tokenizer) -> list[int]:
    text = "Grüße aus Köln! 東京タワー 🚀🚀 naïve café — a radix tree, a paged KV cache.\n\tdone"
    return tokenizer.encode(text, add_special_tokens=False)


def _feed(tok, ids, chunks, params, reason):
    """Non-final updates in `chunks`-sized steps; the tokens that remain arrive with the finish."""
    detok = IncrementalDetokenizer(tok, params)
    out, pos = [], 0
    for n in chunks:
        if pos + n >= len(ids):
            break
        pos += n
        out.append(detok.update(ids[:pos], None))
    out.append(detok.update(ids, reason))
    return detok, out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deltas_add_up_to_the_whole_decode(tokenizer, sample_ids, data) -> None:
    # random token ids (any bytes, split characters included) or real text, in random chunk sizes
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=40),
        st.just(sample_ids),
    ))
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=60))
    detok, deltas = _feed(tokenizer, ids, chunks, SamplingParams(), {"type": "length"})
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == whole == detok.final_text()


def test_each_update_decodes_a_short_window(tokenizer, sample_ids) -> None:
    seen: list[int] = []

    class Spy:
        def decode(self, ids, **kw):
            seen.append(len(ids))
            return tokenizer.decode(ids, **kw)

    ids = sample_ids * 20  # a long output
    detok = IncrementalDetokenizer(Spy(), SamplingParams())
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n], None)
    # a window is the context plus the tokens since the last complete character (a few at most)
    assert max(seen) <= _CONTEXT_TOKENS + 8, max(seen)


@pytest.mark.parametrize("stop", ["radix", "KV c", "\n"])
def test_stop_string_never_streams_and_is_trimmed(tokenizer, sample_ids, stop) -> None:
    text = tokenizer.decode(sample_ids, skip_special_tokens=True)
    cut = text.index(stop)
    # the scheduler stops at the first token whose text completes the stop string
    end = next(n for n in range(1, len(sample_ids) + 1)
               if stop in tokenizer.decode(sample_ids[:n], skip_special_tokens=True))
    ids = sample_ids[:end]
    params = SamplingParams(stop=[stop])
    detok, deltas = _feed(tokenizer, ids, [1] * len(ids), params, {"type": "stop", "matched": stop})
    assert all(stop not in "".join(deltas[:k]) for k in range(len(deltas) + 1))
    assert "".join(deltas) == text[:cut] == detok.final_text()
    keep = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[stop], no_stop_trim=True))
    streamed = "".join(keep.update(ids[:n], None) for n in range(1, len(ids)))
    streamed += keep.update(ids, {"type": "stop", "matched": stop})
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_token_is_not_text(tokenizer, sample_ids) -> None:
    ids = sample_ids[:6] + [tokenizer.encode(" fin", add_special_tokens=False)[0]]
    params = SamplingParams(skip_special_tokens=False)
    detok, deltas = _feed(tokenizer, ids, [2, 2, 2], params, {"type": "stop", "matched": ids[-1]})
    assert "".join(deltas) == tokenizer.decode(ids[:-1]) == detok.final_text()
