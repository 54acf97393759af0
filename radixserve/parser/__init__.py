"""Output parsers that split a model's text by meaning: the reasoning (`<think> ... </think>`) from
the answer (reasoning_parser.py), and the scheduler-side gate that knows where the thinking ends
(thinking_gate.py: the thinking budget and grammars that start after the thinking)."""
