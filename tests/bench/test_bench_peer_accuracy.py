"""bench peer / accuracy / speculative at tiny sizes: they run, print their tables and refuse bad arguments.
(llama-bench itself is not installed in CI: the peer's own measurement runs only by hand.)"""

from __future__ import annotations

import os
import stat

import pytest

from radixserve.bench import accuracy, peer


def test_peer_refuses_a_missing_or_failing_binary(tmp_path) -> None:
    with pytest.raises(SystemExit, match="not an executable"):
        peer.main(["--llama-bench", str(tmp_path / "nope")])
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(SystemExit, match=r"llama-bench failed \(3\): broken"):
        peer.main(["--llama-bench", str(fake)])
    with pytest.raises(SystemExit, match="unknown"):
        peer.main(["--llama-bench", str(fake), "--formats", "fp3"])


def test_llama_server_peers_refuse_a_missing_binary(tmp_path) -> None:
    """serving-peer and accuracy --llama-server check the binary before starting or loading anything."""
    from radixserve.bench import serving_peer

    with pytest.raises(SystemExit, match="not an executable"):
        serving_peer.main(["--llama-server", str(tmp_path / "nope"), "--", "--num-requests", "2"])
    with pytest.raises(SystemExit, match="starts both servers"):
        serving_peer.main(["--llama-server", str(tmp_path), "--", "--base-url", "http://x"])
    with pytest.raises(SystemExit, match="not an executable"):
        accuracy.main(["--llama-server", str(tmp_path), "--num-prompts", "1"])


def test_peer_dtype_reaches_every_run_but_the_exact_one() -> None:
    args = peer.build_parser().parse_args(["--llama-bench", "x", "--dtype", "float32"])
    assert peer.one_batch_args("auto", args).dtype == "float32"
    assert peer.one_batch_args("int8", args).dtype == "float32"
    assert peer.one_batch_args("exact", args).dtype == "float32"
    assert peer.one_batch_args("auto", peer.build_parser().parse_args(["--llama-bench", "x"])).dtype == "auto"
    args = peer.build_parser().parse_args(["--llama-bench", "x", "--dtype", "bfloat16"])
    assert peer.one_batch_args("exact", args).dtype == "float32"  # the exact mode is float32 whatever --dtype says
    assert peer.one_batch_args("none", args).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        peer.build_parser().parse_args(["--llama-bench", "x", "--dtype", "fp8"])


def test_peer_parses_llama_bench_json(tmp_path) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text('#!/bin/sh\necho \'[{"n_prompt": 512, "n_gen": 0, "avg_ts": 200.5, "build_commit": "abc"},'
                    ' {"n_prompt": 0, "n_gen": 128, "avg_ts": 99.0}]\'\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    got = peer.llama_bench(str(fake), os.devnull, 2, 512, 128)
    assert got == {"pp": 200.5, "tg": 99.0, "build": "abc"}


def test_accuracy_runs_and_reports(capsys) -> None:
    res = accuracy.main(["--formats", "auto", "--num-prompts", "2", "--max-new-tokens", "3"])
    row = res["rows"][0]
    assert row["format"] == "auto" and row["positions"] == 6
    assert 0.0 <= row["top1_agreement"] <= 1.0 and row["mean_abs_dlogprob"] >= 0.0
    assert "top1_agreement" in capsys.readouterr().out
    for bad in (["--num-prompts", "0"], ["--max-new-tokens", "100000"], ["--formats", "int3"]):
        with pytest.raises(SystemExit):
            accuracy.main(bad)


def test_speculative_bench_runs_and_checks_identity(capsys) -> None:
    from radixserve.bench import speculative

    res = speculative.main(["--max-new-tokens", "6", "--workloads", "copy,fresh", "--num-prompts", "2",
                           "--temperatures", "0,0.7"])
    assert {r["workload"] for r in res["rows"]} == {"copy", "fresh"}
    # greedy rows and sampled n-gram rows (the drafts never touch the sampler's draws) must be identical;
    # sampled draft_model rows are only equally distributed, so they carry None
    assert all(r["identical_outputs"] is True for r in res["rows"] if r["temperature"] == 0 or r["algorithm"] == "ngram")
    assert all(r["identical_outputs"] is None for r in res["rows"] if r["temperature"] > 0 and r["algorithm"] == "draft_model")
    assert "speedup" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        speculative.main(["--max-new-tokens", "0"])


def test_peer_decode_figure_is_a_median_of_many_steps() -> None:
    """One batch-1 step is a few ms: bench peer's decode figure is the median of 64 (three swung 0.8-1.2x on a shared
    VM); --decode-repeats is bounded, 0 meaning --repeats."""
    from radixserve.bench import one_batch

    ns = peer.one_batch_args("auto", peer.build_parser().parse_args(["--llama-bench", "x", "--repeats", "3"]))
    assert one_batch.decode_repeats(ns) == 64 and ns.repeats == 3
    ns = one_batch.build_parser().parse_args(["--repeats", "5"])
    assert one_batch.decode_repeats(ns) == 5
    for absurd in (-1, 10**9):
        ns.decode_repeats = absurd
        with pytest.raises(ValueError, match="--decode-repeats"):
            one_batch.decode_repeats(ns)
