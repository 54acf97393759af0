"""--enable-deterministic-inference: a request's tokens and logprobs are bit-identical whatever its
batch holds.

End to end through an in-process Scheduler on the default model: 32 prompts (5..600 tokens, a group
of them sharing a long prefix, so the radix cache turns some PREFILLs into EXTENDs over a cached
prefix), half greedy and half seeded at temperature 0.8 (some with top_p / top_k), run (a) each alone,
radix cache off, whole prompts; (b) all together, radix cache on, 64-token chunks; (c) together in
reversed order, 48-token chunks, mixed chunked prefill, 16-token pages. Tokens and every output logprob (chosen
token and top-2) must agree bit for bit. Plus the building blocks: the tiled GEMM rule, the
variable-length attention kernel, start-up refusal where the mode cannot be honoured.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.batch_invariant import ROW_TILE, tiled_rows
from radixserve.layers.kernel_mode import KernelMode
from radixserve.layers.linear import PackableLinear, onednn_linear_available
from radixserve.managers.io_struct import TokenizedGenerateReqInput
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

ops, why = load_cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"C++ kernels could not be built here: {why}")

MAX_NEW = 6  # enough decode steps for requests to finish at different steps of every run


# ------------------------------------------------------------------------------ tiled GEMM
def _linear(out_f: int, in_f: int, packed: bool, bias: bool, seed: int) -> tuple[PackableLinear, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    lin = PackableLinear()
    lin.weight = torch.nn.Parameter(torch.randn(out_f, in_f, generator=g) * 0.05, requires_grad=False)
    if packed:
        lin.pack(release_dense=False)
    return lin, (torch.randn(out_f, generator=g) if bias else None)


BACKENDS = ["torch"] + (["onednn"] if onednn_linear_available() else [])


@settings(max_examples=40, deadline=None)
@given(bs=st.integers(1, 70), data=st.data())
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiled_linear_row_is_independent_of_its_batch(backend, bs, data):
    """A row's output is bitwise the same alone and at any position of a batch of any size."""
    pos = data.draw(st.integers(0, bs - 1), label="pos")
    out_f, in_f = data.draw(st.sampled_from([(960, 576), (3072, 576), (576, 1536)]), label="shape")
    bias = data.draw(st.booleans(), label="bias")
    lin, b = _linear(out_f, in_f, backend == "onednn", bias, seed=bs)
    g = torch.Generator().manual_seed(1000 + bs)
    row = torch.randn(1, in_f, generator=g)
    batch = torch.randn(bs, in_f, generator=g) * 3
    batch[pos] = row[0]
    mode = KernelMode(batch_invariant=True)
    alone = lin.matmul(row, b, mode)
    together = lin.matmul(batch, b, mode)
    assert together.shape == (bs, out_f) and together.is_contiguous()
    assert torch.equal(together[pos], alone[0])
    torch.testing.assert_close(together, torch.nn.functional.linear(batch, lin.weight, b), atol=1e-4, rtol=1e-4)


def test_tiled_rows_calls_exactly_tile_rows():
    shapes = []

    def fn(x):
        shapes.append(tuple(x.shape))
        return x * 2

    x = torch.randn(2 * ROW_TILE + 3, 8)
    assert torch.equal(tiled_rows(fn, x), x * 2)
    assert shapes == [(ROW_TILE, 8)] * 3
    assert tiled_rows(fn, x[:0]).shape == (0, 8)  # IDLE: no rows, no padding


# ------------------------------------------------------------------------------ attention kernel
@needs_kernels
@pytest.mark.parametrize("H, Hkv, D", [(9, 3, 64), (4, 4, 24)])
def test_varlen_kernel_rows_match_sdpa_and_decode_alone(H, Hkv, D):
    """paged_attention_varlen: causal inside each request's block, whole history before it; every row
    equals (bitwise) the same position computed as a lone decode step."""
    g = torch.Generator().manual_seed(H + D)
    S, lens = 2000, [150, 1, 37, 90]
    k_pool, v_pool = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    perm = torch.randperm(S - 1, generator=g) + 1
    slots = list(torch.split(perm[: sum(lens)], lens))
    qs = [torch.randn(n, H, D, generator=g) for n in lens]  # the query of every position

    def call(items):  # (request, query rows, seq_len)
        max_len = max(s for _, _, s in items)
        kv = torch.zeros(len(items), max_len, dtype=torch.int64)
        starts, off = [], 0
        for j, (b, n, s) in enumerate(items):
            kv[j, :s] = slots[b][:s]
            starts.append(off)
            off += n
        q = torch.cat([qs[b][s - n : s] for b, n, s in items]).contiguous()
        out = torch.full_like(q, float("nan"))
        ops.paged_attention_varlen(q, k_pool, v_pool, kv, torch.tensor([s for *_, s in items]),
                                   torch.tensor(starts), torch.tensor([n for _, n, _ in items]), D**-0.5, 0, 0.0,
                                   out)
        return {(b, s - n + i): out[st + i] for (b, n, s), st in zip(items, starts) for i in range(n)}

    whole = call([(b, n, n) for b, n in enumerate(lens)])  # PREFILL of every request in one call
    for b, n in enumerate(lens):
        ref = torch.nn.functional.scaled_dot_product_attention(
            qs[b].transpose(0, 1)[None], k_pool[slots[b]].transpose(0, 1)[None],
            v_pool[slots[b]].transpose(0, 1)[None], is_causal=True, scale=D**-0.5, enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(torch.stack([whole[(b, p)] for p in range(n)]), ref, atol=2e-5, rtol=1e-4)
    rng = random.Random(D)
    mixed = {}
    for _ in range(6):  # EXTEND-like blocks of random length over random prefixes, several requests
        items = []
        for b in rng.sample(range(len(lens)), rng.randint(1, len(lens))):
            s = rng.randint(1, lens[b])
            items.append((b, rng.randint(1, s), s))
        mixed.update(call(items))
    for key, val in {**whole, **mixed}.items():
        b, p = key
        assert torch.equal(val, call([(b, 1, p + 1)])[key]), f"request {b} position {p}"


@needs_kernels
@pytest.mark.parametrize("field, value, message", [
    ("q_start", [3], "outside q's 4 rows"),   # rows 3 .. 5 of a 4-row q
    ("seq_lens", [1], "seq_len 1"),           # fewer keys than query rows
    ("kv_idx", [[0, 1, 10**6]], "outside the pool"),
])
def test_varlen_kernel_rejects_bad_tables(field, value, message):
    case = {"q_start": [0], "q_lens": [2], "seq_lens": [3], "kv_idx": [[0, 1, 2]]}
    case[field] = value
    q = torch.randn(4, 9, 64)
    pool = torch.randn(8, 3, 64)
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention_varlen(q, pool, pool, torch.tensor(case["kv_idx"]), torch.tensor(case["seq_lens"]),
                                   torch.tensor(case["q_start"]), torch.tensor(case["q_lens"]), 0.125,
                                   0, 0.0, torch.empty_like(q))


# ------------------------------------------------------------------------------ start-up
@pytest.mark.parametrize("bad", [{"device": "cuda"}, {"dtype": "bfloat16"},
                                 {"attention_backend": "torch_native"}, {"attention_backend": "cpu_paged"},
                                 {"tp_size": 4}])
def test_server_args_refuse_what_the_mode_cannot_honour(bad):
    with pytest.raises(ValueError, match="ServerArgs.enable_deterministic_inference"):
        ServerArgs(enable_deterministic_inference=True, **bad)


def test_startup_fails_clearly_without_the_cpp_kernels(model_runner, monkeypatch):
    from radixserve.model_executor import model_runner as mr

    monkeypatch.setattr(mr, "load_cpu_ops", lambda: (None, "CalledProcessError: no C++ compiler"))
    args = model_runner.server_args.replace(enable_deterministic_inference=True, max_total_tokens=64)
    with pytest.raises(RuntimeError, match="enable-deterministic-inference.*no C\\+\\+ compiler"):
        mr.ModelRunner(args, model=model_runner.model)


# ------------------------------------------------------------------------------ end to end
def make_text(rng: random.Random, n_words: int) -> str:
    words = ["river", "mountain", "engine", "cache", "token", "prefix", "radix", "request", "batch", "decode", "prefill", "memory", "page", "slot", "kernel", "tensor", "window", "garden", "violin", "market", "winter", "ocean", "forest", "signal", "lantern", "harbor"]
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.fixture(scope="module")
def requests(tokenizer) -> dict[str, tuple[list[int], SamplingParams]]:
    return build_requests(tokenizer)


def build_requests(tokenizer) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(11)
    base = tokenizer.encode(make_text(rng, 1500), add_special_tokens=False)
    shared = tokenizer.encode(make_text(rng, 260), add_special_tokens=False)[:240]
    lens = [5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 18, 20, 23, 26, 30, 34, 39, 45, 52, 60, 70, 80, 95, 110, 130, 150,
            250, 256, 264, 280, 300, 600]
    out = {}
    for i, n in enumerate(lens):
        if n >= 250 and n != 256:  # a long common prefix: EXTEND over the radix cache
            ids = shared + base[i * 13 : i * 13 + n - len(shared)]
        else:
            ids = base[i * 17 : i * 17 + n]
        assert len(ids) == n
        if i % 2 == 0:
            params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
        else:
            extra = {"top_p": 0.9, "top_k": 40} if i % 4 == 3 else {}
            params = SamplingParams(temperature=0.8, seed=1000 + i, max_new_tokens=MAX_NEW, ignore_eos=True, **extra)
        out[f"r{i:02d}"] = (ids, params)
    return out


def drive(sched, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Submit every request at once and step until all finish: tokens and bitwise logprobs per request."""
    res = {rid: {"ids": [], "logprobs": [], "top": []} for rid in reqs}
    for rid, (ids, params) in reqs.items():
        err = sched.add_request(TokenizedGenerateReqInput(rid, ids, params, return_logprob=True, top_logprobs_num=2))
        assert err is None, err.error
    steps = 0
    while sched.has_work():
        for out in sched.step():
            r = res[out.rid]
            r["ids"] += out.new_token_ids
            r["logprobs"] += [x.hex() for x in out.output_token_logprobs]  # hex: the exact bits
            r["top"] += [[(t, x.hex()) for t, x in top] for top in out.output_top_logprobs]
        steps += 1
        assert steps < 5000
    return res


@pytest.fixture(scope="module")
def det_scheduler(make_scheduler):
    """A deterministic-mode Scheduler over the session's weights that records the forward modes it runs."""

    def make(**overrides):
        sched = make_scheduler(enable_deterministic_inference=True, max_total_tokens=8192, **overrides)
        runner, modes = sched.model_runner, []
        forward = runner.forward
        runner.forward = lambda fb: (modes.append(fb.forward_mode), forward(fb))[1]
        sched.seen_modes = modes
        return sched

    return make


@pytest.fixture(scope="module")
def alone(det_scheduler, requests):
    sched = det_scheduler(disable_radix_cache=True, chunked_prefill_size=2048)
    ref = {}
    for rid, req in requests.items():
        ref.update(drive(sched, {rid: req}))
    assert ForwardMode.EXTEND not in sched.seen_modes  # every prompt was one PREFILL
    return ref


def _assert_same(alone: dict, other: dict) -> None:
    for rid, ref in alone.items():
        got = other[rid]
        assert len(ref["ids"]) == MAX_NEW
        assert got["ids"] == ref["ids"], f"{rid}: tokens differ"
        assert got["logprobs"] == ref["logprobs"], f"{rid}: output logprobs differ"
        assert got["top"] == ref["top"], f"{rid}: top logprobs differ"


@needs_kernels
def test_together_equals_alone_bitwise(det_scheduler, requests, alone):
    sched = det_scheduler(chunked_prefill_size=64)
    together = drive(sched, requests)
    _assert_same(alone, together)
    info = sched.get_server_info()
    assert info["cache_hit_rate"] > 0, "the shared prefix was meant to hit the radix cache"
    assert ForwardMode.EXTEND in sched.seen_modes and ForwardMode.DECODE in sched.seen_modes


@needs_kernels
def test_reversed_order_other_chunks_mixed_pages_equals_alone_bitwise(det_scheduler, requests, alone):
    sched = det_scheduler(chunked_prefill_size=48, enable_mixed_chunk=True, page_size=16)
    reversed_reqs = dict(reversed(list(requests.items())))
    _assert_same(alone, drive(sched, reversed_reqs))
    assert ForwardMode.MIXED in sched.seen_modes
