"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> generation."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    TopLogprob,
)
from radixserve.entrypoints.openai_serving import (
    SSE_DONE,
    APIError,
    RequestGroup,
    SSEResponse,
    all_logprob_items,
    finish_reason,
    new_logprob_items,
    parse_body,
    sse,
    sse_error,
)
from radixserve.entrypoints.serving_base import UNSUPPORTED_CHAT, OpenAIServingBase
from radixserve.managers.io_struct import GenerateReqInput


class OpenAIServingChat(OpenAIServingBase):
    async def create(self, request: Request) -> Response:
        req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        self.check_model(req.model)
        self.check_unsupported(req, UNSUPPORTED_CHAT)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        top_k = self.check_top_logprobs(req.top_logprobs, "top_logprobs")
        prompt = self.apply_template(req.messages)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = req.rid or f"chatcmpl-{uuid.uuid4().hex}"
        # max_tokens absent: generate until EOS or the context is full (default_max_new_tokens -1).
        subs, _ = self.normalize(GenerateReqInput(
            text=prompt, sampling_params=self.sampling_dict(req, max_new), rid=rid,
            return_logprob=bool(req.logprobs), top_logprobs_num=top_k, timeout=req.timeout,
            default_max_new_tokens=-1, add_special_tokens=False,  # the template writes its own BOS
        ))
        n = req.n or 1
        group = RequestGroup(self.tm, subs, metrics=self.metrics)
        if req.stream:
            return SSEResponse(self._stream(request, req, rid, group, top_k, n), group)
        try:
            outs = await group.results(request)
        finally:
            group.cancel()
        choices = []
        for i, out in enumerate(outs):
            reason, matched = finish_reason(out["meta_info"])
            logprobs = None
            if req.logprobs:
                logprobs = ChatLogprobs(content=self._logprobs(all_logprob_items(out), top_k))
            message = ChatResponseMessage(content=out["text"])
            choices.append(ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched))
        resp = ChatCompletionResponse(id=rid, model=self.model_name, choices=choices,
                                      usage=self.usage(outs, n))
        return JSONResponse(resp.model_dump())

    def apply_template(self, messages: list[ChatMessage]) -> str:
        """OpenAI messages -> prompt text via the tokenizer's own chat template."""
        plain: list[dict[str, Any]] = []
        for k, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):  # content parts: only text is meaningful to a text model
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        why = f"messages.{k}.content: only text parts are supported"
                        raise APIError(400, why, "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            # "developer" is OpenAI's new name for "system"; templates only know the latter.
            plain.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        try:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001  # a template's own raise_exception(...) is a client error
            raise APIError(400, f"messages: the chat template rejected them: {e}", "messages") from None

    def _logprobs(self, items: list[tuple[float, int, list[tuple[int, float]]]], top_k: int) -> list[ChatTokenLogprob]:
        content = []
        for logprob, token_id, top in items:
            text = self.token_text(token_id)
            alts = [TopLogprob(token=self.token_text(t), logprob=v, bytes=list(self.token_text(t).encode()))
                    for t, v in top[:top_k]]
            content.append(ChatTokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()),
                                            top_logprobs=alts))
        return content

    async def _stream(self, request: Request, req: ChatCompletionRequest, rid: str, group: RequestGroup,
                      top_k: int, n: int) -> AsyncIterator[str]:
        created = int(time.time())
        num = len(group.subs)
        finals: list[dict[str, Any]] = [{} for _ in range(num)]

        def chunk(i: int, delta: dict[str, Any], logprobs: ChatLogprobs | None = None,
                  reason: str | None = None, matched: Any = None) -> str:
            choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=reason,
                                      matched_stop=matched)
            return sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice]))

        try:
            for i in range(num):  # OpenAI opens every choice with the role
                yield chunk(i, {"role": "assistant", "content": ""})
            async for i, out in group.events(request):
                logprobs = None
                if req.logprobs:
                    logprobs = ChatLogprobs(content=self._logprobs(new_logprob_items(out), top_k))
                if out["delta"] or (logprobs and logprobs.content):
                    yield chunk(i, {"content": out["delta"]}, logprobs)
                if out["finished"]:
                    finals[i] = out
                    reason, matched = finish_reason(out["meta_info"])
                    yield chunk(i, {}, None, reason, matched)
            if req.stream_options and req.stream_options.include_usage:
                usage = self.usage(finals, n)
                yield sse(ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[],
                                              usage=usage))
        except ConnectionAbortedError:
            return
        except Exception as e:  # noqa: BLE001  # the 200 headers are out: report in-band, then end the stream
            yield sse_error(e)
        finally:
            group.cancel()
        yield SSE_DONE
