"""bench serving: an HTTP load generator for any OpenAI-compatible server (radixserve, SGLang, vLLM, ...).

Where `bench one-batch` shows the cost of one step, this shows what a user of the server sees
when the scheduler turns the seed's asymmetry into a policy: prefills (compute-bound) interleave
with batched decodes (memory-bound, nearly free to batch), so TTFT measures queueing + prefill,
TPOT/ITL measure the decode step of a batch that grows with load, and output tokens/s rises with
concurrency until the KV cache (or compute) runs out. shared-prefix and multi-turn workloads show
the radix cache: the cached part of a prompt is not prefilled again (usage.prompt_tokens_details).

Every request streams (SSE) so that the first token's arrival (TTFT) and the gaps between
chunks (ITL) are seen; token counts come from the server's usage (stream_options.include_usage)
when it reports them, else from the tokenizer. The client speaks only the OpenAI API.

    radixserve bench serving --base-url http://127.0.0.1:30000 --dataset random --num-requests 64 \
        --concurrency 16 [--request-rate 4] [--endpoint chat] --json serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from radixserve.bench.common import print_kv, summarize, write_json
from radixserve.bench.datasets import (
    Conversation,
    Turn,
    add_dataset_args,
    build_workload,
    history_messages,
    history_text,
    load_tokenizer,
    workload_summary,
)


@dataclass
class RequestResult:
    ok: bool = False
    conversation: int = 0
    turn: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    usage_from_server: bool = False
    ttft: float = 0.0  # s, request sent -> first non-empty chunk
    e2e: float = 0.0  # s, request sent -> stream finished
    itl: list[float] = field(default_factory=list)  # s between successive non-empty chunks
    text: str = ""
    error: str = ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve bench serving", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (of conversations); inf = all at once")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos / min_tokens (servers that reject unknown fields)")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")
    p.add_argument("--warmup-requests", type=int, default=1, help="short untimed requests first")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-requests", action="store_true", help="keep per-request results in the JSON")
    p.add_argument("--json", default=None)
    p.add_argument("--lora-adapters", nargs="+", default=None, metavar="NAME",
                   help="LoRA adapter mix: conversation i is sent as model NAME[i %% len] (vLLM's convention; "
                   "'base' = the base model); docs/lora.md")
    add_dataset_args(p)
    return p


def make_payload(args: argparse.Namespace, model: str, conv: Conversation, k: int, answers: list[str],
                 max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = history_messages(conv, k, answers)
    else:
        body["prompt"] = history_text(conv, k, answers)
    if not args.no_ignore_eos:
        body.update(ignore_eos=True, min_tokens=max_tokens)
    body.update(args.extra_body)
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool,
                       result: RequestResult) -> RequestResult:
    """POST one streaming request; fill `result` with its timings, text and usage."""
    start = last = time.perf_counter()
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return result
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:300]
                    return result
                now = time.perf_counter()
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if not pieces:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        pieces.append(piece)
                        last = now
                usage = chunk.get("usage")
                if usage:
                    result.usage_from_server = True
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        result.e2e = time.perf_counter() - start
        result.text = "".join(pieces)
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def model_of_conversation(args: argparse.Namespace, base_model: str, ci: int) -> str:
    """--lora-adapters: requests spread round-robin over the adapters ('base' = the base model)."""
    names = args.lora_adapters
    if not names:
        return base_model
    name = names[ci % len(names)]
    return base_model if name == "base" else name


async def run_benchmark(args: argparse.Namespace, convs: list[Conversation], tokenizer: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    chat = args.endpoint == "chat"
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or await first_model(client, args.base_url)
        for _ in range(args.warmup_requests):  # first-request costs (allocations, thread pools) not timed
            # NOTE: not a workload prompt, so the radix cache holds none of the workload beforehand.
            warm_conv = Conversation([Turn(" This is a warm up request", [], 4)])
            warm = await send_request(client, url, make_payload(args, model, warm_conv, 0, [], 4), chat,
                                      RequestResult())
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        bar = tqdm(total=sum(c.num_requests for c in convs), desc="serving", unit="req", disable=args.disable_tqdm)
        results: list[RequestResult] = []
        skipped = [0]  # later turns of conversations whose earlier turn failed

        async def conversation(ci: int, conv: Conversation, delay: float) -> None:
            await asyncio.sleep(delay)
            answers: list[str] = []
            conv_model = model_of_conversation(args, model, ci)
            for k, turn in enumerate(conv.turns):
                body = make_payload(args, conv_model, conv, k, answers, turn.output_len)
                res = RequestResult(conversation=ci, turn=k)
                if sem is not None:
                    async with sem:
                        await send_request(client, url, body, chat, res)
                else:
                    await send_request(client, url, body, chat, res)
                results.append(res)
                bar.update(1)
                if not res.ok:  # a conversation cannot continue without its answer
                    skipped[0] += len(conv.turns) - k - 1
                    bar.update(len(conv.turns) - k - 1)
                    return
                if not res.usage_from_server:
                    count_with_tokenizer(res, body, tokenizer)
                answers.append(res.text)

        rng = random.Random(args.seed + 1)
        delays, t = [], 0.0
        for _ in convs:
            delays.append(t)
            if args.request_rate != float("inf"):
                t += rng.expovariate(args.request_rate)
        before = await server_time_split(client, args.base_url)
        start = time.perf_counter()
        await asyncio.gather(*(conversation(i, c, d) for i, (c, d) in enumerate(zip(convs, delays))))
        duration = time.perf_counter() - start
        after = await server_time_split(client, args.base_url)
        bar.close()
    split = time_split_report(before, after, duration) if before and after else None
    return {"model": model, "duration_s": duration, "results": results, "skipped": skipped[0], "time_split": split}


async def server_time_split(client: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """radixserve's cumulative time counters (GET /get_server_info); None from any other server."""
    try:
        resp = await client.get(base_url.rstrip("/") + "/get_server_info")
        split = resp.json().get("time_split") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return split if isinstance(split, dict) and "forward_s" in split else None


def time_split_report(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Where the server's time went during the run, as seconds and as fractions of the run's wall time.

    forward: the model's forward alone. Outside it: the rest of each scheduler step (scheduling,
    ForwardBatch building, sampling, stop checks, output packing) plus all the CPU time of the
    HTTP/tokenizer process (parsing, tokenisation, detokenisation, SSE). Their sum over the wall
    time is the "CPU time outside the forward" figure.
    """
    d = {k: after[k] - before[k] for k in after if k in before}
    step, fwd = d.get("step_time_s", 0.0), d.get("forward_s", 0.0)
    out = {
        "wall_s": wall,
        "forward_s": fwd,
        "scheduler_step_s": step,
        "scheduler_outside_forward_s": step - fwd,
        "forward_batch_init_s": d.get("forward_batch_init_s", 0.0),
        "sample_s": d.get("sample_s", 0.0),
        "scheduler_idle_s": max(0.0, wall - step),
        "tokenizer_process_cpu_s": d.get("tokenizer_process_cpu_s", 0.0),
    }
    out["outside_forward_s"] = out["scheduler_outside_forward_s"] + out["tokenizer_process_cpu_s"]
    for key in ("forward_s", "scheduler_outside_forward_s", "tokenizer_process_cpu_s", "outside_forward_s",
                "scheduler_idle_s"):
        out[key.removesuffix("_s") + "_fraction"] = out[key] / wall if wall > 0 else 0.0
    return out


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    try:
        resp = await client.get(base_url.rstrip("/") + "/v1/models")
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


def count_with_tokenizer(res: RequestResult, body: dict[str, Any], tokenizer: Any) -> None:
    """Token counts when the server sent no usage (the chat prompt counted with the chat template)."""
    if "messages" in body:
        prompt_ids = tokenizer.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
        res.prompt_tokens = len(prompt_ids)
    else:
        res.prompt_tokens = len(tokenizer.encode(body["prompt"], add_special_tokens=False))
    res.output_tokens = len(tokenizer.encode(res.text, add_special_tokens=False))


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    metrics: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "usage_from_server": all(r.usage_from_server for r in ok) if ok else False,
        "request_throughput": len(ok) / duration,
        "input_throughput": n_in / duration,
        "output_throughput": n_out / duration,
        "total_throughput": (n_in + n_out) / duration,
        # mean requests in flight (Little's law): sum of latencies / wall time
        "concurrency": sum(r.e2e for r in ok) / duration,
    }
    for name, values in (("ttft_ms", [r.ttft for r in ok]), ("tpot_ms", tpot), ("itl_ms", itl),
                         ("e2e_latency_ms", [r.e2e for r in ok])):
        metrics[name] = summarize(values, 1e3)
    metrics["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return metrics


def report(metrics: dict[str, Any], title: str) -> None:
    flat = {k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        for stat in ("mean", "median", "p99"):
            flat[f"{stat} {name}"] = metrics[name][stat]
    print_kv(flat, title=title)
    for err in metrics["errors"]:
        print(f"error: {err}")


def main(argv: list[str] | None = None, tokenizer: Any = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    tokenizer = tokenizer or load_tokenizer(args.tokenizer)
    convs = build_workload(args, tokenizer)
    run = asyncio.run(run_benchmark(args, convs, tokenizer))
    metrics = compute_metrics(run["results"], run["duration_s"])
    metrics["skipped"] = run["skipped"]
    if run["time_split"] is not None:
        metrics["server_time_split"] = run["time_split"]
    out = {
        "benchmark": "serving",
        "base_url": args.base_url,
        "model": run["model"],
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "api_key")},
        "workload": workload_summary(convs),
        "metrics": metrics,
    }
    if args.save_requests:
        out["requests"] = [{k: v for k, v in asdict(r).items() if k != "text"} for r in run["results"]]
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    report(metrics, f"serving: {args.dataset} via {path} at {args.base_url} ({run['model']})")
    if run["time_split"] is not None:
        print_kv(run["time_split"], title="server time split (radixserve /get_server_info)")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
