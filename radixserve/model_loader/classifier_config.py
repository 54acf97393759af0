"""Sequence classifiers (transformers' *ForSequenceClassification): the same decoder as a language model, with a
`score` head on the last token in place of the LM head (rerank and score: entrypoints/rerank/)."""

from __future__ import annotations

# the language models whose classifier twin is served: the dense families whose checkpoints ship one
# (Qwen3-Reranker-seq-cls, Llama / Mistral cross-encoders)
CLASSIFIER_BASES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MAX_NUM_LABELS = 1024


def classifier_fields(architecture: str, cfg: dict) -> tuple[str, int]:
    """(the architecture whose arithmetic the model has, its classifier labels or 0 for a language model)."""
    if not architecture.endswith("ForSequenceClassification"):
        return architecture, 0
    base = architecture.removesuffix("ForSequenceClassification") + "ForCausalLM"
    if base not in CLASSIFIER_BASES:
        raise ValueError(f"unknown model architecture {architecture!r}: sequence classifiers are served for "
                         f"{', '.join(b.removesuffix('ForCausalLM') for b in CLASSIFIER_BASES)}")
    # transformers writes id2label (num_labels is a property of it); its default is 2 labels
    labels, given = cfg.get("id2label"), cfg.get("num_labels")
    if isinstance(labels, dict) and labels:
        num_labels = len(labels)
    elif given is None:
        num_labels = 2
    elif isinstance(given, int) and not isinstance(given, bool):
        num_labels = given
    else:
        raise ValueError(f"model config num_labels must be an integer, got {given!r}")
    if not 0 < num_labels <= MAX_NUM_LABELS:
        raise ValueError(f"model config num_labels must be in [1, {MAX_NUM_LABELS}], got {num_labels}")
    return base, num_labels
