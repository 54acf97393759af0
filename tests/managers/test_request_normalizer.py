"""RequestNormalizer: every bound and rule, with a ValueError naming the field, and the fan-out."""

from __future__ import annotations

import pytest

from radixserve.managers.io_struct import GenerateReqInput
from radixserve.managers.request_normalizer import RequestLimits, RequestNormalizer
from radixserve.server_args import ServerArgs


@pytest.fixture(scope="module")
def norm(tokenizer) -> RequestNormalizer:
    args = ServerArgs(max_prompts_per_request=4, max_n=3, max_stop_strings=2, max_stop_string_len=5,
                      max_logit_bias=2, max_top_logprobs=20, request_timeout=60.0)
    return RequestNormalizer(tokenizer, RequestLimits.build(args, context_len=64, vocab_size=49152,
                                                            max_total_num_tokens=10_000))


BAD = [
    (dict(text="hi", input_ids=[1]), "prompt"),
    (dict(), "prompt"),
    (dict(text=[]), "prompt"),
    (dict(text=["a"] * 5), "prompt"),
    (dict(text=3), "prompt"),
    (dict(input_ids=[1, "x"]), "input_ids"),
    (dict(input_ids=[-1]), "input_ids"),
    (dict(input_ids=[10**9]), "input_ids"),
    (dict(input_ids=[[1], 2]), "input_ids"),
    (dict(input_ids=[1] * 64), "prompt"),
    (dict(text="hi", sampling_params={"max_new_tokens": 10**300}), "max_new_tokens"),
    (dict(input_ids=[1] * 60, sampling_params={"max_new_tokens": 5}), "max_new_tokens"),
    (dict(text="hi", sampling_params={"n": 4}), "n"),
    (dict(text="hi", sampling_params={"n": 10**300}), "n"),
    (dict(text="hi", sampling_params={"stop": ["a", "b", "c"]}), "stop"),
    (dict(text="hi", sampling_params={"stop": ["toolong"]}), "stop"),
    (dict(text="hi", sampling_params={"stop_token_ids": [1, 2, 3]}), "stop_token_ids"),
    (dict(text="hi", sampling_params={"logit_bias": {"1": 1, "2": 1, "3": 1}}), "logit_bias"),
    (dict(text="hi", sampling_params={"temperature": float("nan")}), "temperature"),
    (dict(text="hi", sampling_params=[{}, {}]), "sampling_params"),
    (dict(text="hi", sampling_params="greedy"), "sampling_params"),
    (dict(text="hi", top_logprobs_num=10**6), "top_logprobs_num"),
    (dict(text="hi", top_logprobs_num=-1), "top_logprobs_num"),
    (dict(text="hi", return_logprob="yes"), "return_logprob"),
    (dict(text="hi", timeout=-1), "timeout"),
    (dict(text="hi", timeout=float("inf")), "timeout"),
    (dict(text="hi", rid=""), "rid"),
    (dict(text="hi", rid="x" * 1000), "rid"),
    (dict(text="hi", priority=10**40), "priority"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_names_the_field(norm, fields, param) -> None:
    with pytest.raises(ValueError) as e:
        norm.normalize(GenerateReqInput(**fields))
    assert str(e.value).startswith(param), e.value


def test_fan_out_order_rids_and_seeds(norm) -> None:
    subs, is_batch = norm.normalize(GenerateReqInput(text=["a", "b"], rid="call", sampling_params={"n": 2, "seed": 7}))
    assert is_batch and [s.rid for s in subs] == ["call-0", "call-1", "call-2", "call-3"]
    assert all(s.parent_rid == "call" for s in subs)
    assert [s.sampling_params.seed for s in subs] == [7, 8, 7, 8]
    assert subs[0].input_ids == subs[1].input_ids != subs[2].input_ids
    one, is_batch = norm.normalize(GenerateReqInput(text="a", rid="solo"))
    assert not is_batch and one[0].rid == "solo" and one[0].parent_rid is None


def test_max_new_tokens_defaults_are_clamped_not_rejected(norm) -> None:
    ids = [1] * 60
    (sub,), _ = norm.normalize(GenerateReqInput(input_ids=ids))  # SamplingParams' default 128
    assert sub.sampling_params.max_new_tokens == 4
    (sub,), _ = norm.normalize(GenerateReqInput(input_ids=[1] * 10, default_max_new_tokens=-1))
    assert sub.sampling_params.max_new_tokens == 54  # until the context is full
    (sub,), _ = norm.normalize(GenerateReqInput(input_ids=[1] * 10, default_max_new_tokens=16))
    assert sub.sampling_params.max_new_tokens == 16


def test_timeout_default_and_shorter_only(norm) -> None:
    (sub,), _ = norm.normalize(GenerateReqInput(text="a"))
    assert sub.timeout == 60.0
    (sub,), _ = norm.normalize(GenerateReqInput(text="a", timeout=5))
    assert sub.timeout == 5
    (sub,), _ = norm.normalize(GenerateReqInput(text="a", timeout=10**6))
    assert sub.timeout == 60.0


def test_pool_smaller_than_context_is_the_limit(tokenizer) -> None:
    limits = RequestLimits.build(ServerArgs(), context_len=8192, vocab_size=49152, max_total_num_tokens=100)
    assert limits.max_req_len == 98
    with pytest.raises(ValueError, match="KV pool"):
        RequestNormalizer(tokenizer, limits).normalize(GenerateReqInput(input_ids=[1] * 50,
                                                                        sampling_params={"max_new_tokens": 60}))


def _bos_tokenizer(add_bos: bool):
    """A real fast tokenizer (tokenizers + transformers) whose settings add a BOS, with a chat template
    that writes its own BOS too (as Llama 2 / Mistral templates do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hi": 3, "there": 4, "[INST]": 5, "[/INST]": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{{ bos_token }}{% for m in messages %} [INST] {{ m['content'] }} [/INST]{% endfor %}"
    return fast


def test_bos_follows_the_tokenizer_and_is_never_doubled() -> None:
    from radixserve.managers.request_normalizer import RequestLimits, RequestNormalizer
    from radixserve.server_args import ServerArgs

    limits = RequestLimits.build(ServerArgs(), 64, 7, 1000)
    for add_bos in (True, False):
        tok = _bos_tokenizer(add_bos)
        norm = RequestNormalizer(tok, limits)
        assert norm.tokenize("hi there") == ([0, 3, 4] if add_bos else [3, 4])  # a completions prompt
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert norm.tokenize(chat) == [0, 5, 3, 6]  # the template's BOS, once either way
