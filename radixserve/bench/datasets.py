"""Synthetic workloads shared by `bench serving`, `bench offline` and `bench baseline`.

A workload is a list of Conversations; a single request is a one-turn conversation:

    random         --num-requests requests; prompt length uniform in --input-len-range
    shared-prefix  --num-groups x --group-size requests; each group shares one --prefix-len prefix
                   (a system prompt) followed by its own --question-len question — what the radix
                   cache is for: the prefix is computed once per group
    multi-turn     --num-conversations x --turns requests; turn k resends the whole conversation
                   so far (user turns and the model's answers) plus a new user message

Output lengths are uniform in --output-len-range; clients ask for exactly that many tokens
(max_tokens, plus ignore_eos / min_tokens where the engine supports them).

Prompts are random English-like words taken from the model's own vocabulary: every word is one
vocabulary token with a leading space, so the text tokenizes back to the requested count, and
texts concatenate at word boundaries (prefix + question tokenizes as prefix ids + question ids).
"""

from __future__ import annotations

import argparse
import random
import re
from dataclasses import dataclass, field
from typing import Any

from radixserve.bench.common import parse_range
from radixserve.model_loader import default_model_path, get_tokenizer, model_kind

DATASETS = ("random", "shared-prefix", "multi-turn")


@dataclass
class Turn:
    text: str  # the new user text of this turn (starts with a space)
    ids: list[int]  # its token ids
    output_len: int  # tokens to generate


@dataclass
class Conversation:
    turns: list[Turn]
    prefix_text: str = ""  # shared-prefix: the group's prefix, sent before the first turn
    prefix_ids: list[int] = field(default_factory=list)
    group: int = 0

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--num-requests", type=int, default=64, help="random: number of requests")
    g.add_argument("--input-len-range", type=parse_range, default=(256, 1024),
                   help="LO,HI prompt tokens (random; multi-turn: each new user message)")
    g.add_argument("--output-len-range", type=parse_range, default=(64, 256), help="LO,HI output tokens")
    g.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups")
    g.add_argument("--group-size", type=int, default=16, help="shared-prefix: requests per group")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared tokens per group")
    g.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens after the prefix")
    g.add_argument("--num-conversations", type=int, default=8, help="multi-turn: conversations")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrival times")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer for prompts and counting (GGUF or HF folder; default: the embedded model)")


class WordSource:
    """Random text of an exact token count, from one-token words of the tokenizer's vocabulary."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tok = tokenizer
        self.rng = rng
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        special = set(tokenizer.all_special_ids)
        self.words = [p for i, p in enumerate(pieces) if i not in special and re.fullmatch(r" [A-Za-z]{2,}", p)]
        if len(self.words) < 100:  # e.g. a sentencepiece vocabulary that decodes without the space
            self.words = [" " + p.strip() for i, p in enumerate(pieces)
                          if i not in special and re.fullmatch(r"\s?[A-Za-z]{2,}", p)]
        if not self.words:
            raise ValueError("tokenizer vocabulary has no plain word tokens to build prompts from")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def text(self, num_tokens: int) -> tuple[str, list[int]]:
        """(text, ids) with len(ids) == num_tokens in practice (nearest the tokenizer allows)."""
        if num_tokens <= 0:
            return "", []
        text = "".join(self.rng.choices(self.words, k=num_tokens))
        ids = self.encode(text)
        for _ in range(4):
            if len(ids) == num_tokens:
                break
            if len(ids) > num_tokens:
                text = self.tok.decode(ids[:num_tokens])
            else:
                text += "".join(self.rng.choices(self.words, k=num_tokens - len(ids)))
            ids = self.encode(text)
        return text, ids


def load_tokenizer(path: str | None) -> Any:
    path = path or default_model_path()
    try:
        model_kind(path)
        return get_tokenizer(path)
    except ValueError:  # a hub-style name or a tokenizer-only folder: let transformers resolve it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list[Conversation]:
    rng = random.Random(args.seed)
    src = WordSource(tokenizer, rng)
    out_lo, out_hi = args.output_len_range
    in_lo, in_hi = args.input_len_range

    def turn(n: int) -> Turn:
        text, ids = src.text(n)
        return Turn(text, ids, rng.randint(out_lo, out_hi))

    if args.dataset == "random":
        return [Conversation([turn(rng.randint(in_lo, in_hi))]) for _ in range(args.num_requests)]
    if args.dataset == "shared-prefix":
        convs = []
        for g in range(args.num_groups):
            prefix_text, prefix_ids = src.text(args.prefix_len)
            convs += [Conversation([turn(args.question_len)], prefix_text, prefix_ids, group=g)
                      for _ in range(args.group_size)]
        rng.shuffle(convs)  # groups interleave, as independent users' requests would
        return convs
    if args.dataset == "multi-turn":
        return [Conversation([turn(rng.randint(in_lo, in_hi)) for _ in range(args.turns)])
                for _ in range(args.num_conversations)]
    raise ValueError(f"unknown dataset {args.dataset!r}")


def workload_summary(convs: list[Conversation]) -> dict[str, Any]:
    """Counts of the workload itself. new_input_tokens: every token of text it introduces, each
    shared prefix once (what an engine that never recomputed anything would prefill)."""
    turns = [t for c in convs for t in c.turns]
    prefixes = {c.group: len(c.prefix_ids) for c in convs if c.prefix_ids}
    return {
        "conversations": len(convs),
        "requests": len(turns),
        "new_input_tokens": sum(len(t.ids) for t in turns) + sum(prefixes.values()),
        "shared_prefix_tokens": sum(prefixes.values()),
        "requested_output_tokens": sum(t.output_len for t in turns),
    }


def history_ids(conv: Conversation, k: int, answers: list[list[int]]) -> list[int]:
    """Token ids of the prompt of turn k: prefix + (turn i, answer i) for i < k + turn k."""
    ids = list(conv.prefix_ids)
    for i in range(k):
        ids += conv.turns[i].ids + answers[i]
    return ids + conv.turns[k].ids


def history_text(conv: Conversation, k: int, answers: list[str]) -> str:
    """The completions-endpoint prompt of turn k (same layout as history_ids, as text)."""
    parts = [conv.prefix_text]
    for i in range(k):
        parts += [conv.turns[i].text, answers[i]]
    return "".join(parts + [conv.turns[k].text])


def history_messages(conv: Conversation, k: int, answers: list[str]) -> list[dict[str, str]]:
    """The chat-endpoint messages of turn k: a system message holding the shared prefix (if any),
    then alternating user / assistant messages."""
    msgs = [{"role": "system", "content": conv.prefix_text.strip()}] if conv.prefix_text else []
    for i in range(k):
        msgs += [{"role": "user", "content": conv.turns[i].text.strip()},
                 {"role": "assistant", "content": answers[i]}]
    return msgs + [{"role": "user", "content": conv.turns[k].text.strip()}]
