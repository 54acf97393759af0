"""GrammarSpec: which constraint a request asks for, and its syntax check.

A request carries at most one of `json_schema`, `regex`, `ebnf`, `structural_tag` (SGLang's native
names). The OpenAI routes map `response_format` and tool_choice onto these. The check here is
xgrammar's own parser (no tokenizer needed, milliseconds), run where requests are normalised so an
invalid schema / regex / grammar is a 400 naming the field before anything is queued; compiling
against the vocabulary happens later in the scheduler's worker thread (XGrammarBackend).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# A grammar's source is parsed and compiled by the server: its size is bounded like any other
# client-controlled count (a 100 kB JSON schema is already far beyond any real one).
MAX_CONSTRAINT_CHARS = 100_000


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of CONSTRAINT_FIELDS
    value: str  # the schema / regex / EBNF / structural tag, as text

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.value)

    def check(self) -> None:
        """Raise ValueError("<field>: ...") when xgrammar cannot parse the constraint."""
        import xgrammar as xgr

        try:
            if self.kind == "json_schema":
                json.loads(self.value)  # xgrammar's message for broken JSON is less clear than json's
                xgr.Grammar.from_json_schema(self.value, any_whitespace=False)
            elif self.kind == "regex":
                xgr.Grammar.from_regex(self.value)
            elif self.kind == "ebnf":
                xgr.Grammar.from_ebnf(self.value)
            else:
                xgr.Grammar.from_structural_tag(self.value)
        except (ValueError, RuntimeError, TypeError) as e:
            raise ValueError(f"{self.kind}: invalid {_NAMES[self.kind]}: {short_error(e)}") from None


_NAMES = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar",
          "structural_tag": "structural tag"}


def short_error(e: BaseException) -> str:
    """xgrammar's messages start with '[time] /path/file.cc:line: '; the client needs the rest."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            return rest
    return text


def normalise_constraint(value: object, kind: str) -> object:
    """A JSON schema (or structural tag) given as an object becomes its JSON text; other values are
    left for SamplingParams.verify to judge."""
    if kind in ("json_schema", "structural_tag") and isinstance(value, dict):
        return json.dumps(value)
    return value
