"""The input embeddings of a step that computes image tokens (SGLang's general_mm_embed_routine).

Text ids are embedded as usual; pad ids (above the vocabulary: multimodal/mm_inputs.py) are embedded as
token 0 and then overwritten, span by span, with the rows of the vision tower's output that this step
computes. A request's step covers positions [prefix_len, seq_len): a chunk may start or end inside an image,
and a radix hit may cover the image's first rows, so each span is sliced by the overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.mem_cache.multimodal_cache import MultiModalCache
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.multimodal.mm_inputs import MultimodalDataItem


def embed_with_images(
    input_ids: torch.Tensor, fb: ForwardBatch, vocab_size: int, embed: Callable[[torch.Tensor], torch.Tensor],
    encode: Callable[[MultimodalDataItem], torch.Tensor], cache: MultiModalCache,
) -> torch.Tensor:
    """[n_tokens, hidden] embeddings of `input_ids` with the image rows of every request in `fb.mm_inputs`."""
    x = embed(input_ids.masked_fill(input_ids >= vocab_size, 0))
    row = 0
    for mm, lo, n in zip(fb.mm_inputs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        hi = lo + n
        for item in mm.items if mm is not None else ():
            a, b = max(lo, item.offset), min(hi, item.end)
            if a >= b:
                continue
            feats = cache.get_or_encode(item.hash, lambda item=item: encode(item))  # [item.length, hidden]
            if feats.shape[0] != item.length:
                raise ValueError(f"the vision tower gave {feats.shape[0]} rows for an image span of {item.length}")
            x[row + a - lo : row + b - lo] = feats[a - item.offset : b - item.offset].to(x.dtype)
        row += n
    return x
