"""bench scale (radixserve/bench/scale.py, scale_files.py) at tiny shapes: the random Q4_K_M files follow llama.cpp's
mix, are valid blocks radixserve loads and runs to finite logits (dense and MoE), carry the real vocabulary size
with the default model's tokenizer, and a run measures a real server's time to ready and peak anonymous memory;
every bound is refused naming its flag."""

from __future__ import annotations

import gguf
import pytest
import torch

from radixserve.bench import scale, scale_files
from radixserve.bench.scale_files import Shape

TINY = Shape("tiny-dense", 256, 8, 4, 2, 512, 49152 + 40, tied=False)
TINY_MOE = Shape("tiny-moe", 256, 4, 4, 4, 256, 49152, experts=8, top_k=2, rope_theta=10000.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-scale")
    return {s.name: scale_files.write_scale_gguf(s, str(out / f"{s.name}.gguf")) for s in (TINY, TINY_MOE)}


def test_the_mix_is_llama_cpps_q4_k_m(files) -> None:
    r = gguf.GGUFReader(files["tiny-dense"])
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    more = [i for i in range(8) if scale_files.more_bits(i, 8)]
    assert more == [0, 3, 6, 7]  # the first and last eighth, and every third in between (llama.cpp)
    for i in range(8):
        want = "Q6_K" if i in more else "Q4_K"
        assert types[f"blk.{i}.attn_v.weight"] == types[f"blk.{i}.ffn_down.weight"] == want
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.ffn_gate.weight"] == "Q4_K"
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == TINY.vocab and bytes(tokens.parts[tokens.data[-1]]) == b"<|reserved_39|>"


def test_a_large_vocabulary_pads_normal_tokens_then_256_control_ones() -> None:
    """As Llama 3's 128,256: a file padded with tens of thousands of control tokens would make transformers'
    tokenizer load for seconds, which no real model's does (bench scale times the server's start)."""
    fields = {k: v for k, v, _, _ in scale_files._tokenizer_fields(49152 + 300)}
    types, tokens = fields["tokenizer.ggml.token_type"], fields["tokenizer.ggml.tokens"]
    assert len(types) == len(tokens) == 49152 + 300
    assert types[49152:49152 + 44] == [1] * 44 and types[-256:] == [3] * 256
    assert tokens[-1] == "<|reserved_255|>" and len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-moe"])
def test_the_files_load_and_run_to_finite_logits(files, name) -> None:
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs
    from tests.model_executor.hand_batch import HandBatch

    runner = ModelRunner(ServerArgs(model_path=files[name], max_total_tokens=1024, max_running_requests=4))
    assert runner.quantization == "auto" and not runner.quant_report.requantized
    assert runner.model.model.embed_tokens.blocks is not None  # read in place from the file
    hb = HandBatch(runner)
    res = hb.run([(hb.new_req(), list(range(40, 72)))], full=False)
    logits = res.logits_output.next_token_logits
    assert logits.shape[-1] == runner.model_config.vocab_size and torch.isfinite(logits).all()
    assert logits.std() > 0


def test_a_run_measures_a_real_server(files, monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(scale_files.SHAPES, "tiny-dense", TINY)
    monkeypatch.setattr(scale, "scale_file", lambda name, folder: files[name])
    res = scale.main(["--shapes", "tiny-dense", "--skip", "speed", "--context", "1024",
                      "--json", str(tmp_path / "r.json")])
    r = res["results"]["tiny-dense"]["radixserve"]
    assert 0 < r["warm_ready_s"] < 300 and 0 < r["cold_ready_s"] < 300
    assert 0 < r["first_ready_s"] < 300  # the start that packed the file and wrote the weight cache the others map
    assert 0.05 < r["peak_anon_gib"] < 4  # a real process group was polled: torch alone is ~0.15 GiB
    assert "tiny-dense" in capsys.readouterr().out and (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args, flag", [(["--shapes", "llama-9000b"], "--shapes"), (["--threads", "0"], "--threads"),
                                        (["--context", "10"], "--context"), (["--repeats", "1000"], "--repeats"),
                                        (["--llama-server", "/nonexistent"], "--llama-server")])
def test_bad_arguments_are_refused_by_flag(args, flag) -> None:
    with pytest.raises(SystemExit, match=flag):
        scale.check_args(scale.build_parser().parse_args(args))
