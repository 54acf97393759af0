"""How a (query, document) pair becomes a prompt, for the two kinds of reranker.

    yes/no     a causal LM (Qwen3-Reranker's recipe; any chat model can be asked the same question):
               <|im_start|>system\\nJudge whether the Document meets the requirements based on the Query and the
               Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\\n<|im_start|>user\\n
               <Instruct>: {instruction}\\n<Query>: {query}\\n            <- the query part: one tokenisation
               <Document>: {document}<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n
               score = softmax([logit("no"), logit("yes")])[1] at the last position
    classifier a *ForSequenceClassification checkpoint: the tokenizer's own pair encoding, tokenizer(query,
               document), as transformers' and sentence-transformers' cross-encoders feed it; score =
               sigmoid(logit) of its one label

The query comes first in both, so the radix cache serves it to every document after the first (the yes/no
query part is tokenised once and the same ids start every prompt). The text is concatenated, never
str.format-ted: a query or document holding braces stays as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
          'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES, NO = "yes", "no"


def query_text(query: str, instruction: str | None) -> str:
    """The yes/no prompt up to the document: shared by every document of one query."""
    return PREFIX + "<Instruct>: " + (DEFAULT_INSTRUCTION if instruction is None else instruction) + \
        "\n<Query>: " + query + "\n"


def document_text(document: str) -> str:
    return "<Document>: " + document + SUFFIX


def single_token(tokenizer: Any, word: str) -> int | None:
    """The id of `word` as one token of the vocabulary (what Qwen3-Reranker's convert_tokens_to_ids reads),
    or None when the tokenizer has no such token."""
    tid = tokenizer.convert_tokens_to_ids(word)
    if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
        return tid
    ids = tokenizer.encode(word, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@dataclass(frozen=True)
class YesNo:
    """The label token ids of the yes/no reranker: the scheduler returns their logprobs (token_ids_logprob)."""

    yes: int
    no: int

    @classmethod
    def of(cls, tokenizer: Any) -> YesNo | None:
        yes, no = single_token(tokenizer, YES), single_token(tokenizer, NO)
        return None if yes is None or no is None or yes == no else cls(yes, no)

    @property
    def ids(self) -> list[int]:
        return [self.yes, self.no]

    @staticmethod
    def score(logprobs: list[float]) -> float:
        """softmax([no, yes])[1] from the logprobs [yes, no] (they differ from the logits by one constant per
        position, which the softmax cancels), as a logistic of the difference: exact for any gap."""
        return _sigmoid(logprobs[0] - logprobs[1])


def classifier_score(logits: list[float]) -> float:
    """A one-label classifier's relevance: sigmoid(logit) (sentence-transformers' CrossEncoder default)."""
    return _sigmoid(logits[0])


def _sigmoid(x: float) -> float:
    # NOTE: the two branches keep exp() from overflowing at either end
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def yes_no_prompts(tokenizer: Any, pairs: list[tuple[str, str]], instruction: str | None) -> list[list[int]]:
    """Token ids of each pair's yes/no prompt; each distinct query is tokenised once."""
    queries: dict[str, list[int]] = {}
    docs = tokenizer([document_text(d) for _, d in pairs], add_special_tokens=False)["input_ids"] if pairs else []
    out = []
    for (q, _), doc_ids in zip(pairs, docs):
        if q not in queries:
            queries[q] = tokenizer.encode(query_text(q, instruction), add_special_tokens=False)
        out.append(queries[q] + list(doc_ids))
    return out


def pair_prompts(tokenizer: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """Token ids of each pair as the tokenizer's pair encoding (a classifier's input)."""
    if not pairs:
        return []
    enc = tokenizer([q for q, _ in pairs], [d for _, d in pairs], add_special_tokens=True)
    return [list(ids) for ids in enc["input_ids"]]
