"""Tool calling: the model's own tool-call format, parsed out of its output (also while it streams),
and enforced with a grammar when the client requires a call.

    registry.py        every format by name (hermes, llama3, mistral, qwen3_coder, pythonic, gemma3) and `auto`
    *_detector.py      one format each: text (whole or streamed) -> content + calls, its structural tag
    tool_parser.py     the public names serving_chat.py and the tests import
    tool_prompt.py     tools and tool messages -> the chat template (or the generic rendering)
"""
