"""bench collectives: real gloo ops between 2 processes; every time is positive and the per-step totals
follow from them."""

from __future__ import annotations

from radixserve.bench import collectives
from tests.bench.helpers import close, read_json


def test_collectives_cli_writes_consistent_json(tmp_path, capsys):
    out = tmp_path / "collectives.json"
    collectives.main(["--world-size", "2", "--tokens", "1,4", "--iters", "3", "--layers", "2", "--json", str(out)])
    assert "all_reduce_us" in capsys.readouterr().out
    res = read_json(out)
    assert res["world_size"] == 2 and [r["tokens"] for r in res["rows"]] == [1, 4]
    for r in res["rows"]:
        for key in ("all_reduce_us", "all_gather_logits_us", "send_recv_us", "bcast_tokens_us", "bcast_messages_us"):
            assert r[key] > 0, (key, r)
        assert close(r["tp_step_ms"], (5 * r["all_reduce_us"] + r["all_gather_logits_us"]) / 1e3)
        assert close(r["pp_step_ms"], (r["send_recv_us"] + r["bcast_tokens_us"]) / 1e3)
