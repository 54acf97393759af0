"""One row per GGUF tensor type a file holds: what `--quantization auto` does with it (gguf_formats.FORMATS),
how far its kernel copy is from the file's values, and what its kernel costs. Read by `bench accuracy`
(type_rows) and `bench peer` (type_rows with timings)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from radixserve.layers.quantization.gguf_formats import FORMATS
from radixserve.layers.quantization.qweight import KIND_NAMES, QuantRows, QuantWeight
from radixserve.model_loader.gguf_file import open_gguf


def _kernel_copy(fmt: Any, raw: np.ndarray, values: torch.Tensor) -> QuantWeight | None:
    """What auto packs for one tensor on its own (None: the float path)."""
    if fmt.handling == "exact":
        return QuantWeight.from_rows(fmt.rows(raw))
    if fmt.handling == "requant" and values.shape[1] % 32 == 0:
        return QuantWeight.from_rows(QuantRows.quantize(values, fmt.requant_kind))
    return None


def _time_ms(fn: Any, repeats: int = 5) -> float:
    fn()  # warm-up (and the activation buffers)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def type_rows(path: str, ops: Any = None, rows: tuple[int, ...] = (1, 512)) -> list[dict[str, Any]]:
    """Per tensor type of the GGUF at `path` (2-d tensors: the projections, embeddings, LM head):
    tensors, parameters, handling, kernel kind, activation format, max |w_kernel - w_file| over its
    tensors (0 = exact). With `ops` (torch.ops.radixserve_cpu), the kernel's time on the type's largest
    tensor at each row count in `rows` (the float path: torch's float32 GEMM)."""
    f = open_gguf(path)
    by_type: dict[str, list[Any]] = {}
    for t in f.tensors.values():
        if len(t.shape) == 2:
            by_type.setdefault(t.tensor_type.name, []).append(t)
    out = []
    for name, tensors in sorted(by_type.items()):
        fmt = FORMATS.get(name)
        row: dict[str, Any] = {"type": name, "tensors": len(tensors),
                               "params (M)": round(sum(int(np.prod(t.shape)) for t in tensors) / 1e6, 2)}
        if fmt is None:
            out.append(row | {"auto": "not loadable"})
            continue
        kind = fmt.kind if fmt.handling == "exact" else fmt.requant_kind
        row |= {"auto": fmt.handling if kind is None else f"{fmt.handling} -> {KIND_NAMES[kind]}",
                "activation": fmt.activation}
        drift = 0.0
        largest: tuple[int, Any] = (-1, None)
        for t in tensors:
            n = int(t.shape[1])
            raw = np.array(t.data).reshape(n, -1)
            values = torch.from_numpy(fmt.dequantize(raw).reshape(n, -1))
            qw = _kernel_copy(fmt, raw, values)
            if qw is not None:
                drift = max(drift, float((qw.dequantize() - values).abs().max()))
            if values.numel() > largest[0]:
                largest = (values.numel(), (values, qw))
        row["max |w - file|"] = drift
        if ops is not None and largest[1] is not None:
            values, qw = largest[1]
            row["timed on"] = f"{values.shape[0]}x{values.shape[1]}"
            for m in rows:
                x = torch.randn(m, values.shape[1])
                if qw is None:
                    ms = _time_ms(lambda: torch.nn.functional.linear(x, values))  # noqa: B023
                else:
                    o = torch.empty(m, qw.n)
                    ms = _time_ms(lambda: ops.quant_linear(x, qw.kind, qw.n, qw.data, qw.d, qw.m, None, o))  # noqa: B023
                row[f"ms @ {m} rows"] = round(ms, 3)
        out.append(row)
    return out


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """Every key of the rows, first-seen order (rows of the float path or an unloadable type lack some)."""
    return list(dict.fromkeys(k for r in rows for k in r))
