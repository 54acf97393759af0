"""Real OpenAI-compatible clients, unchanged, against a live radixserve: langchain-openai's ChatOpenAI
(invoke, stream, with_structured_output, bind_tools) and litellm (completion, streaming)."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.entrypoints.conftest import API_KEY

# litellm fetches a model price list from the internet at import unless told to use its bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def chat(structured_server):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="smol", base_url=structured_server.base_url + "/v1", api_key=API_KEY, temperature=0,
                      max_tokens=48, max_retries=0, timeout=300)


def test_langchain_invoke_stream_structured_and_tools(chat) -> None:
    msg = chat.invoke("Say hello in one short sentence.")
    assert isinstance(msg.content, str) and msg.content
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    pieces = [c.content for c in chat.stream("Count to five.")]
    assert len(pieces) > 2 and "".join(pieces)
    city = chat.with_structured_output(City).invoke("Name a famous city.")  # response_format json_schema
    assert isinstance(city, City) and city.name
    out = chat.bind_tools([add], tool_choice="add").invoke("What is 2 plus 3?")
    assert out.tool_calls and out.tool_calls[0]["name"] == "add"
    assert set(out.tool_calls[0]["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in out.tool_calls[0]["args"].values())


def test_litellm_completion_and_stream(structured_server) -> None:
    import litellm

    kw = dict(model="openai/smol", api_base=structured_server.base_url + "/v1", api_key=API_KEY, max_tokens=24,
              temperature=0, messages=[{"role": "user", "content": "Name three colors."}])
    r = litellm.completion(**kw)
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw))
    assert text == r.choices[0].message.content  # greedy: the same answer streamed
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
              "required": ["color"]}
    r = litellm.completion(**{**kw, "max_tokens": 40}, response_format={
        "type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
