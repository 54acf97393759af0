"""DraftProposer: where a speculative step's drafts come from (the interface SpecWorker calls).

Two implementations: NgramProposer (speculative/ngram.py: prompt lookup over the request's own tokens)
and DraftModelProposer (speculative/draft_model.py: a smaller model run k steps ahead).

Invariants every proposer keeps:
- propose(reqs, lens) returns, per request, a Draft of at most lens[i] tokens that would follow the
  request's verified tokens (origin_input_ids + output_ids); a request with lens[i] == 0 gets none.
- A Draft carries the distribution its tokens were drawn from when they were sampled (probs), or None
  for a deterministic proposal (a point mass): the rejection rule needs q (layers/rejection_sampler.py).
- on_verified(req, accepted) is called once per request after each verify step: the first `accepted`
  drafts were kept (state built on the rejected ones must be undone).
- Whatever a proposer holds for a request (req.spec_state) is released by release_stale(live) once the
  request is no longer running, however it left (finish, abort, retraction, a failed step): nothing
  outlives a request. check_memory(live) proves it after every step under --check-invariants.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.managers.req import Req
    from radixserve.speculative.spec_info import Draft


class DraftProposer(ABC):
    @abstractmethod
    def propose(self, reqs: list[Req], lens: list[int]) -> list[Draft]: ...

    def on_verified(self, req: Req, accepted: int) -> None:
        """The verify step kept `accepted` of req's drafts (default: nothing to undo)."""

    def release_stale(self, live: list[Req]) -> None:
        """Free the state of requests not in `live` (default: the state is plain Python, freed with the Req)."""

    def check_memory(self, live: list[Req]) -> None:
        """--check-invariants: raise InvariantError if a slot or row is lost or held twice (default: none held)."""

    def info(self) -> dict[str, Any]:
        """Extra get_server_info fields."""
        return {}
