"""managers/embedding_request.py and layers/pooler.py without a model: input forms, the bounds on
dimensions / encoding_format, Matryoshka truncation, OpenAI's base64 encoding, the server-kind rule."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch

from radixserve.layers.pooler import finalize
from radixserve.managers.embedding_request import (
    check_options,
    check_server_kind,
    embedding_input,
    encode_vector,
    truncate,
)


def _unit(n: int, seed: int = 0) -> list[float]:
    v = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (v / v.norm()).tolist()


def test_input_forms_become_prompts_that_generate_nothing():
    one = embedding_input("hello", rid="r", timeout=3.0)
    assert (one.text, one.input_ids, one.rid, one.timeout) == ("hello", None, "r", 3.0)
    assert one.sampling_params == {"max_new_tokens": 0}
    assert embedding_input(["a", "b"]).text == ["a", "b"]
    assert embedding_input([1, 2, 3]).input_ids == [1, 2, 3]
    assert embedding_input([[1], [2, 3]]).input_ids == [[1], [2, 3]]


@pytest.mark.parametrize("bad", [[], ["a", 1], [[1], 2], [True, 1], None, 3, {"a": 1}, [1.5]])
def test_bad_input_forms_name_the_field(bad):
    with pytest.raises(ValueError, match=r"^input: "):
        embedding_input(bad)


@pytest.mark.parametrize("dims", [0, -1, 577, 10**30, True, 2.5, "8"])
def test_dimensions_out_of_range_is_refused(dims):
    with pytest.raises(ValueError, match=r"^dimensions: must be an integer in \[1, 576\]"):
        check_options(dims, "float", 576)


def test_dimensions_and_formats_in_range_pass():
    for dims in (None, 1, 576):
        check_options(dims, "float", 576)
    check_options(None, "base64", 576)
    with pytest.raises(ValueError, match="^encoding_format: "):
        check_options(None, "int8", 576)


def test_truncation_renormalises_the_head():
    vec = _unit(64)
    head = truncate(vec, 16)
    assert len(head) == 16 and math.isclose(math.fsum(x * x for x in head), 1.0, rel_tol=1e-12)
    scale = head[0] / vec[0]
    assert all(math.isclose(h, v * scale, rel_tol=1e-12) for h, v in zip(head, vec[:16]))
    assert truncate(vec, None) == vec and truncate(vec, 64) == vec


def test_base64_is_little_endian_float32_of_the_truncated_vector():
    vec = _unit(32, seed=1)
    for dims in (None, 8):
        text = encode_vector(vec, dims, "base64")
        assert isinstance(text, str)
        decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
        want = np.asarray(encode_vector(vec, dims, "float"), dtype=np.float32)
        assert decoded.shape == want.shape and np.array_equal(decoded, want)


def test_finalize_pools_and_normalises():
    acc = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert finalize(acc, 5, "last") == pytest.approx([0.6, 0.8])
    assert finalize(acc * 5, 5, "mean") == pytest.approx([0.6, 0.8])


def test_server_kind_is_named_both_ways():
    check_server_kind(False, False)
    check_server_kind(True, True)
    with pytest.raises(ValueError, match="text-generation server.*--is-embedding"):
        check_server_kind(False, True)
    with pytest.raises(ValueError, match="embedding server .*--is-embedding.*not text generation"):
        check_server_kind(True, False)
