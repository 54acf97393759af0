"""Sliding-window attention and logit soft-capping (RadixAttention.sliding_window / logit_cap) in every
attention backend and C++ kernel, against a float64 reference in plain PyTorch: explicit scores, the
soft-cap c * tanh(s / c), the window mask (query at position p sees keys j with p - W < j <= p), softmax.

Cases: windows 1, 3, 7 (and 70: across the flash kernel's 64-key tiles), caps none / 5 / 50, GQA (4 query
heads on 2 kv heads, 3 on 1), head_dim 16 (the kernels' scalar paths) and 64 (their vector paths), float32
and bfloat16 KV pools, prefixes longer than three windows, query blocks that straddle the window edge,
L > 1 short blocks (TARGET_VERIFY), several requests of different lengths.

"Never reads keys outside the window" is checked, not assumed: the K/V rows no query of the call may see
are set to NaN (0 * NaN is NaN, so masking after reading them would still poison the output), and slot-table
entries there may even lie outside the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.layers.attention import torch_native_backend
from radixserve.layers.attention.batch_invariant_backend import BatchInvariantAttnBackend
from radixserve.layers.attention.cpu_paged_backend import CpuPagedAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.radix_attention import RadixAttention
from radixserve.mem_cache.memory_pool import KVPool, ReqToTokenPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

ops, why = load_cpu_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason=f"C++ kernels could not be built here: {why}")

ATOL = RTOL = 1e-5  # float32 kernels against the float64 reference
WINDOWS = st.sampled_from([None, 1, 3, 7, 70])
CAPS = st.sampled_from([None, 5.0, 50.0])
HEADS = st.sampled_from([(4, 2), (3, 1), (2, 2)])
HEAD_DIMS = st.sampled_from([16, 64])


def window_start(pos: int, window: int | None) -> int:
    return 0 if window is None else max(0, pos - window + 1)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, window: int | None,
              cap: float | None) -> torch.Tensor:
    """One request in float64: q [n, H, D] at positions seq - n .. seq - 1, keys/values [seq, Hkv, D]."""
    n, H, _ = q.shape
    seq, Hkv, _ = keys.shape
    k = keys.double().repeat_interleave(H // Hkv, 1).transpose(0, 1)  # [H, seq, D]
    v = values.double().repeat_interleave(H // Hkv, 1).transpose(0, 1)
    s = torch.einsum("nhd,hsd->hns", q.double(), k) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    q_pos = (seq - n + torch.arange(n)).unsqueeze(1)
    key_pos = torch.arange(seq).unsqueeze(0)
    visible = key_pos <= q_pos
    if window is not None:
        visible &= key_pos > q_pos - window
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hns,hsd->nhd", p, v)


# ------------------------------------------------------------------------------ the kernels, directly
@dataclass
class KernelCase:
    q: torch.Tensor  # [n, H, D] float32
    k_pool: torch.Tensor  # [S, Hkv, D]
    v_pool: torch.Tensor
    kv_idx: torch.Tensor  # [nb, max_len]
    seq_lens: torch.Tensor
    q_start: torch.Tensor
    q_lens: torch.Tensor
    want: torch.Tensor  # [n, H, D] float64

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_pool, self.v_pool, self.kv_idx, self.seq_lens, self.q_start, self.q_lens


def kernel_case(seed: int, reqs: list[tuple[int, int]], H: int, Hkv: int, D: int, window: int | None,
                cap: float | None, bf16: bool) -> KernelCase:
    """reqs: (cached prefix, query rows) per request, slots scattered over the pool. Entries of each slot
    row before its first query's window start point at a NaN row; entries past seq_len at slot -1."""
    g = torch.Generator().manual_seed(seed)
    nb, seqs = len(reqs), [p + n for p, n in reqs]
    max_len, S = max(seqs), sum(seqs) + 9
    dtype = torch.bfloat16 if bf16 else torch.float32
    k_pool = torch.randn(S, Hkv, D, generator=g).to(dtype)
    v_pool = torch.randn(S, Hkv, D, generator=g).to(dtype)
    poison = S - 1  # never a visible key: its K/V are NaN
    k_pool[poison] = v_pool[poison] = float("nan")
    perm = torch.randperm(S - 1, generator=g)
    kv_idx = torch.full((nb, max_len), -1, dtype=torch.int64)
    q = torch.randn(sum(n for _, n in reqs), H, D, generator=g) * 3
    want = torch.empty(q.shape, dtype=torch.float64)
    off = row = 0
    for b, (pre, n) in enumerate(reqs):
        s = pre + n
        kv_idx[b, :s] = perm[off : off + s]
        off += s
        want[row : row + n] = reference(q[row : row + n], k_pool[kv_idx[b, :s]].float(),
                                        v_pool[kv_idx[b, :s]].float(), D**-0.5, window, cap)
        kv_idx[b, : window_start(pre, window)] = poison
        row += n
    q_lens = torch.tensor([n for _, n in reqs])
    return KernelCase(q, k_pool, v_pool, kv_idx, torch.tensor(seqs), torch.cumsum(q_lens, 0) - q_lens, q_lens, want)


def kernel_args(window: int | None, cap: float | None) -> tuple[int, float]:
    return window or 0, float(cap or 0.0)


def run_varlen(op: str, c: KernelCase, window: int | None, cap: float | None) -> torch.Tensor:
    out = torch.full_like(c.q, float("nan"))
    getattr(ops, op)(*c.args(), c.q.shape[2] ** -0.5, *kernel_args(window, cap), out)
    return out


def run_paged(c: KernelCase, L: int, window: int | None, cap: float | None) -> torch.Tensor:
    out = torch.full_like(c.q, float("nan"))
    ops.paged_attention(c.q, c.k_pool, c.v_pool, c.kv_idx, c.seq_lens, L, c.q.shape[2] ** -0.5,
                        *kernel_args(window, cap), out)
    return out


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), nb=st.integers(1, 5), L=st.sampled_from([1, 1, 2, 5]),
       prefixes=st.lists(st.integers(0, 90), min_size=5, max_size=5), heads=HEADS, D=HEAD_DIMS, window=WINDOWS,
       cap=CAPS, bf16=st.booleans())
def test_paged_attention_window_and_cap(seed, nb, L, prefixes, heads, D, window, cap, bf16):
    """The short-block kernel (DECODE, TARGET_VERIFY): L query rows per request over its history."""
    c = kernel_case(seed, [(p, L) for p in prefixes[:nb]], *heads, D, window, cap, bf16)
    torch.testing.assert_close(run_paged(c, L, window, cap).double(), c.want, atol=ATOL, rtol=RTOL)


REQS = st.lists(st.tuples(st.integers(0, 100), st.integers(1, 80)), min_size=1, max_size=4)


@needs_kernels
@pytest.mark.parametrize("op", ["paged_attention_varlen", "extend_attention"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), reqs=REQS, heads=HEADS, D=HEAD_DIMS, window=WINDOWS, cap=CAPS,
       bf16=st.booleans())
def test_varlen_kernels_window_and_cap(op, seed, reqs, heads, D, window, cap, bf16):
    """Both variable-length kernels (every mode / long blocks): blocks of up to 80 rows over prefixes of up
    to 100, so blocks straddle window edges, the varlen kernel's 16-row blocks and the flash kernel's
    32-query / 64-key tiles."""
    c = kernel_case(seed, reqs, *heads, D, window, cap, bf16)
    torch.testing.assert_close(run_varlen(op, c, window, cap).double(), c.want, atol=ATOL, rtol=RTOL)


@needs_kernels
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), prefixes=st.lists(st.integers(900, 4500), min_size=1, max_size=3),
       heads=st.sampled_from([(4, 1), (3, 1), (4, 2)]), D=HEAD_DIMS, window=st.sampled_from([None, 70, 1500]),
       cap=CAPS, bf16=st.booleans())
def test_long_decode_rows_split_over_key_chunks(seed, prefixes, heads, D, window, cap, bf16):
    """A decode row that sees more than 1,024 keys runs as 1,024-key chunks merged in order (flash-decoding's
    split-K, so one kv head at batch 1 still uses every thread): equal to the reference, and each row's bits
    its own, whatever the batch around it or the thread count."""
    H, Hkv = heads
    c = kernel_case(seed, [(p, 1) for p in prefixes], H, Hkv, D, window, cap, bf16)
    out = run_paged(c, 1, window, cap)
    torch.testing.assert_close(out.double(), c.want, atol=ATOL, rtol=RTOL)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run_paged(c, 1, window, cap), out)
    finally:
        torch.set_num_threads(threads)
    first = torch.full_like(c.q[:1], float("nan"))  # the first request alone, on the same pool
    ops.paged_attention(c.q[:1].contiguous(), c.k_pool, c.v_pool, c.kv_idx[:1].contiguous(), c.seq_lens[:1].contiguous(),
                        1, D**-0.5, *kernel_args(window, cap), first)
    assert torch.equal(first, out[:1])


@needs_kernels
@pytest.mark.parametrize("D", [16, 64])
def test_window_covering_the_context_is_the_global_kernel_bit_for_bit(D):
    """window >= every position + 1 hides nothing, and then each kernel runs the global arithmetic."""
    c = kernel_case(11, [(40, 3), (7, 3), (0, 3)], 4, 2, D, None, 5.0, False)
    for window in (43, 1000):
        assert torch.equal(run_paged(c, 3, window, 5.0), run_paged(c, 3, None, 5.0))
        for op in ("paged_attention_varlen", "extend_attention"):
            assert torch.equal(run_varlen(op, c, window, 5.0), run_varlen(op, c, None, 5.0))


@needs_kernels
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), D=HEAD_DIMS, window=st.sampled_from([1, 3, 7, 20]), cap=CAPS)
def test_windowed_varlen_is_batch_invariant(seed, D, window, cap):
    """--enable-deterministic-inference with windows: a token's output is bit for bit the same whether its
    prompt ran as one block, inside a batch, or one position at a time (the DECODE step at that position)."""
    reqs = [(0, 50), (0, 23), (0, 9)]
    c = kernel_case(seed, reqs, 4, 2, D, window, cap, False)
    whole = run_varlen("paged_attention_varlen", c, window, cap)
    for b, (_, n) in enumerate(reqs):
        rows = slice(int(c.q_start[b]), int(c.q_start[b]) + n)
        for p in (0, window - 1, window, n - 1):
            if not 0 <= p < n:
                continue
            one = KernelCase(c.q[rows][p : p + 1].contiguous(), c.k_pool, c.v_pool, c.kv_idx[b : b + 1].contiguous(),
                             torch.tensor([p + 1]), torch.tensor([0]), torch.tensor([1]), c.want)
            assert torch.equal(run_varlen("paged_attention_varlen", one, window, cap)[0], whole[rows][p])


@needs_kernels
def test_slots_before_the_window_are_not_even_checked():
    """A slot-table entry no query can see (before the first query's window) is never read, so garbage
    there (a freed slot of an evicted prefix) is accepted; inside the window it is still refused."""
    c = kernel_case(5, [(30, 4)], 4, 2, 64, 3, None, False)
    c.kv_idx[0, :27] = 10**9  # the first query (position 30) sees keys 28 .. 30
    for op in ("paged_attention_varlen", "extend_attention"):
        torch.testing.assert_close(run_varlen(op, c, 3, None).double(), c.want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(run_paged(c, 4, 3, None).double(), c.want, atol=ATOL, rtol=RTOL)
    c.kv_idx[0, 28] = 10**9
    for op in ("paged_attention_varlen", "extend_attention"):
        with pytest.raises(RuntimeError, match="outside the pool"):
            run_varlen(op, c, 3, None)
    with pytest.raises(RuntimeError, match="outside the pool"):
        run_paged(c, 4, 3, None)


@needs_kernels
@pytest.mark.parametrize("op", ["paged_attention", "paged_attention_varlen", "extend_attention"])
@pytest.mark.parametrize("window, softcap, message", [
    (-1, 0.0, "window must be >= 0"),
    (-100, 5.0, "window must be >= 0"),
    (0, -1.0, "softcap must be a finite number >= 0"),
    (3, float("nan"), "softcap must be a finite number >= 0"),
    (3, float("inf"), "softcap must be a finite number >= 0"),
])
def test_bad_window_or_softcap_is_refused_naming_the_op(op, window, softcap, message):
    c = kernel_case(1, [(5, 2)], 4, 2, 16, None, None, False)
    args = c.args() if op != "paged_attention" else (c.q, c.k_pool, c.v_pool, c.kv_idx, c.seq_lens, 2)
    with pytest.raises(RuntimeError, match=f"{op}: {message}"):
        getattr(ops, op)(*args, 0.25, window, softcap, torch.empty_like(c.q))


def test_radix_attention_refuses_a_window_below_one_or_a_cap_not_above_zero():
    for kw in ({"sliding_window": 0}, {"sliding_window": -3}, {"logit_cap": 0.0}, {"logit_cap": -1.0}):
        with pytest.raises(ValueError, match="must be"):
            RadixAttention(4, 16, 0.25, 2, 0, **kw)
    layer = RadixAttention(4, 16, 0.25, 2, 0, sliding_window=7, logit_cap=50.0)
    assert (layer.window_arg, layer.cap_arg) == (7, 50.0)
    assert (RadixAttention(4, 16, 0.25, 2, 0).window_arg, RadixAttention(4, 16, 0.25, 2, 0).cap_arg) == (0, 0.0)


# ------------------------------------------------------------------------------ the backends, every mode
def make_backend(name: str):
    cpu = torch.device("cpu")
    if name == "torch_native":
        return TorchNativeAttnBackend(cpu)
    if name == "cpu_paged":
        return CpuPagedAttnBackend(cpu, ops.paged_attention, ops.extend_attention)
    return BatchInvariantAttnBackend(cpu, ops.paged_attention_varlen)


def mode_requests(mode: ForwardMode) -> st.SearchStrategy:
    """(cached prefix, new tokens) per request, as each mode has them; MIXED: extends first, then decodes."""
    pre, ext = st.integers(0, 60), st.integers(1, 45)
    if mode == ForwardMode.PREFILL:
        return st.lists(st.tuples(st.just(0), ext), min_size=1, max_size=3)
    if mode == ForwardMode.EXTEND:
        return st.lists(st.tuples(pre, ext), min_size=1, max_size=3)
    if mode == ForwardMode.DECODE:
        return st.lists(st.tuples(st.integers(1, 60), st.just(1)), min_size=1, max_size=4)
    if mode == ForwardMode.TARGET_VERIFY:
        return st.lists(st.tuples(st.integers(1, 60), st.integers(1, 4)), min_size=1, max_size=4)
    extends = st.lists(st.tuples(pre, st.integers(2, 45)), min_size=1, max_size=2)
    decodes = st.lists(st.tuples(st.integers(1, 60), st.just(1)), min_size=1, max_size=2)
    return st.tuples(extends, decodes).map(lambda t: t[0] + t[1])


@st.composite
def scenarios(draw):
    mode = draw(st.sampled_from([ForwardMode.PREFILL, ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED,
                                 ForwardMode.TARGET_VERIFY]))
    return mode, draw(mode_requests(mode))


def num_extend_reqs(mode: ForwardMode, reqs: list[tuple[int, int]]) -> int | None:
    if mode != ForwardMode.MIXED:
        return None
    return sum(1 for _, e in reqs if e > 1)  # mode_requests puts extends (>= 2 tokens) first


def run_step(backend, mode: ForwardMode, reqs: list[tuple[int, int]], layers: list[RadixAttention],
             kv_dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step of `layers` (sharing the step's metadata) through `backend` on a real KV pool: each request's
    history already in the pool, this step's K/V written by the backend. Returns (got, want) per layer.
    K/V rows no query of the step may see on a windowed layer are NaN in that layer's pool."""
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    nb, pres, exts = len(reqs), [p for p, _ in reqs], [e for _, e in reqs]
    seqs, n = [p + e for p, e in reqs], sum(exts)
    S = sum(seqs) + 8
    rtt = ReqToTokenPool(nb + 2, max(seqs) + 4)
    pool = KVPool(S, len(layers), Hkv, D, dtype=kv_dtype)
    perm = torch.randperm(S - 1, generator=g) + 1  # slot 0 is never handed out
    rows = [nb - b for b in range(nb)]  # request rows not in batch order
    slots, off = [], 0
    for b, s in enumerate(seqs):
        slots.append(perm[off : off + s])
        rtt.req_to_token[rows[b], :s] = slots[-1]
        off += s
    starts = torch.tensor([0, *exts[:-1]]).cumsum(0)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=nb, input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.cat([torch.arange(p, s) for p, s in zip(pres, seqs)]),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seqs), seq_lens_cpu=seqs,
        extend_seq_lens=torch.tensor(exts), extend_prefix_lens=torch.tensor(pres),
        extend_start_loc=starts, extend_seq_lens_cpu=exts, extend_prefix_lens_cpu=pres,
        out_cache_loc=torch.cat([sl[p:] for sl, p in zip(slots, pres)]), req_to_token_pool=rtt,
        token_to_kv_pool=pool, sampling_info=None, num_extend_reqs=num_extend_reqs(mode, reqs),
        attn_backend=backend,
    )
    backend.init_forward_metadata(fb)
    results = []
    for layer in layers:
        # bf16-representable K/V: the pool stores them exactly, whichever path reads them
        keys = [torch.randn(s, Hkv, D, generator=g).to(kv_dtype).float() for s in seqs]
        values = [torch.randn(s, Hkv, D, generator=g).to(kv_dtype).float() for s in seqs]
        q = torch.randn(n, H, D, generator=g) * 3
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        want = torch.empty(n, H, D, dtype=torch.float64)
        for b, (pre, ext) in enumerate(reqs):
            k_buf[slots[b][:pre]] = keys[b][:pre].to(kv_dtype)
            v_buf[slots[b][:pre]] = values[b][:pre].to(kv_dtype)
            hidden = slots[b][: window_start(pre, layer.sliding_window)]
            k_buf[hidden] = v_buf[hidden] = float("nan")
            rs = slice(int(starts[b]), int(starts[b]) + ext)
            want[rs] = reference(q[rs], keys[b], values[b], layer.scaling, layer.sliding_window, layer.logit_cap)
        k_new = torch.cat([kb[p:] for kb, p in zip(keys, pres)]).reshape(n, Hkv * D)
        v_new = torch.cat([vb[p:] for vb, p in zip(values, pres)]).reshape(n, Hkv * D)
        got = layer(q.reshape(n, H * D), k_new, v_new, fb).view(n, H, D)
        results.append((got, want))
    return results


BACKENDS = ["torch_native", pytest.param("cpu_paged", marks=needs_kernels),
            pytest.param("batch_invariant", marks=needs_kernels)]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), scenario=scenarios(), heads=st.sampled_from([(4, 2), (3, 1)]), D=HEAD_DIMS,
       window=st.sampled_from([None, 1, 3, 7]), cap=CAPS, other=st.sampled_from([(None, None), (2, None), (5, 5.0)]),
       bf16=st.booleans(), chunk=st.sampled_from([5, 256]))
def test_backend_window_and_cap_in_every_mode(backend, seed, scenario, heads, D, window, cap, other, bf16, chunk):
    """Two layers in one step, the drawn (window, cap) and another: backends that cache per-step views keyed
    by window must give each layer its own. chunk: the torch-native backend's row chunk for long windowed
    blocks (5: many chunks, each over its own keys)."""
    mode, reqs = scenario
    H, Hkv = heads
    layers = [RadixAttention(H, D, D**-0.5, Hkv, 0, sliding_window=window, logit_cap=cap),
              RadixAttention(H, D, D**-0.5, Hkv, 1, sliding_window=other[0], logit_cap=other[1])]
    with mock.patch.object(torch_native_backend, "_WINDOW_CHUNK", chunk):
        results = run_step(make_backend(backend), mode, reqs, layers, torch.bfloat16 if bf16 else torch.float32, seed)
    for got, want in results:
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_prefill_on_a_local_layer(backend):
    """A 600-token prompt over a 300-token cached prefix on a window of 7 with a soft-cap: many chunks,
    tiles and blocks, none of them allowed to read the NaN rows before the window."""
    layers = [RadixAttention(4, 64, 0.125, 2, 0, sliding_window=7, logit_cap=30.0),
              RadixAttention(4, 64, 0.125, 2, 1, sliding_window=None, logit_cap=None)]
    for got, want in run_step(make_backend(backend), ForwardMode.EXTEND, [(300, 600), (0, 40)], layers,
                              torch.float32, 3):
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


def test_torch_native_builds_one_windowed_view_per_window_per_step():
    """Masks are per step and per distinct window: layers sharing a window share the view."""
    backend = TorchNativeAttnBackend(torch.device("cpu"))
    layers = [RadixAttention(4, 16, 0.25, 2, i, sliding_window=w) for i, w in enumerate([3, None, 3, 7])]
    with mock.patch.object(torch_native_backend, "windowed_table",
                           wraps=torch_native_backend.windowed_table) as built:
        for got, want in run_step(backend, ForwardMode.DECODE, [(20, 1), (9, 1), (40, 1)], layers, torch.float32, 0):
            torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    assert sorted(call.args[2] for call in built.call_args_list) == [3, 7]
