"""`radixserve inspect TRACE`: read a --trace-batches file back, one step per block, in the
seed's order (what was scheduled -> what the ForwardBatch carried -> what came out), and a
summary of where the steps went."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any


def _short(xs: list[Any], n: int = 8) -> str:
    return str(xs) if len(xs) <= n else f"[{', '.join(map(str, xs[:n]))}, ... ({len(xs)} total)]"


def inspect_trace(path: str, limit: int | None = None, show_tokens: bool = False) -> dict[str, Any]:
    modes: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    steps = drafted = accepted = 0
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            steps += 1
            s, fw, res = rec["schedule"], rec["forward"], rec["result"]
            modes[fw["forward_mode"]] += 1
            tokens[fw["forward_mode"]] += len(fw["input_ids"])
            if s.get("spec_drafts") is not None:
                drafted += sum(len(d) for d in s["spec_drafts"])
                accepted += sum(s["spec_accept_lens"])
            if limit is not None and steps > limit:
                continue
            print(f"step {rec['step']}: {s['mode']} bs={fw['batch_size']} tokens={len(fw['input_ids'])}")
            print(f"  schedule: rids={_short(s['rids'], 6)} prefix={_short(s['prefix_lens'])} "
                  f"extend={_short(s['extend_lens'])} waiting={s['num_waiting']} running={s['num_running']} "
                  f"chunked={s['chunked_rid']} kv_free={s['kv_available']} kv_cached={s['kv_cached']}")
            print(f"  forward:  seq_lens={_short(fw['seq_lens'])} req_pool_indices={_short(fw['req_pool_indices'])}"
                  f" positions={_short(fw['positions'])}")
            if show_tokens:
                print(f"            input_ids={_short(fw['input_ids'], 16)}")
                print(f"            out_cache_loc={_short(fw['out_cache_loc'], 16)}")
            if s.get("spec_drafts") is not None:  # TARGET_VERIFY: drafts per request and how many were kept
                print(f"  verify:   drafts={_short([len(d) for d in s['spec_drafts']])} "
                      f"accepted={_short(s['spec_accept_lens'])}")
            print(f"  result:   next_token_ids={_short(res['next_token_ids'])}")
    summary = {"steps": steps, "steps_by_mode": dict(modes), "tokens_by_mode": dict(tokens)}
    if drafted:
        summary["spec_drafts"], summary["spec_accepted"] = drafted, accepted
    print(json.dumps(summary, indent=2))
    return summary
