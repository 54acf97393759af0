"""bench hicache: one real run at a small size (two server starts), and its bounds."""

from __future__ import annotations

import json

import pytest

from radixserve.bench import hicache


def test_a_run_restores_from_disk_and_reports_each_path(tmp_path) -> None:
    out = tmp_path / "hicache.json"
    res = hicache.main(["--prompt-len", "200", "--prompts", "1", "--storage-dir", str(tmp_path / "hc"),
                        "--json", str(out)])
    rows = {row["path"]: row for row in res["table"]}
    assert rows["computed"]["cached tokens"] == 0
    assert rows["restored from disk"]["cached tokens"] == 192  # 3 whole blocks of the 199 matchable tokens
    assert rows["memory hit"]["cached tokens"] == 199
    assert res["hicache"]["storage_hit_tokens"] == 192 and res["ttft_s"]["computed"] > 0
    assert json.loads(out.read_text())["restored_over_computed"] == res["restored_over_computed"]


@pytest.mark.parametrize("args, flag", [(["--prompt-len", "10"], "--prompt-len"),
                                        (["--prompt-len", "99999999"], "--prompt-len"),
                                        (["--prompts", "0"], "--prompts"), (["--prompts", "100000"], "--prompts")])
def test_bad_arguments_are_refused_by_flag(args, flag) -> None:
    with pytest.raises(SystemExit, match=flag):
        hicache.main(args)
