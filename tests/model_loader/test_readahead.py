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
