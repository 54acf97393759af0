"""The scheduler's readahead of the model file: advice on a thread, and nothing where it has nothing to do."""

from __future__ import annotations

import os

import pytest

from radixserve.model_loader import readahead


def test_a_file_is_advised_in_on_a_thread(tmp_path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(1 << 20))
    thread = readahead.start_readahead(str(f))
    assert thread is not None and thread.daemon
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("kind", ["folder", "missing"])
def test_a_folder_or_a_missing_path_is_left_to_the_loader(tmp_path, kind) -> None:
    path = tmp_path if kind == "folder" else tmp_path / "nope.gguf"
    assert readahead.start_readahead(str(path)) is None


def test_a_file_over_half_the_available_memory_is_not_read_ahead(tmp_path, monkeypatch) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(readahead, "available_memory", lambda: 8191)  # the file is more than half of it
    assert readahead.start_readahead(str(f)) is None
    monkeypatch.setattr(readahead, "available_memory", lambda: 8192)
    thread = readahead.start_readahead(str(f))
    assert thread is not None
    thread.join(10)


def test_an_unreadable_file_is_a_quiet_no_op(tmp_path) -> None:
    """The loader names an unreadable file; the readahead must neither raise nor hang on it."""
    f = tmp_path / "model.gguf"
    f.write_bytes(b"\0" * 4096)
    f.chmod(0)
    thread = readahead.start_readahead(str(f))  # root may still open it: either way, no error
    if thread is not None:
        thread.join(10)
        assert not thread.is_alive()


def test_the_weight_cache_is_read_instead_of_the_model_where_it_exists(tmp_path, monkeypatch) -> None:
    """A start that will map the packed layers (model_loader/weight_cache.py) reads little of the model file."""
    from radixserve.model_loader.gguf_cache import cache_entry

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("RADIXSERVE_NO_GGUF_CACHE", raising=False)
    f = tmp_path / "model.gguf"
    f.write_bytes(b"\0" * 4096)
    entry = cache_entry(str(f))
    assert readahead.files_to_read(str(f), entry) == [str(f)]
    os.makedirs(entry.folder)
    packed = [entry.file("weights-abc-0-0.bin"), entry.file("weights-abc-1-0.bin")]
    for p in packed + [entry.file("weights-abc-0-0.json")]:
        open(p, "wb").close()
    assert readahead.files_to_read(str(f), entry) == packed
    assert readahead.files_to_read(str(f), None) == [str(f)]  # --disable-weight-cache: no entry looked up
    thread = readahead.start_readahead(str(f))
    assert thread is not None
    thread.join(10)
