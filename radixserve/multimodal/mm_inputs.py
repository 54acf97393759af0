"""A request's images as the scheduler and the model see them (SGLang's MultimodalDataItem / MultimodalInputs).

The processor (multimodal/processors/) expands each image placeholder of a prompt into the model's run of
image tokens and writes the image's *pad value* into every id of that run:

    prompt ids:  ... USER : <image> \\n describe ...
    input ids:   ... USER : p p p p p p p p p \\n describe ...     p = pad_value(image hash)

A pad value lies above the vocabulary (vocab_size + hash mod 2^30), so

- the radix cache, which keys on token ids, tells two images apart and shares the KV of an identical one
  with no change of its own (a prompt with the same image hits; another image is a miss at its first token);
- no text token can ever equal it.

The model embeds pad ids as token 0 and overwrites those rows with the vision tower's output for that span
(multimodal/mm_embedding.py). Where a token id must be a vocabulary id again (the prompt tokens a penalty or a
prompt logprob reads), `to_vocab` maps pads back to the model's image token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the HTTP process builds these and never imports torch; the tensors come from a processor
    import torch

PAD_SPACE = 1 << 30  # pad values: [vocab_size, vocab_size + PAD_SPACE)


def pad_value(vocab_size: int, image_hash: int) -> int:
    return vocab_size + image_hash % PAD_SPACE


@dataclass
class MultimodalDataItem:
    """One image of a request: where its tokens are and what the vision tower needs to compute them."""

    modality: str  # "image"
    hash: int  # of the decoded pixels (multimodal/image_loader.image_hash): equal images, equal hash
    pad_value: int  # written into every id of the span
    offset: int  # the span's first position in the request's input ids
    length: int  # tokens in the span
    # the processor's tensors for the tower (pixel_values [1, 3, H, W], and a model's extras such as a grid)
    features: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class MultimodalInputs:
    """Every image of one request, in prompt order; `image_token_id` is the vocabulary id the spans stand for."""

    items: list[MultimodalDataItem]
    image_token_id: int
    # M-RoPE (Qwen2.5-VL): the prompt's (t, h, w) rotary positions [3, prompt_len] (an image's tokens take their
    # grid's rows and columns), and what every later token adds to its position (the prompt's last + 1 - length)
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0

    def overlaps(self, lo: int, hi: int) -> bool:
        """Whether positions [lo, hi) hold any image token (a step that computes them runs the tower)."""
        return any(item.offset < hi and lo < item.end for item in self.items)

    def to_vocab(self, ids: list[int], vocab_size: int) -> list[int]:
        """`ids` with every pad value replaced by the image token: what a vocabulary-indexed reader sees."""
        return [self.image_token_id if t >= vocab_size else t for t in ids]

    def check(self, ids: list[int], vocab_size: int) -> None:
        """Raise ValueError unless the spans lie inside `ids`, in order, without overlap, each filled with its
        own pad value, and every id outside them is in the vocabulary (the scheduler's guard)."""
        inside = 0
        prev_end = 0
        for k, item in enumerate(self.items):
            if not (prev_end <= item.offset and item.length > 0 and item.end <= len(ids)):
                raise ValueError(f"image {k}: span [{item.offset}, {item.end}) is out of order or outside the prompt")
            if not vocab_size <= item.pad_value < vocab_size + PAD_SPACE:
                raise ValueError(f"image {k}: pad value {item.pad_value} is not above the vocabulary")
            if any(t != item.pad_value for t in ids[item.offset : item.end]):
                raise ValueError(f"image {k}: its span does not hold its pad value")
            inside += item.length
            prev_end = item.end
        outside = sum(1 for t in ids if t >= vocab_size)
        if outside != inside:
            raise ValueError(f"input_ids: {outside - inside} token id(s) outside the vocabulary [0, {vocab_size})")


def as_vocab_ids(ids: list[int], mm: MultimodalInputs | None, vocab_size: int) -> list[int]:
    return ids if mm is None else mm.to_vocab(ids, vocab_size)


def describe(mm: Any) -> str:
    """A short log form (never the pixels)."""
    if mm is None:
        return "no images"
    return ", ".join(f"image {i} at [{it.offset}, {it.end})" for i, it in enumerate(mm.items))
