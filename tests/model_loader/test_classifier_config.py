"""A sequence classifier's config: its base architecture and label count, and the bound on num_labels (a lying
config cannot make the score head absurdly wide)."""

from __future__ import annotations

import pytest

from radixserve.model_loader.classifier_config import MAX_NUM_LABELS, classifier_fields


def test_a_language_model_has_no_labels() -> None:
    assert classifier_fields("LlamaForCausalLM", {"num_labels": 7}) == ("LlamaForCausalLM", 0)


@pytest.mark.parametrize("cfg, labels", [({}, 2), ({"num_labels": 1}, 1), ({"id2label": {"0": "no", "1": "yes",
                                                                                            "2": "maybe"}}, 3),
                                         ({"num_labels": MAX_NUM_LABELS}, MAX_NUM_LABELS)])
def test_label_counts(cfg, labels) -> None:
    assert classifier_fields("Qwen3ForSequenceClassification", cfg) == ("Qwen3ForCausalLM", labels)


@pytest.mark.parametrize("given", [0, -3, MAX_NUM_LABELS + 1, 10**12, "5", 2.5, True, None])
def test_absurd_num_labels_are_refused_naming_it(given) -> None:
    cfg = {"num_labels": given} if given is not None else {"id2label": {str(i): str(i) for i in range(2000)}}
    with pytest.raises(ValueError, match="num_labels"):
        classifier_fields("LlamaForSequenceClassification", cfg)


def test_an_unknown_classifier_family_is_refused() -> None:
    with pytest.raises(ValueError, match="GPT2ForSequenceClassification"):
        classifier_fields("GPT2ForSequenceClassification", {})
