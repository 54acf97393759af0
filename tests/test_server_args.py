"""ServerArgs: every knob validated by name, and the CLI generated from the same dataclass."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from radixserve.server_args import ServerArgs


@pytest.mark.parametrize(
    "field, value",
    [("attention_backend", "flashinfer"), ("linear_backend", "cublas"), ("dtype", "int8"), ("page_size", 0),
     ("device", "tpu"), ("grammar_backend", "outlines"), ("grammar_cache_size", 0), ("grammar_cache_size", 10**12),
     ("grammar_compile_timeout", 0), ("grammar_compile_timeout", 1e9), ("grammar_compile_timeout", float("nan")),
     ("tool_call_parser", "gpt-oss"), ("log_level", "loud"),
     ("ep_size", 0), ("ep_size", 2), ("ep_size", 10**9),  # ep_size must divide tp_size (1 here)
     ("mem_fraction_static", 0.0), ("mem_fraction_static", 1.5), ("mem_fraction_static", float("nan")),
     ("mem_fraction_static", 1e300),
     # images (docs/multimodal.md)
     ("max_images_per_request", -1), ("max_images_per_request", 10**9), ("max_image_bytes", 10**15),
     ("max_image_bytes", 1), ("max_image_pixels", 0), ("max_image_pixels", 10**12), ("max_image_pixels", True),
     ("mm_encoder_cache_mb", -1), ("mm_encoder_cache_mb", 1e12), ("mm_encoder_cache_mb", float("nan")),
     ("allowed_local_media_path", "/no/such/dir"), ("mmproj", "/no/such/file.gguf")],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"ServerArgs.{field}"):
        ServerArgs(**{field: value})


def test_unknown_keyword_is_rejected_by_name():
    with pytest.raises(ValueError, match="attn_backend"):
        ServerArgs.from_kwargs(attn_backend="torch_native")


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--attention-backend", "torch_native", "--linear-backend", "torch", "--page-size", "16"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.attention_backend, args.linear_backend, args.page_size) == ("torch_native", "torch", 16)
    assert ServerArgs.from_cli_args(parser.parse_args([])) == ServerArgs()


def test_served_model_names_and_aliases() -> None:
    from radixserve.server_args import ServerArgs

    args = ServerArgs(served_model_name="smol, smollm2-135m")
    assert args.model_name() == "smol" and args.model_names() == ["smol", "smollm2-135m", "default"]


def test_api_key_from_the_environment(monkeypatch) -> None:
    from radixserve.server_args import API_KEY_ENV, ServerArgs

    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert ServerArgs().api_key == "from-env"
    assert ServerArgs(api_key="flag").api_key == "flag"  # the flag wins


def test_unbuilt_features_are_refused_not_ignored() -> None:
    import pytest

    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="speculative_algorithm"):
        ServerArgs(speculative_algorithm="draft_model")
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        ServerArgs(speculative_num_draft_tokens=10**9)
    with pytest.raises(ValueError, match="node_rank"):
        ServerArgs(node_rank=3)


def test_knobs_that_would_be_ignored_are_refused() -> None:
    """A knob the run would not use is an error naming it, never a silent no-op."""
    # deterministic mode runs its own attention kernel: an explicit backend would be replaced
    for backend in ("cpu_paged", "torch_native"):
        with pytest.raises(ValueError, match="ServerArgs.enable_deterministic_inference.*attention_backend"):
            ServerArgs(enable_deterministic_inference=True, attention_backend=backend)
    assert ServerArgs(enable_deterministic_inference=True).attention_backend == "auto"
    # float weights only: there is no low-bit copy whose steps quant_max_rows could cap
    with pytest.raises(ValueError, match="ServerArgs.quant_max_rows"):
        ServerArgs(quantization="none", quant_max_rows=32)
    assert ServerArgs(quantization="none").quant_max_rows is None
    assert ServerArgs(quantization="auto", quant_max_rows=32).quant_max_rows == 32


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(ServerArgs) if f.type == "bool"])
@pytest.mark.parametrize("value", ["maybe", 3, None])
def test_a_switch_takes_true_or_false_only(name, value) -> None:
    """Every bool knob (--disable-weight-cache among them): a truthy string or number would turn a feature on or
    off silently; it is refused naming the field."""
    with pytest.raises(ValueError, match=rf"ServerArgs\.{name}: must be true or false"):
        ServerArgs.from_kwargs(**{name: value})
