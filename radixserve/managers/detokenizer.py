"""IncrementalDetokenizer: token ids -> text deltas that are safe to show.

Held back until the next token: a trailing U+FFFD (a multi-byte character split across tokens)
and, when stop strings are set, the last (longest stop - 1) characters (they may turn out to be
the start of a stop string, which must never reach the client). On finish the text is trimmed
at the stop string or stop token unless no_stop_trim.
"""

from __future__ import annotations

from typing import Any

from radixserve.sampling.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        self.sent = 0  # characters already emitted

    def final_text(self, output_ids: list[int], finished_reason: dict[str, Any]) -> str:
        matched = finished_reason.get("matched")
        trim = not self.params.no_stop_trim and finished_reason.get("type") == "stop"
        ids = output_ids[:-1] if trim and isinstance(matched, int) else output_ids
        text = self._decode(ids)
        if trim and isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def update(self, output_ids: list[int], finished_reason: dict[str, Any] | None) -> tuple[str, str]:
        """Return (text so far, new delta since the last call)."""
        if finished_reason is not None:
            text = self.final_text(output_ids, finished_reason)
        else:
            text = self._decode(output_ids).rstrip("\ufffd")
            if self.hold:
                text = text[: max(self.sent, len(text) - self.hold)]
        delta = text[self.sent :]
        self.sent = max(self.sent, len(text))
        return text, delta
