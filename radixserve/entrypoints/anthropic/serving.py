"""AnthropicServing: POST /v1/messages and /v1/messages/count_tokens, translated onto OpenAIServingChat.

    Messages request --translate.to_chat--> ChatCompletionRequest --chat.run--> ChatCompletionResponse
                                                                             or the chunks of its stream
    <--translate.to_message-- / <--stream.EventWriter--

The chat route checks, renders, runs and parses (tools, reasoning, grammars); nothing here reaches the
scheduler by another path. count_tokens renders the same prompt and counts it as the generation routes
tokenise it, so it equals the chat route's prompt_tokens (and /tokenize of that prompt).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.anthropic import translate
from radixserve.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicMessagesRequest,
)
from radixserve.entrypoints.anthropic.stream import AnthropicSSE, EventWriter, error_body, events
from radixserve.entrypoints.openai_serving import APIError, parse_body

if TYPE_CHECKING:
    from radixserve.entrypoints.serving_chat import OpenAIServingChat


def render_error(err: APIError) -> Response:
    """Every error on /v1/messages* in Anthropic's shape (openai_serving.register_error_shape)."""
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


class AnthropicServing:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, request: Request) -> Response:
        req: AnthropicMessagesRequest = await parse_body(request, AnthropicMessagesRequest)
        stream = bool(req.stream)
        chat_req = translate.to_chat(
            req, max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, stream=stream, stream_options={"include_usage": True} if stream else None,
            rid=f"msg_{uuid.uuid4().hex}")
        try:
            run = await self.chat.run(chat_req, request)
        except APIError as e:
            raise translate.renamed(e) from None
        if run.chunks is not None:
            assert run.group is not None
            writer = EventWriter(chat_req.rid or "", self.chat.model_name, len(run.group.subs[0].input_ids),
                                 req.stop_sequences, req.max_tokens)
            return AnthropicSSE(events(writer, run.chunks, run.group), run.group)
        assert run.response is not None
        message = translate.to_message(run.response, req.stop_sequences, req.max_tokens)
        return JSONResponse(message.model_dump())

    async def count_tokens(self, request: Request) -> Response:
        req: AnthropicCountTokensRequest = await parse_body(request, AnthropicCountTokensRequest)
        chat_req = translate.to_chat(req)
        chat = self.chat
        chat.check_model(chat_req.model)
        try:
            prompt, _, _ = chat.render(chat_req)  # what chat.run renders, its tools' schemas checked as there
            ids = chat.tm.normalizer.tokenize(prompt)
        except APIError as e:
            raise translate.renamed(e) from None
        except ValueError as e:  # the tokenizer's refusals
            raise translate.renamed(APIError.from_value_error(e)) from None
        return JSONResponse(AnthropicCountTokensResponse(input_tokens=len(ids)).model_dump())


def make_anthropic_serving(servings: dict[str, Any]) -> AnthropicServing:
    return AnthropicServing(servings["chat"])
