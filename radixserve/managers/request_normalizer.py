"""RequestNormalizer: the one place a generation call becomes validated scheduler requests.

    Engine.generate / POST /generate / /v1/completions / /v1/chat/completions
        -> GenerateReqInput (text | input_ids, sampling params, rid, logprob flags, timeout)
        -> RequestNormalizer.normalize() -> [TokenizedGenerateReqInput]  (prompts x n, in order)

Every rule about what one request may ask for is written here once (`check_tokenized`), with
messages that start with the offending field's name (the HTTP layer turns them into 400s that
name the field). The scheduler calls `check_tokenized` again on arrival, as a guard for callers
that bypass the TokenizerManager; it adds nothing of its own.

The rules that keep one request from hurting the others:
- every count a client controls is bounded (prompts per call, n, stop strings, logit_bias,
  top logprobs, rid length), so no request can make the server do unbounded work;
- prompt + max_new_tokens must fit `max_req_len`, the smaller of the context length and what the
  KV pool can hold for one request: a request that could never be admitted is a 400 now instead
  of a queue that waits forever. An explicit max_new_tokens over the limit is rejected (as
  OpenAI and vLLM do); an absent one is clamped to what is left.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from radixserve.multimodal.image_loader import MediaLimits, load_images
from radixserve.multimodal.mm_inputs import MultimodalInputs
from radixserve.parser.reasoning_args import check_thinking_budget
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

MAX_RID_LEN = 256
MAX_TOKEN_IDS_LOGPROB = 256  # ids per request in token_ids_logprob (a label set: "yes"/"no", A-D, ...)


@dataclass(frozen=True)
class RequestLimits:
    context_len: int
    vocab_size: int
    max_req_len: int  # prompt + generated tokens of one request
    max_prompts: int
    max_n: int
    max_top_logprobs: int
    max_stop_strings: int
    max_stop_string_len: int
    max_logit_bias: int
    default_timeout: float | None
    constraints_enabled: bool = True  # --grammar-backend != none

    @classmethod
    def build(cls, args: ServerArgs, context_len: int, vocab_size: int, max_total_num_tokens: int) -> RequestLimits:
        # Two pages of slack: a request's prefix and its tail may each sit in a partial page.
        pool_limit = max_total_num_tokens - 2 * args.page_size
        return cls(
            context_len=context_len,
            vocab_size=vocab_size,
            max_req_len=max(2, min(context_len, pool_limit)),
            max_prompts=args.max_prompts_per_request,
            max_n=args.max_n,
            max_top_logprobs=args.max_top_logprobs,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_len=args.max_stop_string_len,
            max_logit_bias=args.max_logit_bias,
            default_timeout=args.request_timeout,
            constraints_enabled=args.grammar_backend != "none",
        )

    def limit_name(self) -> str:
        if self.max_req_len < self.context_len:
            return f"what the KV pool can hold for one request ({self.max_req_len} tokens)"
        return f"the context length ({self.context_len} tokens)"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """Value checks of SamplingParams plus the server's bounds on what a client controls."""
    params.verify(limits.vocab_size)
    if params.n > limits.max_n:
        raise ValueError(f"n must be <= {limits.max_n}, got {params.n}")
    if len(params.stop) > limits.max_stop_strings:
        raise ValueError(f"stop: at most {limits.max_stop_strings} stop strings, got {len(params.stop)}")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > limits.max_stop_string_len:
        raise ValueError(f"stop: a stop string may have at most {limits.max_stop_string_len} characters, "
                         f"got {longest}")
    if len(params.stop_token_ids) > limits.max_stop_strings:
        raise ValueError(f"stop_token_ids: at most {limits.max_stop_strings} ids, got {len(params.stop_token_ids)}")
    if len(params.logit_bias) > limits.max_logit_bias:
        raise ValueError(f"logit_bias: at most {limits.max_logit_bias} entries, got {len(params.logit_bias)}")
    check_thinking_budget(params.thinking_budget, limits.context_len)  # parser/reasoning_args.py
    spec = params.constraint()
    if spec is not None and not limits.constraints_enabled:
        raise ValueError(f"{spec.kind}: constrained decoding is off on this server (--grammar-backend none)")


def check_tokenized(req: TokenizedGenerateReqInput, limits: RequestLimits) -> None:
    """Every rule on one scheduler request; raises ValueError naming the field."""
    if not isinstance(req.rid, str) or not 0 < len(req.rid) <= MAX_RID_LEN:
        raise ValueError(f"rid: must be a non-empty string of at most {MAX_RID_LEN} characters")
    check_params(req.sampling_params, limits)
    ids = req.input_ids
    if not ids:
        raise ValueError("prompt: the prompt is empty")
    if req.mm_inputs is None:
        bad = next((t for t in ids if not (_is_int(t) and 0 <= t < limits.vocab_size)), None)
        if bad is not None:
            raise ValueError(f"input_ids: token id {bad!r} is outside the vocabulary [0, {limits.vocab_size})")
    else:
        if not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError("input_ids: must be non-negative integers")
        req.mm_inputs.check(ids, limits.vocab_size)  # image spans hold their pad values, the rest is vocabulary
    if len(ids) >= limits.max_req_len:
        raise ValueError(
            f"prompt: {len(ids)} tokens is longer than {limits.limit_name()} allows, including at least "
            "one generated token"
        )
    max_new = req.sampling_params.max_new_tokens
    if len(ids) + max_new > limits.max_req_len:
        raise ValueError(
            f"max_new_tokens: the prompt's {len(ids)} tokens + max_new_tokens {max_new} exceed "
            f"{limits.limit_name()}; ask for at most {limits.max_req_len - len(ids)}"
        )
    if req.lora_path is not None and not (isinstance(req.lora_path, str) and 0 < len(req.lora_path) <= 256):
        raise ValueError("lora_path: must be the name of a loaded LoRA adapter (1-256 characters)")
    for name in ("return_logprob", "return_prompt_logprob", "stream"):
        if not isinstance(getattr(req, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(req, name)!r}")
    k = req.top_logprobs_num
    if not _is_int(k) or not 0 <= k <= limits.max_top_logprobs:
        raise ValueError(f"top_logprobs_num must be an int in [0, {limits.max_top_logprobs}], got {k!r}")
    check_token_ids_logprob(req.token_ids_logprob, limits)
    if not _is_int(req.priority) or abs(req.priority) > 2**31:
        raise ValueError(f"priority must be an int in [-2^31, 2^31], got {req.priority!r}")
    t = req.timeout
    if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {t!r}")


def check_token_ids_logprob(ids: Any, limits: RequestLimits) -> None:
    """None, or 1 to MAX_TOKEN_IDS_LOGPROB ids of the vocabulary (each predicting row gathers them all)."""
    if ids is None:
        return
    if not isinstance(ids, list) or not 0 < len(ids) <= MAX_TOKEN_IDS_LOGPROB:
        raise ValueError(f"token_ids_logprob: must be a list of 1 to {MAX_TOKEN_IDS_LOGPROB} token ids, got {ids!r:.80}")
    bad = next((t for t in ids if not (_is_int(t) and 0 <= t < limits.vocab_size)), None)
    if bad is not None:
        raise ValueError(f"token_ids_logprob: token id {bad!r} is outside the vocabulary [0, {limits.vocab_size})")


class RequestNormalizer:
    def __init__(self, tokenizer: Any, limits: RequestLimits, mm_processor: Any = None,
                 media_limits: MediaLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # a vision-language model's processor (multimodal/processors/); None: image inputs are refused
        self.mm_processor = mm_processor
        self.media_limits = media_limits or MediaLimits()

    # ------------------------------------------------------------------ prompts
    def tokenize(self, text: Any, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt: must be a string, got {type(text).__name__}")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if add_special_tokens and bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            # the BOS the tokenizer's settings add, and the one the text (a chat template) wrote: once
            ids = ids[1:]
        return ids

    def prompts(self, obj: GenerateReqInput, prepared: list[list[Any]] | None = None
                ) -> tuple[list[list[int]], bool]:
        """(token id lists, is_batch) from exactly one of text / input_ids. A text prompt with images (`prepared`)
        has its image placeholders expanded as text first, where the model's processor does (expand_text)."""
        if (obj.text is None) == (obj.input_ids is None):
            raise ValueError("prompt: give exactly one of text (prompt) or input_ids")
        if obj.text is not None:
            is_batch = isinstance(obj.text, list)
            texts = obj.text if is_batch else [obj.text]
            self._check_count(len(texts))
            if prepared is not None and self.mm_processor is not None:
                texts = [self.mm_processor.expand_text(t, prepared[k]) if isinstance(t, str) and k < len(prepared)
                         and prepared[k] else t for k, t in enumerate(texts)]
            return [self.tokenize(t, obj.add_special_tokens) for t in texts], is_batch
        ids = obj.input_ids
        if not isinstance(ids, list):
            raise ValueError("input_ids: must be a list of token ids or a list of such lists")
        is_batch = bool(ids) and isinstance(ids[0], list)
        lists = ids if is_batch else [ids]
        self._check_count(len(lists))
        for x in lists:
            if not isinstance(x, list) or not all(_is_int(t) for t in x):
                raise ValueError("input_ids: must be a list of integers (or a list of such lists)")
        return [list(x) for x in lists], is_batch

    def prepare_images(self, obj: GenerateReqInput) -> list[list[Any]] | None:
        """The call's images per prompt, decoded (with their bounds) and run through the model's image processor:
        the costly part, which touches no tokenizer and no server state (TokenizerManager runs it on a worker
        thread). None: the call has no images."""
        data = obj.image_data
        if data is None:
            return None
        if self.mm_processor is None:
            raise ValueError("image_data: this model takes no images (serve a vision-language model to send them)")
        if not isinstance(data, list):
            data = [data]
        ids = obj.input_ids
        is_batch = isinstance(obj.text, list) or (obj.text is None and isinstance(ids, list) and bool(ids)
                                                  and isinstance(ids[0], list))
        if not is_batch:
            data = [data]
        elif not all(isinstance(d, list) for d in data):
            raise ValueError("image_data: a batch of prompts takes one list of images per prompt")
        total, most = sum(len(d) for d in data), self.media_limits.max_images_per_request
        if total > most:  # the whole call, not each prompt: a batch must not multiply the bound
            raise ValueError(f"image_data: {total} images in one request; at most {most} are allowed "
                             "(--max-images-per-request)")
        return [[self.mm_processor.prepare(img) for img in load_images(d, self.media_limits)] if d else []
                for d in data]

    def images(self, obj: GenerateReqInput, prompts: list[list[int]], prepared: list[list[Any]] | None
               ) -> tuple[list[list[int]], list[MultimodalInputs | None]]:
        """Each prompt's ids with its image placeholders expanded, and its images (None: a text prompt)."""
        if prepared is None:
            return prompts, [None] * len(prompts)
        if len(prepared) != len(prompts):
            raise ValueError(f"image_data: {len(prepared)} image lists given for {len(prompts)} prompts")
        out = [self.mm_processor.process(ids, imgs) if imgs else (ids, None) for ids, imgs in zip(prompts, prepared)]
        return [ids for ids, _ in out], [mm for _, mm in out]

    def _check_count(self, n: int) -> None:
        if n == 0:
            raise ValueError("prompt: the batch is empty")
        if n > self.limits.max_prompts:
            raise ValueError(f"prompt: at most {self.limits.max_prompts} prompts per call, got {n}")

    # ------------------------------------------------------------------ params
    def _params(self, d: Any, prompt_len: int, default_max_new: int | None) -> SamplingParams:
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params: must be a dict, got {type(d).__name__}")
        params = SamplingParams.from_dict(d)
        if (d or {}).get("max_new_tokens") is None:
            # Unset: the default, clamped to what the context leaves (never a reason to reject).
            room = max(0, self.limits.max_req_len - prompt_len)
            wanted = params.max_new_tokens if default_max_new is None else default_max_new
            params.max_new_tokens = room if wanted < 0 else min(wanted, room)
            params.min_new_tokens = min(params.min_new_tokens, params.max_new_tokens) \
                if _is_int(params.min_new_tokens) else params.min_new_tokens
        check_params(params, self.limits)
        spec = params.constraint()
        if spec is not None:
            # Parsed here, where a bad one is still a 400; compiling waits for the scheduler's worker.
            spec.check()
        return params

    # ------------------------------------------------------------------ all of it
    def normalize(self, obj: GenerateReqInput, prepared: list[list[Any]] | None = None
                  ) -> tuple[list[TokenizedGenerateReqInput], bool]:
        """-> (sub-requests in prompt x n order, is_batch). Every sub-request is validated before
        any is returned, so a bad item rejects the whole call before anything is scheduled. `prepared`: the
        call's images from prepare_images (made here when the call has images and none are given)."""
        if prepared is None and obj.image_data is not None:
            prepared = self.prepare_images(obj)
        prompts, is_batch = self.prompts(obj, prepared)
        prompts, mms = self.images(obj, prompts, prepared)
        sp = obj.sampling_params
        if isinstance(sp, list):
            if len(sp) != len(prompts):
                raise ValueError(f"sampling_params: {len(sp)} given for {len(prompts)} prompts")
            dicts = sp
        else:
            dicts = [sp] * len(prompts)
        params = [self._params(d, len(ids), obj.default_max_new_tokens) for d, ids in zip(dicts, prompts)]
        rid = obj.rid if obj.rid is not None else uuid.uuid4().hex
        if not isinstance(rid, str) or not 0 < len(rid) <= MAX_RID_LEN - 8:
            raise ValueError(f"rid: must be a non-empty string of at most {MAX_RID_LEN - 8} characters")
        total = sum(p.n for p in params)
        timeout = obj.timeout if obj.timeout is not None else self.limits.default_timeout
        if _is_number(obj.timeout) and self.limits.default_timeout is not None:
            timeout = min(obj.timeout, self.limits.default_timeout)  # a request may only shorten it
        subs: list[TokenizedGenerateReqInput] = []
        for ids, p, mm in zip(prompts, params, mms):
            for j in range(p.n):
                # n > 1: independent samples; seed + j keeps seeded runs reproducible.
                q = SamplingParams.from_dict({**p.to_dict(), "n": 1, "seed": None if p.seed is None else p.seed + j})
                sub = TokenizedGenerateReqInput(
                    rid=rid if total == 1 else f"{rid}-{len(subs)}",
                    input_ids=ids,
                    sampling_params=q,
                    return_logprob=obj.return_logprob,
                    top_logprobs_num=obj.top_logprobs_num,
                    return_prompt_logprob=obj.return_prompt_logprob,
                    stream=obj.stream,
                    priority=obj.priority,
                    timeout=timeout,
                    parent_rid=None if total == 1 else rid,
                    lora_path=obj.lora_path,
                    token_ids_logprob=obj.token_ids_logprob,
                    mm_inputs=mm,
                )
                if j == 0:  # the samples of one prompt differ only in their seed
                    check_tokenized(sub, self.limits)
                subs.append(sub)
        return subs, is_batch or total > 1


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
