"""RunnerDriver: drive a real ModelRunner step by step, doing by hand what the scheduler does.

It takes request rows and KV slots through RequestSlots (the scheduler's own allocation helper),
builds a `ModelWorkerBatch` and calls `forward_batch_generation`, so every
timed step goes through `ForwardBatch.init_new`, the attention backend's metadata, the model and
the sampler — the whole execution layer, and nothing of the scheduler.

Decode contexts are real: one prompt is prefilled once per context length (real K/V), then its
K/V are copied into fresh slots for every request of the batch, so each request attends over a
real history that lives in its own memory (as many bytes to read as distinct requests would
have; sharing the slots instead would let the caches hide part of the KV traffic).

    row 0 (template):  positions 0..C-1 -> slots s_0..s_{C-1}   (prefilled)
    row r (copy):      positions 0..C-1 -> slots t_0..t_{C-1}   (k_buf[t] = k_buf[s], per layer)
"""

from __future__ import annotations

import random

import torch

from radixserve.mem_cache.request_slots import RequestSlots
from radixserve.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_executor.results import GenerationBatchResult
from radixserve.sampling.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class RunnerDriver:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.request_slots = RequestSlots(runner.req_to_token_pool, runner.token_to_kv_pool_allocator)
        self.rows: dict[int, int] = {}  # row -> tokens whose KV is written
        self.swa_freed: dict[int, int] = {}  # row -> positions below it gave up their local KV (_trim)
        self.rng = random.Random(seed)
        # Random token ids avoid the lowest ids, where tokenizers keep their special tokens.
        self.vocab_lo = min(100, runner.model_config.vocab_size // 2)

    # ------------------------------------------------------------------ pools
    def random_ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_lo, self.runner.model_config.vocab_size) for _ in range(n)]

    def new_row(self) -> int:
        row = self.request_slots.take_row()
        if row is None:
            raise RuntimeError("no free request row: raise max_running_requests")
        self.rows[row] = 0
        return row

    def slots(self, row: int) -> torch.Tensor:
        return self.runner.req_to_token_pool.req_to_token[row, : self.rows[row]]

    def truncate(self, row: int, length: int) -> None:
        """Free the row's KV past `length` (undo decode steps, keep the context)."""
        if length < self.rows[row]:
            self.request_slots.truncate(row, length, self.rows[row])
            self.rows[row] = length

    def release(self, row: int) -> None:
        self.swa_freed.pop(row, None)
        self.request_slots.free_row(row, 0, self.rows.pop(row))

    def _trim(self, row: int) -> None:
        """A hybrid sliding-window pool: free the row's local KV that its next queries (at positions >= its length)
        no longer see, as the scheduler does before each step (BasePrefixCache.release_outside_window)."""
        window = getattr(self.runner.token_to_kv_pool_allocator, "swa_window", None)
        lo, hi = self.swa_freed.get(row, 0), self.rows[row] - (window or 0)
        if window is not None and hi > lo:
            self.runner.token_to_kv_pool_allocator.free_swa(self.slots(row)[lo:hi])
            self.swa_freed[row] = hi

    def release_all(self) -> None:
        for row in list(self.rows):
            self.release(row)

    def _alloc(self, rows: list[int], prefix_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        for row in rows:
            self._trim(row)
        locs = self.request_slots.alloc(rows, prefix_lens, seq_lens)
        if locs is None:
            raise RuntimeError(
                f"KV pool too small ({self.runner.token_to_kv_pool_allocator.available_size()} slots free, "
                f"{sum(seq_lens) - sum(prefix_lens)} needed): raise --max-total-tokens")
        for row, s in zip(rows, seq_lens):
            self.rows[row] = s
        return locs

    # ------------------------------------------------------------------ steps
    def step(self, items: list[tuple[int, list[int]]], mode: ForwardMode,
             lora_uids: list[int] | None = None) -> GenerationBatchResult:
        """One forward: items are (row, new token ids); each row's prefix is what it already holds.
        lora_uids: each row's LoRA adapter (its uid in the runner's LoRAManager, 0 = the base model)."""
        prefix_lens = [self.rows[row] for row, _ in items]
        seq_lens = [p + len(new) for p, (_, new) in zip(prefix_lens, items)]
        locs = self._alloc([row for row, _ in items], prefix_lens, seq_lens)
        mwb = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=[t for _, new in items for t in new],
            req_pool_indices=[row for row, _ in items],
            seq_lens=seq_lens,
            prefix_lens=prefix_lens,
            out_cache_loc=locs,
            sampling_params=[GREEDY] * len(items),
            lora_uids=lora_uids,
        )
        return self.runner.forward_batch_generation(mwb)

    def prefill(self, row: int, ids: list[int]) -> GenerationBatchResult:
        return self.step([(row, ids)], ForwardMode.PREFILL)

    def decode(self, rows: list[int], ids: list[int]) -> GenerationBatchResult:
        return self.step(list(zip(rows, [[t] for t in ids])), ForwardMode.DECODE)

    def clone_context(self, src_row: int, num_rows: int) -> list[int]:
        """`num_rows` new rows holding a copy of src_row's history in their own KV slots."""
        length = self.rows[src_row]
        src = self.slots(src_row)
        pool = self.runner.token_to_kv_pool
        out = []
        for _ in range(num_rows):
            row = self.new_row()
            locs = self._alloc([row], [0], [length])
            for layer in range(pool.start_layer, pool.start_layer + pool.num_layers):
                k_buf, v_buf = pool.get_kv_buffer(layer)
                dst, from_ = pool.layer_slots(layer, locs), pool.layer_slots(layer, src)
                k_buf[dst] = k_buf[from_]
                v_buf[dst] = v_buf[from_]
            self._trim(row)
            out.append(row)
        return out

    def build_contexts(self, context_len: int, num_rows: int) -> list[int]:
        """`num_rows` rows of `context_len` real tokens of history (one prefill, then copies)."""
        template = self.new_row()
        self.prefill(template, self.random_ids(context_len))
        rows = [template] + self.clone_context(template, num_rows - 1) if num_rows > 1 else [template]
        return rows
