"""Scheduler: decides who runs each step; the ModelRunner decides how.

One step (`step()`), the same whether driven by the ZMQ loop (scheduler_process.py) or a test:

    reap aborted -> pick next batch -------------------------------> run -> process results
                    prefill first: chunked req, then waiting reqs           append tokens, check stop,
                    under PrefillAdder budgets (optionally MIXED            cache finished / unfinished,
                    with the running decodes); else DECODE the               emit ReqOutputs
                    running batch, retracting if KV runs out
"""

from __future__ import annotations

import logging
import time

from radixserve.constrained.grammar_queue import GrammarQueue
from radixserve.debug.fault_inject import fault_marker_from_env, raise_injected_fault
from radixserve.debug.invariants import InvariantChecker
from radixserve.debug.step_log import MAX_STEPS_PER_SNAPSHOT, StepLog
from radixserve.debug.trace import BatchTracer
from radixserve.exceptions import OutOfKVSlots
from radixserve.layers.moe.expert_load import model_expert_load
from radixserve.lora.lora_config import LoRANotFound
from radixserve.lora.lora_scheduling import LoRAScheduling
from radixserve.managers.embedding_mode import EmbeddingMode
from radixserve.managers.failure_isolation import FailureIsolation, is_fatal
from radixserve.managers.io_struct import ReqOutput, TokenizedGenerateReqInput
from radixserve.managers.output_processor import OutputProcessor
from radixserve.managers.queue_state import QueueState
from radixserve.managers.req import FinishReason, Req
from radixserve.managers.request_normalizer import RequestLimits, check_tokenized
from radixserve.managers.schedule_batch import ScheduleBatch
from radixserve.managers.schedule_policy import PrefillAdder, SchedulePolicy
from radixserve.managers.server_info import server_info
from radixserve.mem_cache.hiradix_cache import make_tree_cache
from radixserve.mem_cache.multimodal_cache import encoder_cache_info
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import LazyTokenizer
from radixserve.parser.thinking_gate import gate_for
from radixserve.server_args import ServerArgs
from radixserve.speculative.spec_worker import SpecWorker

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None, rank: int = 0) -> None:
        self.server_args = server_args
        self.rank = rank  # in the replica: tensor x pipeline parallel ranks all run this same scheduler
        self.model_runner = model_runner or ModelRunner(server_args, rank)
        runner = self.model_runner
        self.model_config = runner.model_config
        self.tokenizer = LazyTokenizer(runner.model_path, server_args.tokenizer_path, server_args.chat_template)
        self.req_to_token_pool = runner.req_to_token_pool
        self.allocator = runner.token_to_kv_pool_allocator
        self.tree_cache = make_tree_cache(runner)  # radix, chunk (no sharing) or radix over a disk tier
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, server_args.disable_radix_cache)
        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.new_token_ratio = server_args.init_new_token_ratio
        self.chunk_size = server_args.effective_chunk_size
        self.output_processor = OutputProcessor(self.tokenizer, self.model_config, server_args.stream_interval)
        self.tracer = BatchTracer(server_args.trace_batches) if server_args.trace_batches and rank == 0 else None
        self.checker = (InvariantChecker(self.allocator, self.tree_cache, self.req_to_token_pool, runner.parallel_state)
                        if server_args.check_invariants else None)
        self.step_log = StepLog()  # the last steps' records (the web dashboard's pipeline view)
        self.expert_load = model_expert_load(runner.model)  # MoE: tokens per expert (None for a dense model)
        self.wait_reason: str | None = None  # why the waiting requests were not admitted (PrefillAdder)
        self.forward_ct = 0
        self.step_time_s = 0.0  # wall time inside step(), cumulative (see get_server_info's time_split)
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "num_retractions": 0,
                      "num_failed_reqs": 0, "num_timed_out_reqs": 0}
        self.limits = RequestLimits.build(server_args, self.model_config.context_len, self.model_config.vocab_size,
                                          self.allocator.total_size)
        self.fault_marker = fault_marker_from_env()  # debug/fault_inject.py: a test hook
        self.isolation = FailureIsolation(self.tree_cache, self.output_processor, self.stats)  # a fault fails one request
        # tensor / pipeline parallel: rank 0's clock, broadcast each loop iteration, so that every rank times
        # requests out at the same step (None = this process's own clock)
        self.clock_override: float | None = None
        self.spec_worker = SpecWorker.create(server_args, runner)
        self.replay_retracted = runner.low_bit_only() and not runner.deterministic and self.spec_worker is None  # Req
        # constrained requests wait here while their grammar compiles (the backend is built on first use)
        self.grammar_queue = GrammarQueue(server_args, self.tokenizer, self.model_config, runner.parallel_state)
        self.embedding = EmbeddingMode.create(server_args, runner)  # --is-embedding: pooled vectors, no tokens
        self.lora = LoRAScheduling(runner.lora_manager, server_args.max_loras_per_batch)  # lora/lora_scheduling.py

    @property
    def failed_forward_streak(self) -> int:
        return self.isolation.streak

    def now(self) -> float:
        return self.clock_override if self.clock_override is not None else time.perf_counter()

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.req_to_token_pool, self.allocator, self.tree_cache)

    # ------------------------------------------------------------------ input
    def add_request(self, recv: TokenizedGenerateReqInput) -> ReqOutput | None:
        """Queue a request; a rejected one returns its error output right away (nothing is allocated for it)."""
        try:
            # the TokenizerManager's rules (a ValueError naming the field), again for callers that bypass it
            check_tokenized(recv, self.limits)
            lora_name, lora_uid = self.lora.resolve(recv.lora_path)
        except (ValueError, LoRANotFound) as e:  # an unknown adapter is a 404
            return ReqOutput.rejected(recv.rid, str(e), 404 if isinstance(e, LoRANotFound) else 400)
        req = Req.from_input(recv, tuple(self.model_config.eos_token_ids),
                             None if recv.timeout is None else self.now() + recv.timeout,
                             self.embedding is None or self.embedding.reuse_prefix, lora_name, lora_uid,
                             self.model_config.vocab_size)
        self.stats["prompt_tokens"] += len(req.origin_input_ids)
        # reasoning: the thinking gate takes the grammar slot (its own grammar joins it once compiled)
        req.thinking = req.grammar = gate_for(req.sampling_params, self.tokenizer, self.model_config.vocab_size)
        spec = req.sampling_params.constraint()
        if spec is not None:
            self.grammar_queue.add(req, spec, self.now())
        else:
            self.waiting_queue.append(req)
        return None

    def _drop_queued(self, req: Req, reason: FinishReason) -> None:
        """A queued request (waiting, or compiling its grammar; a retracted one gave its KV back) leaves."""
        if req in self.grammar_queue.reqs:
            self.grammar_queue.remove(req)
        else:
            self.waiting_queue.remove(req)
        req.finished_reason = reason
        self.output_processor.pending.append(req)

    def abort_request(self, rid: str) -> None:
        for req in self.grammar_queue.reqs + self.waiting_queue:
            if req.rid == rid:
                self._drop_queued(req, FinishReason("abort", message="aborted"))
                return
        for req in self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                req.to_abort = FinishReason("abort", message="aborted")

    def _expire(self) -> None:
        """Requests past their deadline: aborted with a 408, their KV returned like any abort."""
        now = self.now()
        queued = [r for r in self.grammar_queue.reqs + self.waiting_queue if r.past_deadline(now)]
        for req in queued + [r for r in self.running_batch.reqs + [self.chunked_req] if r and r.past_deadline(now)]:
            self.stats["num_timed_out_reqs"] += 1
            req.time_out()
            if req in queued:
                self._drop_queued(req, req.to_abort)

    def _reap_aborted(self) -> None:
        self._expire()
        if self.chunked_req is not None and self.chunked_req.to_abort:
            self._finish(self.chunked_req, self.chunked_req.to_abort)
            self.chunked_req = None
        for req in self.running_batch.reqs:
            if req.to_abort and not req.finished():
                self._finish(req, req.to_abort)
        self.running_batch.filter_batch()

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_len)
        self.output_processor.pending.append(req)

    # ------------------------------------------------------------------ step
    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req or self.grammar_queue.reqs)

    def only_compiling(self) -> bool:
        """True when the only work is grammars compiling: the loop may wait a little for messages."""
        return bool(self.grammar_queue.reqs) and not (self.waiting_queue or self.running_batch.reqs
                                                       or self.chunked_req)

    def _admit_compiled(self) -> None:
        ready, failed = self.grammar_queue.pop_ready(self.now())
        self.waiting_queue.extend(ready)
        self.output_processor.pending.extend(failed)

    def step(self) -> list[ReqOutput]:
        """Run one scheduling step (if there is work) and return the outputs it produced."""
        t0 = time.perf_counter()
        self._reap_aborted()
        self._admit_compiled()
        batch = self.get_next_batch_to_run()
        if batch is not None:
            self.step_log.schedule_s = time.perf_counter() - t0
            self.isolation.run(batch, self.run_batch, self.process_batch_result)
            if self.chunked_req is not None and self.chunked_req.finished():  # a failure was pinned on it
                self.chunked_req = None
            self.running_batch.filter_batch()
        if self.spec_worker is not None:  # what a draft model holds for requests that left goes with them
            self.spec_worker.release_stale(self.running_batch.reqs)
        if self.checker is not None:
            live = self.running_batch.reqs + ([self.chunked_req] if self.chunked_req is not None else [])
            self.checker.check_memory(live, self.spec_worker)
        self.lora.release_finished(self.output_processor.pending)  # every way a request ends passes here
        outputs = self.output_processor.flush()
        self.step_time_s += time.perf_counter() - t0
        return outputs

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        batch = self.get_new_batch_prefill()
        if batch is not None:
            if self.server_args.enable_mixed_chunk and self.running_batch.reqs and self._ensure_decode_slots():
                batch.mix_with_running(self.running_batch)
                self.running_batch = self._new_batch([])
            return batch
        if not self.running_batch.reqs or not self._ensure_decode_slots():
            return None
        if self.spec_worker is None or not self.spec_worker.prepare_verify(self.running_batch, self.allocator, self.tree_cache):
            self.running_batch.prepare_for_decode()
        return self.running_batch

    def _ensure_decode_slots(self) -> bool:
        """Make room for one token per running request: evict, then retract if still short."""
        batch = self.running_batch
        batch.release_outside_window()  # a hybrid pool's local KV no next query sees: room before the count
        need = batch.decode_slots_needed()
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        if self.allocator.available_size() < need:
            retracted = batch.retract_decode(need, self.replay_retracted)
            self.stats["num_retractions"] += len(retracted)
            # Budgets were too optimistic: reserve more for the requests that stay.
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1 * len(retracted))
            self.waiting_queue[:0] = retracted
            need = batch.decode_slots_needed()
        return bool(batch.reqs) and self.allocator.available_size() >= need

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        self.wait_reason = None
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs
        if len(running) >= self.server_args.max_running_requests and self.chunked_req is None:
            self.wait_reason = "max_running_requests"
            return None
        self.policy.calc_priority(self.waiting_queue)
        args = self.server_args
        adder = PrefillAdder(self.tree_cache, self.allocator.full_available_size(), running, self.new_token_ratio,
                             args.max_prefill_tokens, self.chunk_size, args.max_running_requests,
                             self.allocator.page_size, self.model_runner.image_spans_bidirectional)
        held_back = False
        if self.chunked_req is not None:
            still = adder.add_chunked_req(self.chunked_req)
            self.chunked_req.is_chunked = still is not None
            self.chunked_req = still
            if still is not None:  # the queue waits for the chunked request's next chunk
                adder.stop_reason = "chunked_prefill"
        if self.chunked_req is None:
            for req in self.waiting_queue:
                if self.policy.wait_for_in_batch_prefix(req, adder.can_run):
                    held_back = True
                    continue
                if not self.lora.allows(req, running, adder.can_run):
                    held_back = True  # its adapter would exceed --max-loras-per-batch: it waits, others run
                    continue
                if not adder.add_one_req(req):
                    break
            self.chunked_req = adder.new_chunked_req
        self.wait_reason = adder.stop_reason or ("in_batch_prefix" if held_back else None)
        for req in self.lora.take_failed():  # its adapter's files no longer load: a 500, the queue goes on
            self._drop_queued(req, FinishReason("abort", message="LoRA adapter unreadable"))
        self.lora.unpin_waiting(self.waiting_queue, adder.can_run)  # only admitted requests hold a pin
        if not adder.can_run:
            return None
        admitted = {id(r) for r in adder.can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for req in adder.can_run:
            if req.kv_len == 0 and req.num_retractions == 0:
                req.cached_tokens = len(req.prefix_indices)
                self.stats["cached_tokens"] += req.cached_tokens
                self.tree_cache.on_prefix_hit(req.last_node)  # the disk tier's write-through counts reuses
        batch = self._new_batch(adder.can_run)
        try:
            batch.prepare_for_extend()
        except OutOfKVSlots:
            # Budgets are estimates; if the pool still says no, undo this admission (the pools
            # are unchanged) and let decode free space first.
            logger.warning("prefill admission exceeded the KV pool; retrying after decode")
            self.wait_reason = "kv_pool"
            self.chunked_req, requeue = adder.undo()
            self.waiting_queue[:0] = requeue
            return None
        return batch

    # ------------------------------------------------------------------ run
    def run_batch(self, batch: ScheduleBatch):
        raise_injected_fault(self.fault_marker, (r.rid for r in batch.reqs))
        mwb = batch.get_model_worker_batch()
        if self.checker is not None:
            self.checker.check_same_step_on_every_rank(mwb)
        forward = self.model_runner.forward_batch_generation if self.embedding is None else self.embedding.forward
        result = forward(mwb)
        if self.checker is not None:
            self.checker.check_forward_batch(result.forward_batch)
        rec = self.step_log.record(self.forward_ct, batch, result, self.queue_state(), self.model_runner.timers,
                                   self.expert_load)
        if self.tracer is not None:
            self.tracer.record(rec, result)
        self.forward_ct += 1
        return result

    def process_batch_result(self, batch: ScheduleBatch, result) -> None:
        if self.embedding is not None:
            return self.embedding.process_batch_result(batch, result, self.tree_cache, self.isolation, self._finish)
        sample = result.sample_output
        # the requests whose prompt (or a chunk of it) this step computed; MIXED also carries decodes
        prefilled = None
        if not batch.forward_mode.is_decode() and not batch.forward_mode.is_target_verify():
            running = set(map(id, self.running_batch.reqs))
            prefilled = {r for r in batch.reqs if id(r) not in running}
        next_ids = sample.next_token_ids.tolist()
        in_logprobs = result.logits_output.input_token_logprobs
        verify = batch.forward_mode.is_target_verify()
        for i, req in enumerate(batch.reqs):
            try:
                if verify:
                    aborted = req.finished()  # while this step ran: its slots went with it, nothing to append
                    reason = self.spec_worker.process_verify_one(batch, i, req, sample, next_ids, self.output_processor)
                    if not aborted:
                        self._finish_or_stream(req, reason)
                else:
                    self._process_one(batch, i, req, next_ids[i], sample, in_logprobs, prefilled)
            except Exception as e:  # one request's bad output must not stop the others
                if is_fatal(e):
                    raise
                if not req.finished():
                    self.isolation.fail(req, batch.seq_lens[i], e, "while processing its output")
        if batch.forward_mode.is_decode() or verify:
            sa = self.server_args
            self.new_token_ratio = max(sa.min_new_token_ratio, self.new_token_ratio - sa.new_token_ratio_decay)
        # New members of the running batch: a prefill's requests, or (a bisected MIXED step) decodes emptied into it
        running = set(map(id, self.running_batch.reqs))
        keep = [r for r in batch.reqs if not r.finished() and not r.is_chunked and id(r) not in running]
        self.running_batch.filter_batch()
        if keep:
            self.running_batch.merge_batch(self._new_batch(keep))

    def _process_one(self, batch: ScheduleBatch, i: int, req: Req, next_id: int, sample, in_logprobs,
                     prefilled) -> None:
        replayed = req.replaying  # this step rebuilt KV of a token the request already has: its sample is dropped
        req.kv_len = batch.seq_lens[i]
        if in_logprobs is not None and in_logprobs[i] is not None:
            req.input_token_logprobs.extend(in_logprobs[i])
        if req.finished():
            return  # aborted while this step ran
        if req.is_chunked:
            self.tree_cache.cache_unfinished_req(req)
            return
        if replayed:
            return
        if req.sampling_params.max_new_tokens == 0:
            # a prompt-only request: the distribution after its prompt is all it reads (token_ids_logprob)
            self.output_processor.add_token_ids_logprobs(req, sample, i)
            self._finish(req, FinishReason("length", matched=None))
            return
        if prefilled is not None and req in prefilled and not self.server_args.disable_radix_cache:
            # Its prompt enters the tree now, not when it finishes: requests sharing the prefix
            # that arrive (or were held back by SchedulePolicy.wait_for_in_batch_prefix) meanwhile reuse it.
            self.tree_cache.cache_unfinished_req(req)
        self._finish_or_stream(req, self.output_processor.append_token(req, next_id, sample, i))

    def _finish_or_stream(self, req: Req, reason: FinishReason | None) -> None:
        self._finish(req, reason) if reason is not None else self.output_processor.maybe_stream(req)

    # ------------------------------------------------------------------ control
    def flush_cache(self, storage: bool = False) -> bool:  # storage: the disk tier too
        if self.has_work():
            return False
        self.tree_cache.reset()
        if storage:
            self.tree_cache.reset_storage()
        self.req_to_token_pool.clear()
        self.allocator.clear()
        self.stats["prompt_tokens"] = self.stats["cached_tokens"] = 0
        return True

    def queue_state(self) -> QueueState:
        """The queues and the KV pool now, as plain values (what step records and get_server_info read)."""
        chunked, pool = self.chunked_req, self.allocator
        return QueueState(len(self.waiting_queue), len(self.running_batch.reqs), chunked.rid if chunked else None,
                          self.wait_reason, pool.total_size, pool.full_available_size(), self.tree_cache.total_size(),
                          self.new_token_ratio)

    def get_server_info(self) -> dict:
        runner = self.model_runner
        return server_info(
            self.queue_state(), self.stats, grammar=self.grammar_queue.info(), spec=SpecWorker.info(self.spec_worker),
            expert_load=self.expert_load, failed_forward_streak=self.failed_forward_streak,
            deterministic_inference=runner.deterministic, generation_tokens=self.output_processor.generated_tokens,
            context_len=self.model_config.context_len, step_time_s=self.step_time_s, forward_timers=runner.timers,
            cache_tiers={**self.tree_cache.info(), **encoder_cache_info(runner.model)},
            native_decode_steps=getattr(runner.cpu_graph_runner, "replays", 0))

    def get_steps(self, since: int, rid: str | None = None, limit: int = MAX_STEPS_PER_SNAPSHOT) -> dict:
        """The step log's records after step `since` (StepLog.snapshot), with the queue counts shown beside them."""
        retracted = sum(1 for r in self.waiting_queue if r.num_retractions)
        return self.step_log.snapshot(since, rid, limit, self.tree_cache.evictable_size(), retracted)
