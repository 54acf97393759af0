"""POST /tokenize and POST /detokenize, on both server kinds (vLLM's and SGLang's shapes).

    /tokenize   {"prompt": "text" | ["a", "b"], "add_special_tokens": true, "return_token_strs": false}
                {"messages": [...], "add_generation_prompt": true}      (rendered by the chat template)
             -> {"tokens": [...], "count": N, "max_model_len": L, "token_strs": [...] | null}
    /detokenize {"tokens": [...] | [[...], ...], "skip_special_tokens": false} -> {"text": ..., "prompt": ...}

A prompt is tokenised exactly as the generation routes tokenise it (RequestNormalizer.tokenize: the
tokenizer's special tokens, a BOS never doubled), and `messages` are rendered by the same code as
/v1/chat/completions, so `count` is the prompt_tokens those routes would report. Nothing reaches the
scheduler: these are answered in the main process.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.embedding_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from radixserve.entrypoints.openai_serving import APIError, parse_body
from radixserve.entrypoints.serving_base import OpenAIServingBase
from radixserve.managers.io_struct import GenerateReqInput

# vLLM / SGLang fields of the chat form that this route does not implement: refused, never ignored
UNSUPPORTED_TOKENIZE = {
    "tools": "tools are not rendered by /tokenize", "chat_template": "a per-request chat template is not supported",
    "chat_template_kwargs": "chat_template_kwargs are not supported by /tokenize",
    "continue_final_message": "continue_final_message is not supported",
}


class TokenizeServing(OpenAIServingBase):
    def __init__(self, *args: Any, chat: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chat = chat  # OpenAIServingChat: its apply_template renders `messages`

    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = await parse_body(request, TokenizeRequest)
        self.check_model(req.model)
        self.check_unsupported(req, UNSUPPORTED_TOKENIZE)
        images = None
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages: the list is empty", "messages")
            if not req.add_generation_prompt:
                raise APIError(400, "add_generation_prompt: only true is supported (the chat route's rendering)",
                               "add_generation_prompt")
            texts, is_batch = [self.chat.apply_template(req.messages)], False
            images = self.chat.images(req.messages)
        else:
            is_batch = isinstance(req.prompt, list)
            texts = req.prompt if is_batch else [req.prompt]
            self._check_count(len(texts), "prompt")
        if images:  # a vision-language model: each image's run of tokens, read as the image token
            lists = [await self._with_images(texts[0], req.add_special_tokens, images)]
        else:
            lists = [self._tokenize(t, req.add_special_tokens) for t in texts]
        strs = [[self.token_text(t) for t in ids] for ids in lists] if req.return_token_strs else None
        resp = TokenizeResponse(
            tokens=lists if is_batch else lists[0], count=[len(x) for x in lists] if is_batch else len(lists[0]),
            max_model_len=self.tm.context_len, token_strs=None if strs is None else strs if is_batch else strs[0])
        return JSONResponse(resp.model_dump())

    async def _with_images(self, text: str, add_special_tokens: bool, images: list[str]) -> list[int]:
        """The rendered chat's ids with its images expanded as the chat route expands them: the images decoded off
        the loop, then the text expanded where the model's processor does it, tokenised, and its placeholders
        expanded."""
        norm = self.tm.normalizer
        try:
            prepared = await asyncio.to_thread(norm.prepare_images, GenerateReqInput(text=text, image_data=images))
            ids = self._tokenize(norm.mm_processor.expand_text(text, prepared[0]), add_special_tokens)
            expanded, mm = norm.mm_processor.process(ids, prepared[0])
        except ValueError as e:
            raise APIError.from_value_error(e, {"image_data": "messages"}) from None
        return mm.to_vocab(expanded, self.tm.vocab_size)

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = await parse_body(request, DetokenizeRequest)
        self.check_model(req.model)
        is_batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        lists: list[list[int]] = req.tokens if is_batch else [req.tokens]  # type: ignore[assignment]
        self._check_count(len(lists), "tokens")
        vocab = self.tm.vocab_size
        for ids in lists:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
        texts = [self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) for ids in lists]
        text: str | list[str] = texts if is_batch else texts[0]
        return JSONResponse(DetokenizeResponse(text=text, prompt=text).model_dump())

    def _check_count(self, n: int, field: str) -> None:
        """The generation routes' bound on prompts per call (--max-prompts-per-request)."""
        limit = self.tm.limits.max_prompts
        if n > limit:
            raise APIError(400, f"{field}: at most {limit} per call (--max-prompts-per-request), got {n}", field)

    def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tm.normalizer.tokenize(text, add_special_tokens)
        except ValueError as e:
            raise APIError.from_value_error(e) from None
