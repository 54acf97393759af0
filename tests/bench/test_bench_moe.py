"""bench moe (radixserve/bench/moe.py) at a tiny shape: the random MoE and its dense twin are real GGUF files
radixserve loads (the MoE one as Mixtral: `llama` + expert tensors, with the default model's tokenizer), the
bytes a token reads count the top-k share of the expert tensors only, the run prints both models' figures,
and every bound is refused naming its flag before anything is written."""

from __future__ import annotations

import gguf
import pytest

from radixserve.bench import moe
from radixserve.model_loader import get_model_config

TINY = ["--preset", "Q8_0", "--hidden", "128", "--layers", "2", "--experts", "4", "--expert-size", "64",
        "--top-k", "2", "--heads", "4", "--kv-heads", "2", "--repeats", "1", "--prompt-len", "16"]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-moe")  # the files are written once and reused by the run


def test_the_files_and_the_bytes_a_token_reads(out_dir) -> None:
    a = moe.build_parser().parse_args([*TINY, "--out", str(out_dir)])
    moe.check_args(a)
    path = moe.make_file(a, dense=False)
    dense = moe.make_file(a, dense=True)
    assert moe.make_file(a, dense=False) == path  # reused, not rewritten
    cfg = get_model_config(path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        ("MixtralForCausalLM", 4, 2, 64)
    assert get_model_config(dense).intermediate_size == 2 * 64  # the same active parameters
    active, by_type = moe.active_bytes(path)
    r = gguf.GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    experts = sum(n for name, n in sizes.items() if "_exps." in name)
    others = sum(n for name, n in sizes.items() if "_exps." not in name and name != "token_embd.weight")
    assert active == others + experts // 2  # top-2 of 4
    assert sum(by_type.values()) == sum(sizes.values()) and "Q8_0" in by_type
    dense_active, _ = moe.active_bytes(dense)
    assert abs(dense_active - active) < 0.1 * active  # twins: same active weights, up to the router


def test_a_run_prints_both_models(out_dir, tmp_path, capsys) -> None:
    res = moe.main([*TINY, "--out", str(out_dir), "--json", str(tmp_path / "r.json")])
    assert set(res["results"]) == {"moe", "dense"}
    for kind in ("moe", "dense"):
        assert res["results"][kind]["radixserve"]["tg"] > 0 and res["results"][kind]["radixserve"]["pp"] > 0
    assert res["cost"][0]["moe / dense step"] > 0
    out = capsys.readouterr().out
    assert "moe / dense step" in out and "fraction of bandwidth" in out
    assert (tmp_path / "r.json").exists()


@pytest.mark.parametrize("flag,value,message", [
    ("--preset", "Q4_K_M", "needs --llama-quantize"),
    ("--preset", "IQ9", "choose from"),
    ("--experts", "100000", "--experts must be in"),
    ("--top-k", "9", "--top-k must be in"),
    ("--hidden", "100", "multiples of 32"),
    ("--layers", "0", "--layers must be in"),
    ("--heads", "3", "--heads"),
    ("--llama-bench", "/nonexistent/llama-bench", "not an executable file"),
])
def test_bad_flags_are_refused(tmp_path, flag, value, message) -> None:
    args = [*TINY, "--out", str(tmp_path / "never"), flag, value]
    with pytest.raises(SystemExit, match=message):
        moe.main(args)
    assert not (tmp_path / "never").exists()
