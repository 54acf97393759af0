"""On-disk cache of what a GGUF file takes seconds to derive and is small: its config and fast tokenizer.

gguf's reader walks ~98k vocabulary strings (~6 s for the default model) and building the tokenizer from
its metadata takes ~2 s (~6 s for Gemma 3's 262k pieces), in every process that serves a model.
So `$RADIXSERVE_CACHE_DIR/gguf/<key>/` (default `~/.cache/radixserve`) keeps `config.json` (the HF-style
config dict: ModelConfig and any context_length override are rebuilt from it by the uncached code) and
`tokenizer/` (`save_pretrained` output, chat template included): a few MB. Beside them the weight cache
(model_loader/weight_cache.py) keeps the low-bit layers in the kernels' layout, mapped by the next start instead
of repacked; the whole entry never holds more than the file. A float32 copy would be ~7x a Q4 file (CACHE_VERSION
2 kept one; the sweep deletes what is left of it). The key hashes the file's real path, size and mtime,
CACHE_VERSION and the converting libraries' versions, so a changed file or converter misses. Artefacts
are written only after the GGUF validated, under a temporary name then renamed into place; anything
unreadable counts as a miss and is rebuilt. `RADIXSERVE_NO_GGUF_CACHE=1` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Bump whenever what the loader derives from a GGUF changes (names, q/k un-permutation, dequantisation,
# config translation, tokenizer fix-ups): old entries then stop matching.
CACHE_VERSION = 3  # 2: the tokenizer is built from the metadata; 3: no float32 weights

CACHE_DIR_ENV = "RADIXSERVE_CACHE_DIR"
DISABLE_ENV = "RADIXSERVE_NO_GGUF_CACHE"
CONFIG_FILE = "config.json"
TOKENIZER_DIR = "tokenizer"
LEGACY_WEIGHTS_FILE = "weights.safetensors"  # CACHE_VERSION <= 2's float32 weights: swept
_TOKENIZER_CLASS_FILE = "radixserve_class.json"  # [module, class name] of the saved tokenizer
SOURCE_FILE = "source.json"  # which GGUF an entry belongs to, for sweeping dead entries
WEIGHTS_PREFIX = "weights-"  # the packed layers of model_loader/weight_cache.py: weights-<tag>.bin / .json
_TMP_PREFIX = ".tmp-"  # every temporary name starts with this
_STALE_TMP_S = 3600.0  # a temporary this old is a crashed writer's, not a live one's
_CONVERTERS = ("gguf", "transformers", "tokenizers")  # a new version of these may convert differently


@dataclass(frozen=True)
class CacheEntry:
    """The cache folder of one GGUF file version (created on the first write)."""

    folder: str
    source: str
    size: int
    mtime_ns: int

    def file(self, name: str) -> str:
        """Path of artefact `name` inside the entry."""
        return os.path.join(self.folder, name)


def cache_enabled() -> bool:
    """False when RADIXSERVE_NO_GGUF_CACHE is set to a true value (read on every call)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def cache_root() -> str:
    """The folder holding all GGUF cache entries (read from the environment on every call)."""
    base = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
    return os.path.join(base, "gguf")


@functools.lru_cache(maxsize=8)
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def cache_entry(path: str, size: int | None = None, mtime_ns: int | None = None) -> CacheEntry | None:
    """The cache entry for the GGUF at `path`; None when caching is off or the file cannot be stat'ed.

    Pass `size`/`mtime_ns` when the caller already stat'ed the file, so the key matches what it read.
    """
    if not cache_enabled():
        return None
    real = os.path.realpath(path)
    if size is None or mtime_ns is None:
        try:
            stat = os.stat(real)
        except OSError:
            return None  # the loader itself reports the unreadable file
        size, mtime_ns = stat.st_size, stat.st_mtime_ns
    material = json.dumps([real, size, mtime_ns, CACHE_VERSION, *(_version(d) for d in _CONVERTERS)])
    folder = os.path.join(cache_root(), hashlib.sha256(material.encode()).hexdigest())
    return CacheEntry(folder, real, size, mtime_ns)


def _prepare(entry: CacheEntry) -> None:
    """Create the entry folder on its first write, sweeping dead entries and debris while at it."""
    if not os.path.isfile(entry.file(SOURCE_FILE)):
        os.makedirs(entry.folder, exist_ok=True)
        source = {"path": entry.source, "size": entry.size, "mtime_ns": entry.mtime_ns}
        _write_json(entry, SOURCE_FILE, source)
        _sweep_dead_entries(os.path.dirname(entry.folder), keep=entry.folder)
    _sweep_leftovers(entry.folder)


# --- config ---------------------------------------------------------------------------------------


def load_config(entry: CacheEntry) -> dict[str, Any] | None:
    """The cached HF-style config dict, or None when absent or unreadable."""
    try:
        with open(entry.file(CONFIG_FILE), encoding="utf-8") as fh:
            cfg = json.load(fh)["hf_config"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def save_config(entry: CacheEntry, cfg: dict[str, Any]) -> None:
    """Cache the HF-style config dict of a validated GGUF (if JSON carries it unchanged)."""
    try:
        if json.loads(json.dumps(cfg)) != cfg:  # e.g. a tuple would come back a list: warm != cold
            raise ValueError("the config does not survive a JSON round trip")
        _prepare(entry)
        _write_json(entry, CONFIG_FILE, {"cache_version": CACHE_VERSION, "hf_config": cfg})
    except (OSError, TypeError, ValueError) as exc:
        logger.warning("could not cache the GGUF config in %s: %s", entry.folder, exc)


# --- tokenizer ------------------------------------------------------------------------------------


def load_tokenizer(entry: CacheEntry) -> PreTrainedTokenizerBase | None:
    """The cached fast tokenizer, or None when absent or unloadable.

    It is loaded with the class it was saved from rather than AutoTokenizer: that is the exact same
    class, and importing AutoTokenizer's machinery alone costs ~2 s.
    """
    folder = entry.file(TOKENIZER_DIR)
    if not os.path.isdir(folder):
        return None
    try:
        with open(os.path.join(folder, _TOKENIZER_CLASS_FILE), encoding="utf-8") as fh:
            module, name = json.load(fh)
        if module.split(".")[0] != "transformers":  # never import anything else a cache file names
            raise ValueError(f"unexpected tokenizer class {module}.{name}")
        cls = getattr(importlib.import_module(module), name)
        tokenizer = cls.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001  # transformers raises many types for a damaged folder
        logger.warning("ignoring unreadable cached tokenizer in %s: %s", folder, exc)
        return None
    if type(tokenizer) is not cls or not tokenizer.is_fast:
        return None
    tokenizer.name_or_path = os.path.dirname(entry.source)  # what an uncached build reports
    return tokenizer


def save_tokenizer(entry: CacheEntry, tokenizer: PreTrainedTokenizerBase) -> None:
    """Cache a tokenizer (and its class): saved into a temporary folder, then renamed into place."""
    tmp = None
    try:
        _prepare(entry)
        tmp = tempfile.mkdtemp(dir=entry.folder, prefix=_TMP_PREFIX)
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide a shared cache from other users
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, _TOKENIZER_CLASS_FILE), "w", encoding="utf-8") as fh:
            json.dump([type(tokenizer).__module__, type(tokenizer).__qualname__], fh)
        _remove_tree(entry.file(TOKENIZER_DIR))  # a damaged one (we only save after a failed load)
        try:
            os.rename(tmp, entry.file(TOKENIZER_DIR))
        except OSError:
            if not os.path.isdir(entry.file(TOKENIZER_DIR)):
                raise
            # A concurrent writer renamed its copy in first; it is as good as ours.
    except Exception as exc:  # noqa: BLE001  # a failure to cache must never fail the load
        logger.warning("did not cache the tokenizer in %s: %s", entry.folder, exc)
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def weight_files(entry: CacheEntry, suffix: str = ".bin") -> list[str]:
    """The weight cache's files in `entry` (model_loader/weight_cache.py writes them; listed here without torch,
    for the scheduler's readahead and the benchmarks)."""
    try:
        names = os.listdir(entry.folder)
    except OSError:
        return []
    return sorted(os.path.join(entry.folder, n) for n in names if n.startswith(WEIGHTS_PREFIX) and n.endswith(suffix))


# --- housekeeping ---------------------------------------------------------------------------------


def _write_json(entry: CacheEntry, name: str, value: Any) -> None:
    """Write a JSON file into the entry atomically (temporary file + rename)."""
    fd, tmp = tempfile.mkstemp(dir=entry.folder, prefix=_TMP_PREFIX, suffix=".json")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0o600 would hide a shared cache from other users
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(value, fh)
        os.replace(tmp, entry.file(name))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _remove_tree(path: str) -> None:
    """Delete a folder by first renaming it aside, so nobody sees it half-deleted."""
    if not os.path.lexists(path):
        return
    trash = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=_TMP_PREFIX)
    try:
        os.rename(path, os.path.join(trash, "old"))
    except FileNotFoundError:
        pass  # someone else removed it first
    shutil.rmtree(trash, ignore_errors=True)


def _sweep_dead_entries(root: str, keep: str) -> None:
    """Delete entries whose GGUF was deleted or rewritten since (only on a miss: warm loads never pay).

    Without this every rewrite of a model file would strand hundreds of MB of weights.
    """
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        if name.startswith(_TMP_PREFIX):
            continue
        try:  # an old version's float32 weights: up to ~7x the file, never read again
            os.unlink(os.path.join(folder, LEGACY_WEIGHTS_FILE))
        except OSError:
            pass
        if folder == keep:
            continue
        try:  # an entry with no source record yet may be one another process is creating right now
            with open(os.path.join(folder, SOURCE_FILE), encoding="utf-8") as fh:
                source = json.load(fh)
            if not _source_unchanged(source):
                _remove_tree(folder)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable, or removed by a concurrent sweep: leave it


def _source_unchanged(source: dict[str, Any]) -> bool:
    try:
        stat = os.stat(source["path"])
    except FileNotFoundError:
        return False
    return (stat.st_size, stat.st_mtime_ns) == (source["size"], source["mtime_ns"])


def _sweep_leftovers(folder: str) -> None:
    """Delete temporaries a crashed writer left in `folder` (recent ones may belong to a live writer)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if name.startswith(_TMP_PREFIX) and time.time() - os.path.getmtime(path) > _STALE_TMP_S:
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        except OSError:
            continue  # best effort: debris costs disk space, never correctness
