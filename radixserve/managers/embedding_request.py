"""What an embedding call is, on the main-process side: shared by POST /v1/embeddings and Engine.encode.

    input (str | [str] | [int] | [[int]])  -> GenerateReqInput(max_new_tokens 0)
        -> RequestNormalizer (the one set of rules: at most --max-prompts-per-request inputs, none empty,
           every id in the vocabulary, each within the context) -> the scheduler (managers/embedding_mode.py)
    the pooled, normalised vector -> `dimensions` (Matryoshka: the head, renormalised) -> floats | base64

The server kind is checked here too, once for both directions: a generation call to an embedding server
and an embedding call to a generation server are both a ValueError (a 400 on HTTP) that says which kind
of server this is.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from radixserve.managers.io_struct import GenerateReqInput

ENCODING_FORMATS = ("float", "base64")


def check_server_kind(is_embedding_server: bool, wants_embedding: bool) -> None:
    """Raise ValueError when the call does not fit the server (the message names the kind of both)."""
    if wants_embedding and not is_embedding_server:
        raise ValueError("this is a text-generation server: embeddings need a server started with "
                         "--is-embedding (/v1/embeddings, Engine.encode)")
    if is_embedding_server and not wants_embedding:
        raise ValueError("this is an embedding server (started with --is-embedding): it answers /v1/embeddings "
                         "(and Engine.encode), not text generation")


def embedding_input(value: Any, rid: str | None = None, timeout: float | None = None) -> GenerateReqInput:
    """An embedding call's input as the generation path's request: a prompt that generates nothing.

    str -> one text; [str] -> a batch of texts; [int] -> one token-id prompt; [[int]] -> a batch of them.
    Text gets the tokenizer's special tokens as a completion prompt does (a BOS where its settings ask)."""
    if isinstance(value, str):
        return _req(text=value, rid=rid, timeout=timeout)
    if not isinstance(value, list):
        # NOTE: a ValueError, not a TypeError: it is the project's "400 naming the field" on every entry point
        kind = type(value).__name__
        raise ValueError(f"input: must be a string, a list of strings or token ids, got {kind}")  # noqa: TRY004
    if not value:
        raise ValueError("input: the list of inputs is empty")
    if all(isinstance(x, str) for x in value):
        return _req(text=list(value), rid=rid, timeout=timeout)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return _req(input_ids=list(value), rid=rid, timeout=timeout)
    if all(isinstance(x, list) for x in value):
        return _req(input_ids=[list(x) for x in value], rid=rid, timeout=timeout)
    raise ValueError("input: a list must hold only strings, only token ids, or only lists of token ids")


def truncate(vec: list[float], dimensions: int | None) -> list[float]:
    """Matryoshka: the first `dimensions` components, renormalised (None = the whole vector). numpy, not torch:
    this runs in the HTTP process, which never imports torch (docs/architecture.md)."""
    if dimensions is None or dimensions == len(vec):
        return vec
    head = np.asarray(vec[:dimensions], dtype=np.float64)
    return (head / max(float(np.linalg.norm(head)), 1e-12)).tolist()  # torch's normalize: eps 1e-12


def _req(**kw: Any) -> GenerateReqInput:
    # NOTE: max_new_tokens 0: the PrefillAdder reserves nothing for tokens that will never be generated
    return GenerateReqInput(sampling_params={"max_new_tokens": 0}, **kw)


def check_options(dimensions: Any, encoding_format: Any, hidden_size: int) -> None:
    """`dimensions` in [1, hidden_size] (None = all) and a known encoding_format; raises ValueError naming them."""
    if dimensions is not None and (not isinstance(dimensions, int) or isinstance(dimensions, bool)
                                   or not 1 <= dimensions <= hidden_size):
        raise ValueError(f"dimensions: must be an integer in [1, {hidden_size}] (this model's embedding size), "
                         f"got {dimensions!r}")
    if encoding_format not in ENCODING_FORMATS:
        raise ValueError(f"encoding_format: must be one of {ENCODING_FORMATS}, got {encoding_format!r}")


def encode_vector(vec: list[float], dimensions: int | None, encoding_format: str) -> list[float] | str:
    """The vector as the client asked for it. base64 is OpenAI's: the float32 values, little-endian, in
    base64 (what the openai client decodes with numpy.frombuffer(..., dtype="float32"))."""
    vec = truncate(vec, dimensions)
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return vec
