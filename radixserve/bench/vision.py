"""bench vision: image-encode time and time to first token of a 1-image prompt on a Gemma-3-4B-shaped model,
beside llama.cpp's llama-mtmd-cli on the same pair of files and threads.

bench/vision_files.py writes the pair (a random Q4_K_M gemma3 text GGUF and a float16 mmproj: SigLIP-So400m at
896 pixels, 4,096 patches, the pool to 256 tokens). Each repeat sends a new image (no cache can serve it):

  * radixserve (Engine, --mmproj): the tower's seconds from `/get_server_info`'s mm_encoder_cache.encode_s, and
    the first token's wall time of `generate(max_new_tokens=1)` (image decode and preprocessing, the tower, the
    prefill);
  * llama-mtmd-cli -n 1: the image encode it reports, and the first token's time from its log (its model load is
    not counted; measure_mtmd says how).

    radixserve bench vision --llama-mtmd-cli BIN/llama-mtmd-cli
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from typing import Any

import numpy as np
from PIL import Image

from radixserve.bench.common import machine_info, print_table, write_json
from radixserve.bench.vision_files import vision_files

PROMPT = "<start_of_image>Describe this image in one sentence."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench vision", description=__doc__.split("\n")[0])
    p.add_argument("--llama-mtmd-cli", help="llama.cpp's llama-mtmd-cli (omit: radixserve's figures only)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="out/bench_vision", help="folder for the generated pair of files (~3 GB)")
    p.add_argument("--json", default=None)
    return p


def _image(seed: int, path: str | None = None) -> Image.Image:
    """A photo-sized random image (resized to 896 x 896 by both engines' preprocessing)."""
    img = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (480, 640, 3), dtype=np.uint8))
    if path is not None:
        img.save(path)
    return img


def measure_radixserve(text: str, mmproj: str, threads: int, repeats: int) -> dict[str, float]:
    import radixserve  # lazy: the Engine imports torch

    encode, ttft = [], []
    with radixserve.Engine(
        model_path=text,
        mmproj=mmproj,
        context_length=4096,
        max_total_tokens=4096,
        num_threads=threads,
        show_progress=False,
    ) as eng:
        for k in range(repeats):
            before = eng.get_server_info()["mm_encoder_cache"]["encode_s"]
            img = _image(100 + k)
            t0 = time.perf_counter()
            eng.generate(
                prompt=PROMPT, image_data=[img], sampling_params={"max_new_tokens": 1, "temperature": 0}
            )
            ttft.append(time.perf_counter() - t0)
            encode.append(eng.get_server_info()["mm_encoder_cache"]["encode_s"] - before)
    return {"encode_s": min(encode), "ttft_s": min(ttft)}


_ENCODED = re.compile(r"mtmd batch encoding done in (\d+) ms")
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ", re.MULTILINE)  # llama.cpp's log time: m.ss.mmm.uuu


def _stamp(log: str, marker: str) -> float:
    """Seconds since the start of llama.cpp's log line that holds `marker`."""
    line = next((ln for ln in log.splitlines() if marker in ln), None)
    m = _STAMP.match(line or "")
    if m is None:
        raise SystemExit(f"llama-mtmd-cli's log has no timed line with {marker!r}: {log[-2000:]}")
    mins, secs, ms, us = (int(x) for x in m.groups())
    return mins * 60 + secs + ms / 1e3 + us / 1e6


def measure_mtmd(binary: str, text: str, mmproj: str, threads: int, repeats: int) -> dict[str, float]:
    """llama-mtmd-cli -n 1 (verbose, with its perf lines): the image encode it reports, and the first token's time
    from its "loading model" line (the image file is read next; the weights are loaded by then) to its perf report
    (the image decoded, resized and encoded, the prompt evaluated, one token sampled). The random text file has no
    chat template: Gemma's is named (--chat-template gemma)."""
    encode, ttft = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(repeats):
            img = os.path.join(tmp, f"image{k}.png")
            _image(100 + k, img)
            proc = subprocess.run([binary, "-m", text, "--mmproj", mmproj, "--image", img, "-p",
                                   PROMPT.replace("<start_of_image>", ""), "-n", "1", "-t", str(threads), "--temp", "0",
                                   "--chat-template", "gemma", "--perf", "-v"],
                                  capture_output=True, text=True, timeout=1800, check=False)
            log = proc.stdout + proc.stderr
            enc = _ENCODED.search(log)
            if proc.returncode != 0 or enc is None:
                raise SystemExit(f"llama-mtmd-cli failed ({proc.returncode}): {log[-2000:]}")
            encode.append(float(enc.group(1)) / 1000)
            ttft.append(_stamp(log, "llama_perf_context_print: prompt eval time") - _stamp(log, "main: loading model"))
    return {"encode_s": min(encode), "ttft_s": min(ttft)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    if a.threads < 1 or a.repeats < 1:
        raise SystemExit("--threads and --repeats must be at least 1")
    text, mmproj = vision_files(a.out)
    res: dict[str, Any] = {
        "machine": machine_info(),
        "threads": a.threads,
        "radixserve": measure_radixserve(text, mmproj, a.threads, a.repeats),
    }
    if a.llama_mtmd_cli:
        res["llama.cpp"] = measure_mtmd(a.llama_mtmd_cli, text, mmproj, a.threads, a.repeats)
    rows = [
        {"engine": name, "image encode s": round(r["encode_s"], 2), "TTFT s": round(r["ttft_s"], 2)}
        for name, r in res.items()
        if name in ("radixserve", "llama.cpp")
    ]
    if "llama.cpp" in res:
        rows.append(
            {
                "engine": "llama.cpp / radixserve",
                "image encode s": round(res["llama.cpp"]["encode_s"] / res["radixserve"]["encode_s"], 2),
                "TTFT s": round(res["llama.cpp"]["ttft_s"] / res["radixserve"]["ttft_s"], 2),
            }
        )
    print_table(
        rows,
        title=f"Gemma-3-4B-shaped pair (random weights), 1 image of 640 x 480, threads {a.threads}, "
        f"best of {a.repeats}",
    )
    write_json(a.json, res)
    return res
