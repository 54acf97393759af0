"""The C++ CPU kernels are chosen by what this CPU reports: every variant it supports builds and
matches PyTorch (each in a subprocess, since one process loads one variant); a variant it lacks is
refused with the missing features named."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from radixserve.kernels.cpu import loader

CHECK = r"""
import torch, torch.nn.functional as F
from radixserve.kernels.cpu import load_cpu_ops, loaded_isa
ops, why = load_cpu_ops()
assert ops is not None, why
torch.manual_seed(0)
nb, H, Hkv, D, L = 3, 6, 2, 24, 2           # D=24: the vector loop's tail is exercised too
lens = [7, 19, 33]
S = sum(lens) + 8
k, v = torch.randn(S, Hkv, D), torch.randn(S, Hkv, D)
perm = torch.randperm(S - 1) + 1
idx = torch.zeros(nb, max(lens), dtype=torch.int64)
off = 0
for b, n in enumerate(lens):
    idx[b, :n] = perm[off:off + n]; off += n
q = torch.randn(nb * L, H, D)
out = torch.empty_like(q)
ops.paged_attention(q, k, v, idx, torch.tensor(lens), L, D ** -0.5, 0, 0.0, out)
for b, n in enumerate(lens):
    kb = k[idx[b, :n]].repeat_interleave(H // Hkv, 1).transpose(0, 1)
    vb = v[idx[b, :n]].repeat_interleave(H // Hkv, 1).transpose(0, 1)
    qb = q[b * L:(b + 1) * L].transpose(0, 1)
    mask = torch.ones(L, n, dtype=torch.bool).tril(n - L)
    ref = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(out[b * L:(b + 1) * L], ref, atol=1e-5, rtol=1e-4)
x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
want = (r + x) * torch.rsqrt(((r + x) ** 2).mean(-1, keepdim=True) + 1e-6) * w
ops.fused_add_rms_norm_(x, r, w, 1e-6)
torch.testing.assert_close(x, want, atol=1e-5, rtol=1e-5)
g = torch.randn(4, 2 * 40); o = torch.empty(4, 40)
ops.silu_and_mul(g, o)
torch.testing.assert_close(o, F.silu(g[:, :40]) * g[:, 40:], atol=1e-5, rtol=1e-5)
from radixserve.layers.quantization.qweight import QuantWeight
for kind in (0, 1):                          # Q8_0, Q4_1; 13 rows: a padded 8-row group too
    qw = QuantWeight.quantize(torch.randn(13, 64), kind)
    xx = torch.randn(6, 64); oo = torch.empty(6, 13)  # 6 rows: a 4-row tile and a remainder
    ops.quant_linear(xx, kind, qw.n, qw.data, qw.d, qw.m, None, oo)
    xb = xx.reshape(6, 2, 32); xs = xb.abs().amax(2, keepdim=True) / 127
    ref = (torch.round(xb / xs) * xs).reshape(6, 64) @ qw.dequantize().T
    torch.testing.assert_close(oo, ref, atol=1e-3, rtol=1e-4)
# every exact GGUF type (random blocks: every int value, every kernel kind), 13 rows x 2 super-blocks
from radixserve.layers.quantization.gguf_formats import EXACT_TYPES
from tests.layers.test_quant_linear import assert_within_float_rounding, gguf_weight
for i, qtype in enumerate(sorted(EXACT_TYPES)):
    qw = gguf_weight(qtype, 13, 512, i)
    for rows in (1, 6):
        xx = torch.randn(rows, 512); oo = torch.empty(rows, 13)
        ops.quant_linear(xx, qw.kind, qw.n, qw.data, qw.d, qw.m, None, oo)
        assert_within_float_rounding(oo, qw, xx)
# Q5 (Q5_0 / Q5_1 / Q5_K's packed kind) forms the bits of Q8_M, the 8-bit kind that held them before
# (the vector variants; generic's loops are reassociated by -ffast-math, within float rounding only)
from radixserve.layers.quantization.gguf_formats import FORMATS
from tests.layers.test_gguf_formats import random_blocks
rows5 = FORMATS["Q5_K"].rows(random_blocks("Q5_K", 13, 2, 0))
for rows in (1, 6):
    xx = torch.randn(rows, 512); got = []
    for kind in (5, 2):  # Q5, Q8_M
        qw = QuantWeight.from_rows(rows5.promote(kind)); oo = torch.empty(rows, 13)
        ops.quant_linear(xx, kind, qw.n, qw.data, qw.d, qw.m, None, oo); got.append(oo)
    assert torch.equal(got[0], got[1]) or loaded_isa() == "generic"
# extend_attention (long query blocks): a request over a cached prefix and a fresh one, K/V float32 and bf16
for kv in (torch.float32, torch.bfloat16):
    pre, new = [7, 0], [5, 9]
    seq = [p + n for p, n in zip(pre, new)]
    kt, vt = k.to(kv), v.to(kv)
    q2 = torch.randn(sum(new), H, D)
    o2 = torch.empty_like(q2)
    ops.extend_attention(q2, kt, vt, idx[:2].contiguous(), torch.tensor(seq), torch.tensor([0, 5]), torch.tensor(new),
                         D ** -0.5, 0, 0.0, o2)
    ops.paged_attention(q, kt, vt, idx, torch.tensor(lens), L, D ** -0.5, 0, 0.0, out)  # bf16 KV in the decode kernel too
    st = 0
    for b, n in enumerate(new):
        kb = kt[idx[b, :seq[b]]].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
        vb = vt[idx[b, :seq[b]]].float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
        mask = torch.ones(n, seq[b], dtype=torch.bool).tril(seq[b] - n)
        ref = F.scaled_dot_product_attention(q2[st:st + n].transpose(0, 1), kb, vb, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(o2[st:st + n], ref, atol=1e-5, rtol=1e-4)
        st += n
# the fused MoE experts on every exact GGUF type (tests/layers/test_fused_experts.py's check)
from tests.layers.test_fused_experts import check_every_kind
check_every_kind()
# the greedy argmax: ties, -0.0 against +0.0, infinities and NaN, as torch.argmax
from tests.layers.test_cpu_kernels import ARGMAX_CASES
for case in ARGMAX_CASES:
    assert torch.equal(ops.greedy_argmax(case), torch.argmax(case, dim=-1)), case
print("ISA", loaded_isa())
"""


def test_detected_variant_follows_the_cpu_flags() -> None:
    flags, _ = loader.cpu_info()
    isa = loader.detect_isa()
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"}
    if vnni | {"amx_tile", "amx_int8"} <= flags:
        assert isa == "amx"
    elif vnni <= flags:
        assert isa == "avx512vnni"
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= flags:
        assert isa == "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert isa == "avx2"
    else:
        assert isa == "generic"


def test_unknown_or_unsupported_variant_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(loader.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="must be one of"):
        loader.selected_isa()
    lacking = [name for name in loader.ISA_NAMES if loader.missing_features(name)]
    if not lacking:
        pytest.skip("this CPU runs every variant")
    monkeypatch.setenv(loader.ISA_ENV, lacking[0])
    with pytest.raises(ValueError, match="this CPU lacks") as e:
        loader.selected_isa()
    assert all(f in str(e.value) for f in loader.missing_features(lacking[0]))


def test_cache_folder_is_per_isa_and_cpu() -> None:
    assert loader.build_dir("avx2") != loader.build_dir("generic")
    assert os.path.basename(loader.build_dir("avx2")).startswith("avx2-")


@pytest.mark.parametrize("isa", loader.ISA_NAMES)
def test_every_supported_variant_builds_and_matches_pytorch(isa) -> None:
    missing = loader.missing_features(isa)
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (needed by the {isa} variant)")
    env = {**os.environ, loader.ISA_ENV: isa}
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"ISA {isa}" in res.stdout


def test_a_stale_build_lock_left_by_a_killed_build_does_not_hang() -> None:
    """torch's build baton is a plain file: a build killed mid-way used to leave it and make every
    later process wait forever. The loader's OS lock proves nobody is building and removes it. (This
    variant's folder, already built by the other tests: the load finds the library up to date.)"""
    isa = loader.detect_isa()
    build = loader.build_dir(isa)
    os.makedirs(build, exist_ok=True)
    open(os.path.join(build, "lock"), "w").close()  # what a killed build leaves
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not os.path.exists(os.path.join(build, "lock"))


def test_the_build_command_refuses_an_unknown_flag() -> None:
    with pytest.raises(SystemExit, match="--every-variant"):
        loader.main(["--every-variants"])


def test_a_variant_the_compiler_cannot_build_falls_back_to_the_next(monkeypatch, tmp_path) -> None:
    """The amx variant needs GCC >= 11: where the best variant for the flags fails to build, the next one the CPU
    runs is built instead (a forced one is that one or nothing)."""
    runs = [n for n in loader.ISA_NAMES if not loader.missing_features(n)]
    if len(runs) < 2:
        pytest.skip("this CPU runs one variant only")
    tried: list[str] = []

    def fake_load(cpp_extension, isa, flags, folder) -> None:
        tried.append(isa)
        if isa == runs[0]:
            raise RuntimeError(f"c++: error: unrecognized command-line option for {isa}")

    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(loader.ISA_ENV, raising=False)
    monkeypatch.setattr(loader, "_load", fake_load)
    ops, reason, isa = loader._build_variant()
    assert (isa, reason, tried) == (runs[1], "", runs[:2])
    tried.clear()
    monkeypatch.setenv(loader.ISA_ENV, runs[0])
    ops, reason, isa = loader._build_variant()
    assert ops is None and "unrecognized" in reason and tried == [runs[0]]


def test_a_failed_variant_is_not_rebuilt_at_every_start(monkeypatch, tmp_path) -> None:
    """A variant this compiler could not build is remembered in its build folder: the next start goes straight to
    the next variant; another compiler, or forcing the variant, tries it again (and a success forgets it)."""
    runs = [n for n in loader.ISA_NAMES if not loader.missing_features(n)]
    if len(runs) < 2:
        pytest.skip("this CPU runs one variant only")
    tried: list[str] = []
    broken = {runs[0]}

    def fake_load(cpp_extension, isa, flags, folder) -> None:
        tried.append(isa)
        if isa in broken:
            raise RuntimeError(f"c++: error: unrecognized command-line option for {isa}")

    monkeypatch.setenv("RADIXSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(loader.ISA_ENV, raising=False)
    monkeypatch.setattr(loader, "_load", fake_load)
    monkeypatch.setattr(loader, "_compiler_id", lambda: "g++ (Debian 10.2.1) 10.2.1")
    assert loader._build_variant()[2] == runs[1] and tried == runs[:2]
    tried.clear()
    _, reason, isa = loader._build_variant()
    assert (isa, reason, tried) == (runs[1], "", [runs[1]])
    monkeypatch.setattr(loader, "_compiler_id", lambda: "g++ (Debian 12.2.0) 12.2.0")  # a new compiler
    tried.clear()
    broken.clear()
    assert loader._build_variant()[2] == runs[0] and tried == [runs[0]]
    # back to the compiler that failed: still remembered; forced, it builds, and the mark is gone for later starts
    monkeypatch.setattr(loader, "_compiler_id", lambda: "g++ (Debian 10.2.1) 10.2.1")
    tried.clear()
    assert loader._build_variant()[2] == runs[1] and tried == [runs[1]]
    monkeypatch.setenv(loader.ISA_ENV, runs[0])
    assert loader._build_variant()[2] == runs[0]
    monkeypatch.delenv(loader.ISA_ENV)
    tried.clear()
    assert loader._build_variant()[2] == runs[0] and tried == [runs[0]]


def test_a_failure_mark_that_cannot_be_read_or_written_is_harmless(monkeypatch, tmp_path) -> None:
    """A cache where the mark cannot be written just tries again next start; a mark with no newline (truncated)
    names no compiler, and one that is not text is ignored too."""
    folder = tmp_path / "v"
    folder.mkdir()
    (folder / loader._FAILED).write_text("truncated")
    assert loader._failed_before(str(folder), "g++ 12") is None
    assert loader._failed_before(str(tmp_path / "absent"), "g++ 12") is None
    (folder / loader._FAILED).write_bytes(b"\xff\xfe g++ 12\n\x80 not text")  # garbage: ignored, not a crash
    assert loader._failed_before(str(folder), "g++ 12") is None
    blocked = tmp_path / "a-file"  # a folder that cannot be made (as root, a read-only mode would not stop it)
    blocked.write_text("x")
    loader._remember_failure(str(blocked / "amx-0"), "g++ 12", "boom")
    assert blocked.read_text() == "x"
