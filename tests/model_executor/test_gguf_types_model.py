"""`--quantization auto` on a GGUF that mixes every exact type (as Q4_K_M files mix Q4_K, Q6_K, Q5_0 and
Q8_0): no layer is re-quantised, each projection's low-bit copy is the file's values exactly (stacked
projections of different types in their exact join), the native decode stack runs every kind and equals
the layer-by-layer path; an F16 tensor stays on the float path and a type without an exact layout
(IQ2_XS) is re-quantised with one log line naming it."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch

from radixserve.kernels.cpu import load_cpu_ops
from radixserve.server_args import ServerArgs
from tests.layers.test_gguf_formats import small_blocks
from tests.model_executor.hand_batch import HandBatch
from tests.model_loader.conftest import TinyModel, write_gguf

ops, why = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"no C++ kernels: {why}")
QT = gguf.GGMLQuantizationType

# every exact type once or more, stacked q/k/v and gate/up of different kinds
TYPES = {
    0: {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "IQ4_XS", "gate_proj": "Q5_K",
        "up_proj": "Q4_0", "down_proj": "Q2_K"},
    1: {"q_proj": "Q3_K", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "IQ4_NL",
        "up_proj": "Q5_1", "down_proj": "Q6_K"},
}
SHAPE = {"hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 512, "vocab": 96, "layers": 2, "tied": True}


def _encoder(types: dict[int, dict[str, str]]):
    def encode(name: str, value: np.ndarray) -> tuple[np.ndarray, QT]:
        if name == "model.embed_tokens.weight":
            return value.astype(np.float16) * np.float16(0.05), QT.F16  # F16: the float path
        layer, proj = int(name.split(".")[2]), name.split(".")[-2]
        qtype = types[layer][proj]
        bs = gguf.GGML_QUANT_SIZES[getattr(QT, qtype)][0]
        n, k = value.shape
        seed = 1000 * layer + sum(map(ord, proj))
        return small_blocks(qtype, n, k // bs, seed), getattr(QT, qtype)

    return encode


def _runner(path, **kw):
    from radixserve.model_executor.model_runner import ModelRunner

    return ModelRunner(ServerArgs(model_path=str(path), max_total_tokens=1024, max_running_requests=4, **kw))


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_gguf(TinyModel(**SHAPE), tmp_path_factory.mktemp("mixed") / "mixed.gguf", _encoder(TYPES)).path


def test_every_exact_type_keeps_the_files_values(mixed_file) -> None:
    from radixserve.model_loader import iterate_weights

    runner = _runner(mixed_file)
    report = runner.quant_report
    assert not report.requantized
    assert report.float_layers == {"F16": 1}  # the tied LM head
    # gate_up Q5_K + Q4_0 joins in the packed Q5; Q5_0 (a min: m = -16 d) beside Q8_0 takes Q8_M; Q6_K alone: Q6
    assert report.counts == {"Q8_M16": 2, "Q8_0": 1, "Q8_M": 2, "Q6": 1, "Q4_1": 1, "Q5": 1}
    want = dict(iterate_weights(str(mixed_file)))  # gguf's dequantisation, un-permuted
    for i in range(2):
        p = f"model.layers.{i}."
        layer = runner.model.model.layers[i]
        stacks = {layer.self_attn.qkv_proj: ["q_proj", "k_proj", "v_proj"], layer.self_attn.o_proj: ["o_proj"],
                  layer.mlp.gate_up_proj: ["gate_proj", "up_proj"], layer.mlp.down_proj: ["down_proj"]}
        for mod, parts in stacks.items():
            names = [p + ("self_attn." if x[0] in "qkvo" else "mlp.") + x + ".weight" for x in parts]
            assert torch.equal(mod.qweight.dequantize(), torch.cat([want[n] for n in names])), names


def test_the_decode_stack_runs_every_kind_as_the_layers_do(mixed_file) -> None:
    stacked = _runner(mixed_file)
    layered = _runner(mixed_file, disable_cpu_graph=True)
    assert stacked.cpu_graph_runner is not None and layered.cpu_graph_runner is None
    logits = []
    for runner in (stacked, layered):
        hb = HandBatch(runner)
        rows = [hb.new_req() for _ in range(2)]
        for i, row in enumerate(rows):
            hb.run([(row, list(range(10 + i, 30 + 5 * i)))], full=False)
        got = [hb.run([(row, [7 + step]) for row in rows], full=False).logits_output.next_token_logits.clone()
               for step in range(3)]
        logits.append(got)
        hb.release_all()
    for a, b in zip(*logits):
        assert a.isfinite().all() and torch.equal(a, b)


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_keep_the_files_values(mixed_file, rank) -> None:
    """tp 2: o_proj (K 256) and down_proj (K 512) are cut at K/2, inside a 256-element super-block. The
    converted rows carry a scale (and min) per 32 or 16, so any cut on a 32-block boundary is exact:
    each rank's low-bit copy dequantises to the float shard it holds."""
    from radixserve.distributed.parallel_state import ParallelState
    from radixserve.layers.linear import PackableLinear
    from radixserve.model_loader import get_model_config, iterate_weights
    from radixserve.model_loader.gguf_loader import load_gguf_low_bit
    from radixserve.models.registry import get_model_class

    cfg = get_model_config(str(mixed_file))
    ps = ParallelState(tp_rank=rank, tp_size=2)
    floats = get_model_class(cfg.architecture)(cfg, ps)
    floats.load_weights(iterate_weights(str(mixed_file)))
    float_mods = dict(floats.named_modules())
    model = get_model_class(cfg.architecture)(cfg, ps)
    report = load_gguf_low_bit(model, str(mixed_file), "auto", None, None)
    assert not report.requantized and sum(report.counts.values()) == 8
    checked = 0
    for name, mod in model.named_modules():
        if isinstance(mod, PackableLinear) and mod.qweight is not None:
            assert mod.weight is None and torch.equal(mod.qweight.dequantize(), float_mods[name].weight), (rank, name)
            checked += 1
    assert checked == 8


def test_a_type_without_an_exact_layout_is_requantised_with_one_line(tmp_path, caplog) -> None:
    types = {i: {**TYPES[i], "gate_proj": "IQ2_XS"} for i in range(2)}
    path = write_gguf(TinyModel(**SHAPE), tmp_path / "iq2.gguf", _encoder(types)).path
    with caplog.at_level(logging.INFO, logger="radixserve.layers.quantization.plan"):
        runner = _runner(path)
    report = runner.quant_report
    assert report.requantized_by_type == {"IQ2_XS+Q4_0": ["model.layers.0.mlp.gate_up_proj"],
                                          "IQ2_XS+Q5_1": ["model.layers.1.mlp.gate_up_proj"]}
    lines = [r.getMessage() for r in caplog.records if "re-quantised" in r.getMessage()]
    assert len(lines) == 2 and all("IQ2_XS" in line for line in lines), lines


def test_the_benches_type_table_has_one_row_per_type(tmp_path) -> None:
    from radixserve.layers.quantization.type_report import type_rows

    types = {i: {**TYPES[i], "gate_proj": "IQ2_XS"} for i in range(2)}
    path = write_gguf(TinyModel(**SHAPE), tmp_path / "iq2.gguf", _encoder(types)).path
    rows = {r["type"]: r for r in type_rows(str(path), ops, rows=(1, 3))}
    present = {t for layer in types.values() for t in layer.values()} | {"F16"}
    assert set(rows) == present
    assert rows["IQ2_XS"]["auto"] == "requant -> Q4_1" and rows["IQ2_XS"]["max |w - file|"] > 0
    assert rows["F16"]["auto"] == "float" and rows["F16"]["activation"] == "float"
    for name, row in rows.items():
        assert row["ms @ 1 rows"] > 0 and row["ms @ 3 rows"] > 0
        if name not in ("IQ2_XS", "F16"):
            assert row["auto"] == f"exact -> {row['auto'].split(' -> ')[1]}" and row["max |w - file|"] == 0, name


def test_pipeline_stages_and_a_draft_model_take_every_type(mixed_file, default_model_path) -> None:
    """pp 2 (each stage packs its own layers' blocks) and the mixed file as its own draft model give the
    one-process greedy tokens."""
    import radixserve

    ids = [[5, 17, 60, 3, 42, 11], [7, 7, 7, 7]]
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for name, extra in {"one": {}, "pp2": {"pp_size": 2},
                        "draft": {"speculative_algorithm": "draft_model", "speculative_draft_model_path": str(mixed_file),
                                  "speculative_num_draft_tokens": 2}}.items():
        with radixserve.Engine(model_path=str(mixed_file), tokenizer_path=default_model_path, max_total_tokens=1024,
                               num_threads=1, show_progress=False, **extra) as eng:
            outs[name] = [o["output_ids"] for o in eng.generate(input_ids=ids, sampling_params=params)]
    assert outs["pp2"] == outs["one"] and outs["draft"] == outs["one"]
