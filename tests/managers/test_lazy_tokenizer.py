"""The scheduler builds its tokenizer only when a request needs text (model_loader.LazyTokenizer): a plain request
leaves it unbuilt, a stop string builds it, and the built one is get_tokenizer's."""

from __future__ import annotations

import copy
import pickle

from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.model_loader import LazyTokenizer, get_tokenizer, resolved_tokenizer
from radixserve.sampling.sampling_params import SamplingParams


def _finish(sched, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    assert sched.add_request(TokenizedGenerateReqInput(rid, ids, params)) is None
    out: list[int] = []
    while sched.has_work():
        for o in sched.step():
            out.extend(o.new_token_ids)
    return out


def test_a_scheduler_builds_its_tokenizer_only_for_a_request_that_needs_text(fast_runner) -> None:
    from radixserve.managers.scheduler import Scheduler

    sched = Scheduler(fast_runner.server_args, model_runner=fast_runner)
    lazy = sched.tokenizer
    assert isinstance(lazy, LazyTokenizer) and lazy._lazy_tokenizer is None
    ids = [1, 504, 3458, 282, 2114]
    plain = _finish(sched, "plain", ids, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(plain) == 8 and lazy._lazy_tokenizer is None  # ids in, ids out: no text, no tokenizer
    copy.copy(lazy)
    pickle.dumps(lazy)
    assert lazy._lazy_tokenizer is None  # protocol probes load nothing
    tok = get_tokenizer(fast_runner.model_path)
    stop = tok.decode(plain[2:4])
    stopped = _finish(sched, "stop", ids, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True,
                                                         stop=[stop]))
    assert lazy._lazy_tokenizer is not None and len(stopped) < 8  # the stop string was matched on text
    assert lazy.decode(plain) == tok.decode(plain) and len(lazy) == len(tok)
    assert resolved_tokenizer(lazy) is lazy.resolve() and resolved_tokenizer(tok) is tok
