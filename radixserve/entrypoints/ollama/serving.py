"""POST /api/chat, /api/generate: Ollama's generation calls, translated onto /v1/chat/completions' pipeline
(OpenAIServingChat.run: the chat template, the tool and reasoning parsers, the grammars) and, for a `raw`
generate, onto /v1/completions' (OpenAIServingCompletion.run). Nothing here schedules anything itself.

    ChatRequest / GenerateRequest --(options.py, translate.py)--> ChatCompletionRequest | CompletionRequest
        --> ServingRun: the response object, or its chunk objects --> Ollama's JSON / NDJSON (stream.py)

Model names: the served names (and `default`), each with or without `:latest`; the answer echoes the name
the client sent. An absent or empty prompt / message list is Ollama's "load the model" call: `done` at once.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.ollama.options import OPTION_RENAMES, sampling_fields
from radixserve.entrypoints.ollama.protocol import (
    ChatRequest,
    ChatResponse,
    GenerateRequest,
    GenerateResponse,
    OutMessage,
)
from radixserve.entrypoints.ollama.stream import Calls, NDJSONResponse, Piece, ndjson_stream
from radixserve.entrypoints.ollama.translate import (
    Clock,
    chat_logprobs,
    completion_logprobs,
    created_at,
    done_reason,
    openai_messages,
    renamed,
    tool_calls,
    with_images,
)
from radixserve.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.openai_serving import APIError, parse_body
from radixserve.managers.embedding_request import check_server_kind
from radixserve.parser.reasoning_parser import resolve_reasoning_parser

LATEST = ":latest"
# fields named by pipeline errors -> the Ollama field, per route
_CHAT_RENAMES = {**OPTION_RENAMES, "prompt": "messages"}
_GENERATE_RENAMES = {**OPTION_RENAMES, "messages": "prompt"}


class OllamaServing:
    def __init__(self, servings: dict[str, Any]) -> None:
        self.chat_serving = servings["chat"]
        self.completions = servings["completions"]
        self.tm, self.args = self.chat_serving.tm, self.chat_serving.server_args

    # ------------------------------------------------------------------ names
    def resolve(self, model: str | None) -> str:
        """The served name `model` means (with or without `:latest`), or Ollama's 404."""
        if not model:
            raise APIError(400, "model is required", "model")
        base = model.removesuffix(LATEST)
        try:
            self.chat_serving.check_model(base)
        except APIError as e:
            if e.status == 404:
                raise APIError(404, f"model '{model}' not found", "model", "model_not_found") from None
            raise
        return base

    @property
    def thinks(self) -> bool:
        return resolve_reasoning_parser(self.args.reasoning_parser, self.tokenizer_template) is not None

    @property
    def tokenizer_template(self) -> str | None:
        return self.chat_serving.tokenizer.chat_template

    # ------------------------------------------------------------------ shared translation
    def _common(self, req: ChatRequest | GenerateRequest, stream: bool, chat: bool) -> dict[str, Any]:
        """The OpenAI fields every generation call shares: options, format, think, logprobs, streaming."""
        fields = sampling_fields(req.options, self.tm.limits.context_len)
        fmt = req.format
        if fmt == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(fmt, dict):
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
        elif fmt not in (None, ""):
            raise APIError(400, f'format: must be "json" or a JSON schema object, got {fmt!r}', "format")
        if isinstance(req.think, str):
            raise APIError(400, f"think: levels ({req.think!r}) are not supported; give true or false", "think")
        if req.think is not None and chat:
            if req.think and not self.thinks:
                raise APIError(400, "think: this server splits no thinking (start it with --reasoning-parser; "
                               "with auto, the chat template has no <think> convention)", "think")
            # the template's switch (Qwen3's, DeepSeek's, the reasoning server's): false closes the thinking
            fields["chat_template_kwargs"] = {"enable_thinking": bool(req.think)}
        if req.logprobs:
            fields["top_logprobs" if chat else "logprobs"] = req.top_logprobs or 0
            if chat:
                fields["logprobs"] = True
        elif req.top_logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", "top_logprobs")
        fields["stream"] = stream
        if stream:  # the final object's counts come from the usage chunk
            fields["stream_options"] = {"include_usage": True}
        return fields

    def _loaded(self, model: str, chat: bool) -> Response:
        """Ollama's answer to a call with nothing to generate: the model is loaded (it always is here)."""
        try:
            check_server_kind(self.args.is_embedding, False)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        head = {"model": model, "created_at": created_at(), "done": True, "done_reason": "load"}
        body = ChatResponse(**head, message=OutMessage()) if chat else GenerateResponse(**head)
        return JSONResponse(body.model_dump(exclude_none=True))

    async def _run(self, serving: Any, openai: dict[str, Any], kind: type[Any], request: Request,
                   renames: dict[str, str]) -> Any:
        try:
            return await serving.run(kind.model_validate(openai), request)
        except ValidationError as e:
            raise renamed(APIError.from_validation_error(e), renames) from None
        except APIError as e:
            raise renamed(e, renames) from None
        except ValueError as e:
            raise renamed(APIError.from_value_error(e), renames) from None

    # ------------------------------------------------------------------ /api/chat
    async def chat(self, request: Request) -> Response:
        clock = Clock()
        req: ChatRequest = await parse_body(request, ChatRequest)
        base = self.resolve(req.model)
        if not req.messages:
            return self._loaded(req.model, chat=True)
        stream = req.stream is not False
        openai = {"model": base, "messages": openai_messages(req.messages), **self._common(req, stream, True)}
        if req.tools:
            openai["tools"] = [{"type": "function", **t} for t in req.tools]  # Ollama's clients may omit type
        run = await self._run(self.chat_serving, openai, ChatCompletionRequest, request, _CHAT_RENAMES)
        name = req.model

        def frame(content: str, done: bool, thinking: str | None = None, tool_calls: Any = None,
                  logprobs: Any = None, **final: Any) -> ChatResponse:
            message = OutMessage(content=content, thinking=thinking, tool_calls=tool_calls)
            return ChatResponse(model=name, created_at=created_at(), message=message, done=done, logprobs=logprobs,
                                **final)

        if run.chunks is not None:
            lines = ndjson_stream(run.chunks, _read_chat_chunk, frame, clock, _CHAT_RENAMES, renamed)
            return NDJSONResponse(lines, run.group)
        choice, usage = run.response.choices[0], run.response.usage
        msg = choice.message
        body = frame(msg.content or "", True, msg.reasoning_content, tool_calls(msg.tool_calls),
                     chat_logprobs(choice.logprobs), done_reason=done_reason(choice.finish_reason),
                     **clock.timings(usage.prompt_tokens, usage.completion_tokens, run.outs[0]["meta_info"]))
        return JSONResponse(body.model_dump(exclude_none=True))

    # ------------------------------------------------------------------ /api/generate
    async def generate(self, request: Request) -> Response:
        clock = Clock()
        req: GenerateRequest = await parse_body(request, GenerateRequest)
        base = self.resolve(req.model)
        self._refuse_generate_fields(req)
        if not req.prompt:
            return self._loaded(req.model, chat=False)
        stream = req.stream is not False
        if req.raw:
            if req.system:
                raise APIError(400, "system: a raw prompt takes no system prompt (no template is applied)", "system")
            if req.think:
                raise APIError(400, "think: a raw prompt has no template to open or close the thinking", "think")
            if req.images:
                raise APIError(400, "images: a raw prompt has no template to place the images (drop raw)", "images")
            openai = {"model": base, "prompt": self._raw_ids(req.prompt, req.options), **self._common(req, stream, False)}
            openai.setdefault("max_tokens", None)
            if openai["max_tokens"] is None:  # Ollama's default: until EOS or the context is full
                openai["max_tokens"] = max(1, self.tm.limits.max_req_len - len(openai["prompt"]))
            serving, kind, read = self.completions, CompletionRequest, _completion_reader(req.top_logprobs or 0)
        else:
            messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
                {"role": "user", "content": with_images(req.prompt, req.images)}]
            openai = {"model": base, "messages": messages, **self._common(req, stream, True)}
            serving, kind, read = self.chat_serving, ChatCompletionRequest, _read_chat_chunk
        run = await self._run(serving, openai, kind, request, _GENERATE_RENAMES)
        name = req.model

        def frame(content: str, done: bool, thinking: str | None = None, tool_calls: Any = None,
                  logprobs: Any = None, **final: Any) -> GenerateResponse:
            return GenerateResponse(model=name, created_at=created_at(), response=content, thinking=thinking,
                                    done=done, logprobs=logprobs, **final)

        if run.chunks is not None:
            lines = ndjson_stream(run.chunks, read, frame, clock, _GENERATE_RENAMES, renamed)
            return NDJSONResponse(lines, run.group)
        choice, usage = run.response.choices[0], run.response.usage
        if req.raw:
            text, thinking, lps = choice.text, None, completion_logprobs(choice.logprobs, req.top_logprobs or 0)
        else:
            text, thinking, lps = choice.message.content or "", choice.message.reasoning_content, \
                chat_logprobs(choice.logprobs)
        body = frame(text, True, thinking, None, lps if req.logprobs else None,
                     done_reason=done_reason(choice.finish_reason),
                     **clock.timings(usage.prompt_tokens, usage.completion_tokens, run.outs[0]["meta_info"]))
        return JSONResponse(body.model_dump(exclude_none=True))

    @staticmethod
    def _refuse_generate_fields(req: GenerateRequest) -> None:
        if req.template:
            raise APIError(400, "template: a per-request template is not supported; the server's chat template "
                           "(--chat-template) is applied, or none with raw: true", "template")
        if req.suffix:
            raise APIError(400, "suffix: fill-in-the-middle is not supported", "suffix")
        if req.context:
            raise APIError(400, "context: the deprecated token context is not supported; send the conversation "
                           "to /api/chat", "context")

    def _raw_ids(self, prompt: str, options: dict[str, Any] | None) -> list[int]:
        """A raw prompt's tokens (as /v1/completions would read the text), so that an absent num_predict can
        be "until the context is full" rather than /v1/completions' default of 16."""
        try:
            return self.tm.normalizer.tokenize(prompt)
        except ValueError as e:
            raise renamed(APIError.from_value_error(e), _GENERATE_RENAMES) from None


def _read_chat_chunk(chunk: Any, calls: Calls) -> Piece:
    piece = Piece(usage=chunk.usage)
    for choice in chunk.choices:
        delta = choice.delta
        piece.content += delta.get("content") or ""
        piece.thinking += delta.get("reasoning_content") or ""
        calls.add(delta.get("tool_calls") or [])
        piece.logprobs += chat_logprobs(choice.logprobs) or []
        piece.finish_reason = choice.finish_reason or piece.finish_reason
    return piece


def _completion_reader(top_k: int) -> Any:
    def read(chunk: Any, calls: Calls) -> Piece:
        piece = Piece(usage=chunk.usage)
        for choice in chunk.choices:
            piece.content += choice.text
            piece.logprobs += completion_logprobs(choice.logprobs, top_k) or []
            piece.finish_reason = choice.finish_reason or piece.finish_reason
        return piece

    return read
