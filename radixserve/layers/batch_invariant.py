"""Batch-invariant execution: the rules behind --enable-deterministic-inference.

A request must get bit-identical tokens and logprobs whether it runs alone, in a batch of 32, or in a
batch in another order, with its prompt computed as one PREFILL or as EXTEND chunks over a cached
prefix. That holds if every op computes each token row by a sequence of float operations that does
not depend on the other rows of the step. Measured on the 2-core AVX2 dev machine (torch 2.13 CPU;
each row computed alone vs at every position of batches of 1..70; the end-to-end check is
tests/model_executor/test_deterministic.py):

  op                                        batch-invariant as is?   in this mode
  MKL GEMM (F.linear: the plain-torch       no: rows in the M % 4     fixed tiles of ROW_TILE rows
    projections)                            remainder of a call with  (tiled_rows), identical at
                                            M < 12 differ             every position in the tile
  oneDNN packed GEMM (CPU float32 default,  yes for every M measured  the same tiles anyway: the
    LM head included)                       (1 .. 2048)               rule must not rest on one
                                                                      library version's blocking
  attention (SDPA for PREFILL / EXTEND,     no: a row's result        paged_attention_varlen for
    the paged kernel for short blocks)      depends on the block      every mode (per-row, keys in
                                            (flash tiling)            position order)
  RMSNorm, RoPE, SiLU-and-mul (C++ glue),   yes (per row)             unchanged
    torch.rms_norm, embedding
  log_softmax / exp over [bs, vocab],       yes (row-wise kernels,    unchanged
    topk, argmax, amax, cumsum              vocab 32001 .. 151936;
                                            exact ops)
  sum over the vocab ([bs, V].sum(-1),      no: with fewer outputs    the sampler draws row by
    top_p's mass)                           than threads ATen splits  row (each row a batch of
                                            one row across threads    one, Sampler.forward)

The mode is the runner's, chosen once at start-up, never module state: the projections read it from the
step's KernelMode (ForwardBatch.kernel_mode, layers/kernel_mode.py), so runners sharing one set of weights
(tests, benchmarks) never change each other's numerics; the runner's own Sampler is built with it
(Sampler(batch_invariant=...)); attention is the runner's choice of backend (BatchInvariantAttnBackend).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows per GEMM call in this mode, chosen with `radixserve bench one-batch` on the 2-core dev machine
# (SmolLM2-135M, context 256, interleaved runs on an otherwise idle machine; the exact mode in the
# same runs: prefill 512 in 0.97-1.07 s, decode step 31-56 ms at batch 1, 119-160 ms at batch 32):
#            prefill 512     decode batch 1   decode batch 32
#   T = 8      1.85 s           73 ms            210 ms
#   T = 16     1.56-1.71 s      82-91 ms         158-189 ms
#   T = 32     1.23-1.38 s      90-111 ms        117-141 ms
# 32 wins except at batch-1 decode, where a 32-row GEMM does 32x a GEMV's FLOPs (~10-20 ms more
# than 16 rows). MKL is row-invariant from M = 12 up and oneDNN at every M, so all are safe for both.
ROW_TILE = 32

def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """fn over x [n, in] -> [n, out], always called on exactly `tile` rows (ROW_TILE by default).

    The one tiling rule of every projection and the LM head: rows are cut into consecutive tiles,
    the last one zero-padded, and each tile is its own GEMM of a fixed shape, so the library picks
    the same kernel and blocking for a row whatever else the step holds. Tiles start 64-byte
    aligned (a contiguous input whose base is, since tile * in * 4 bytes is a multiple of 64), so
    the data's alignment is the same for every tile too.
    """
    t = ROW_TILE if tile is None else tile
    n = x.shape[0]
    if n == 0:
        return fn(x)
    n_tiles = -(-n // t)
    if n % t or not x.is_contiguous() or x.data_ptr() % 64:
        padded = x.new_zeros(n_tiles * t, *x.shape[1:])
        padded[:n] = x
        x = padded
    if n_tiles == 1:
        return fn(x)[:n]
    return torch.cat([fn(x[i * t : (i + 1) * t]) for i in range(n_tiles)])[:n]

