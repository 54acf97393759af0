"""GGUF tokenizers built from metadata written in the test: any architecture, SentencePiece against the
`sentencepiece` library itself, and every truncated or lying key refused with a ValueError naming it.
"""

from __future__ import annotations

import io
from typing import Any

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.model_loader.gguf_file import open_gguf

pytestmark = pytest.mark.usefixtures("gguf_cache_dir")  # a private cache: built, saved and read back here
TT = gguf.TokenType


# --- any architecture ----------------------------------------------------------------------------------

_COPIED_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def test_an_architecture_transformers_refuses_loads_its_tokenizer(load_gguf_tokenizer, tmp_path, default_model_path,
                                                                  tokenizer, write_vocab_gguf) -> None:
    """SmolLM2's vocabulary under `general.architecture = olmoe`: transformers refuses the file, we build
    the same tokenizer as for the original file."""
    src = open_gguf(default_model_path)
    meta = {key: src.get(key) for key in _COPIED_KEYS}
    path = write_vocab_gguf(tmp_path / "olmoe.gguf", "olmoe", meta)
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="architecture olmoe is not supported"):
        AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    tok = load_gguf_tokenizer(str(path))
    assert len(tok) == len(tokenizer) and tok.chat_template == tokenizer.chat_template
    for text in ("Hello world", "<|im_start|>user\nx ** 12 ½<|im_end|>\n", "naïve 🤖\t\t  end  "):
        assert tok.encode(text) == tokenizer.encode(text)
        assert tok.decode(tok.encode(text)) == text


# --- SentencePiece, against the sentencepiece library --------------------------------------------------

_TRAINING_TEXT = """The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def tokenize(text):\n    return [piece for piece in text.split()]  # split on whitespace
Numbers like 12345 and 3.14159 appear in tables; so do dates such as 2026-12-03.
Über naïve façades, résumé coöperation — smart “quotes” and ‘apostrophes’ too.
<tool> calls come between the user and the model; the model answers after <tool> output.
""" * 8


def _sentencepiece(remove_extra_whitespaces: bool):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_TRAINING_TEXT.splitlines()), model_writer=model, model_type="bpe",
        vocab_size=420, byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False,
        normalization_rule_name="identity", remove_extra_whitespaces=remove_extra_whitespaces,
        user_defined_symbols=["<tool>"], control_symbols=["<ctl>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _spm_meta(sp, remove_extra_whitespaces: bool) -> dict[str, Any]:
    """What llama.cpp's converter writes for a SentencePiece model (`_create_vocab_sentencepiece`)."""
    def kind(i: int) -> int:
        for test, token_type in ((sp.is_unknown, TT.UNKNOWN), (sp.is_control, TT.CONTROL),
                                 (sp.is_unused, TT.UNUSED), (sp.is_byte, TT.BYTE)):
            if test(i):
                return int(token_type)
        return int(TT.USER_DEFINED) if sp.id_to_piece(i) == "<tool>" else int(TT.NORMAL)

    n = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
            "tokenizer.ggml.token_type": [kind(i) for i in range(n)], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_space_prefix": True, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.remove_extra_whitespaces": remove_extra_whitespaces}


@pytest.fixture(scope="module", params=[False, True], ids=["keep-spaces", "remove-extra-spaces"])
def spm_pair(request, tmp_path_factory, write_vocab_gguf, load_gguf_tokenizer):
    sp = _sentencepiece(request.param)
    path = write_vocab_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "olmoe", _spm_meta(sp, request.param))
    import os
    os.environ["RADIXSERVE_NO_GGUF_CACHE"] = "1"  # module scope: outside gguf_cache_dir's reach
    try:
        return sp, load_gguf_tokenizer(str(path))
    finally:
        del os.environ["RADIXSERVE_NO_GGUF_CACHE"]


_SPM_TEXT = st.lists(st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=10),
    st.sampled_from(["the ", " quick", "  ", " ", "12345", "naïve", "def ", "fox.", "—", "🤖", "\n", "\t", "\r\n"]),
), max_size=10).map("".join)


@pytest.mark.parametrize("text", ["The quick brown fox", "  two  spaces  ", "naïve résumé 🤖",
                                  "def f(x):\n    return x", "", "   ", "12345 3.14", "ÿ\u00a0Ω"])
def test_sentencepiece_vocabulary_encodes_like_sentencepiece(spm_pair, text: str) -> None:
    sp, tok = spm_pair
    ids = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.encode(text) == [1, *ids]  # add_bos_token
    assert tok.decode(ids) == sp.decode(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_SPM_TEXT)
def test_sentencepiece_random_text(spm_pair, text: str) -> None:
    sp, tok = spm_pair
    ids = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == sp.decode(ids)


def test_sentencepiece_added_tokens_stay_whole_and_prefix_like_llama_cpp(spm_pair) -> None:
    """A user-defined piece is matched whole; the text after it gets the dummy prefix again (llama.cpp's
    rule: sentencepiece, which sees no added tokens, prefixes only the start)."""
    sp, tok = spm_pair
    tool = sp.piece_to_id("<tool>")
    assert tok.encode("a <tool> b", add_special_tokens=False) == [
        *sp.encode("a "), tool, *sp.encode(" b")]
    assert tok.encode("<ctl>", add_special_tokens=False) == [sp.piece_to_id("<ctl>")]  # control: special
    assert tok.decode(tok.encode("x<ctl>y"), skip_special_tokens=True) == sp.decode(sp.encode("x") + sp.encode("y"))
