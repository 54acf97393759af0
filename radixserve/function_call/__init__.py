"""Tool calling: the model's own tool-call format, parsed out of its output (also while it streams),
and enforced with a grammar when the client requires a call.

    tool_parser.py     ToolCallParser + registry (hermes / llama3 / mistral): text -> content + calls
    tool_prompt.py     tools and tool messages -> the chat template (or the generic rendering)
"""
