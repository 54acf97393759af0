"""IncrementalDetokenizer: token ids -> text deltas that are safe to show, in O(new tokens) per step.

Each update decodes only a short window of ids (vLLM's prefix/read offsets): the text of
ids[prefix_offset:] minus the text of ids[prefix_offset:read_offset] is what the new tokens add.
Both decodes start at the same token, so tokenizers that drop a word's leading space at the start
of a decode (SentencePiece) give the right difference. A window whose text ends in U+FFFD (a
multi-byte character split across tokens) waits for the next token.

Held back until later: when stop strings are set, the last (longest stop - 1) characters (they may
turn out to be the start of a stop string, which must never reach the client). On finish the rest
is flushed and the text is trimmed at the stop string or stop token unless no_stop_trim.
"""

from __future__ import annotations

from typing import Any

from radixserve.sampling.sampling_params import SamplingParams

# Tokens decoded before the newest ones in each window; a few are enough for any merge rule.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] were decoded already (window context)
        self.read_offset = 0  # ids before this are in self.pieces
        self.pieces: list[str] = []  # decoded text, in pieces (joined once, at the end)
        self.num_chars = 0  # len("".join(pieces))
        self.sent = 0  # characters already emitted
        self.final_len: int | None = None  # length of the trimmed text, once finished

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _advance(self, ids: list[int], final: bool) -> None:
        """Decode ids[read_offset:] (a window, not the whole output) into self.pieces."""
        if len(ids) <= self.read_offset:
            return
        start = max(self.prefix_offset, self.read_offset - _CONTEXT_TOKENS)
        prefix_text = self._decode(ids[start : self.read_offset])
        new_text = self._decode(ids[start:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return  # an incomplete character: wait for the next token
        piece = new_text[len(prefix_text) :]
        self.pieces.append(piece)
        self.num_chars += len(piece)
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def text(self) -> str:
        """All text decoded so far (joined on demand: O(length))."""
        if len(self.pieces) > 1:
            self.pieces = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def update(self, output_ids: list[int], finished_reason: dict[str, Any] | None) -> str:
        """Feed the whole output so far (only its new tail is decoded); return the new visible delta."""
        if finished_reason is None:
            self._advance(output_ids, final=False)
            visible = self.num_chars - self.hold if self.hold else self.num_chars
            if visible <= self.sent:
                return ""
            delta = self._tail(self.sent, visible)
            self.sent = visible
            return delta
        matched = finished_reason.get("matched")
        trim = not self.params.no_stop_trim and finished_reason.get("type") == "stop"
        ids = output_ids[:-1] if trim and isinstance(matched, int) and output_ids else output_ids
        self._advance(ids, final=True)
        end = self.num_chars
        if trim and isinstance(matched, str):
            # The match ends in the newest token and was never emitted (held back): search the tail.
            tail_start = max(0, self.sent - len(matched))
            cut = self.text().find(matched, tail_start)
            if cut >= 0:
                end = cut
        delta = self._tail(self.sent, end) if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.final_len = end
        return delta

    def final_text(self) -> str:
        """The whole text after a finishing update (trimmed as that update decided)."""
        return self.text()[: self.num_chars if self.final_len is None else self.final_len]

    def _tail(self, start: int, end: int) -> str:
        # Only the last piece(s) are new; avoid joining the whole text for a short delta.
        out: list[str] = []
        pos = self.num_chars
        for piece in reversed(self.pieces):
            if pos <= start:
                break
            pos -= len(piece)
            out.append(piece)
        joined = "".join(reversed(out))
        return joined[start - pos : end - pos]
