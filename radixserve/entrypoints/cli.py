"""`radixserve serve | generate | inspect | bench ...` (also `python -m radixserve ...`).

Every ServerArgs knob is a flag of `serve` and `generate`, generated from the dataclass.
"""

from __future__ import annotations

import argparse
import json
import sys

from radixserve.debug.inspect import inspect_trace
from radixserve.process_exit import run_then_exit
from radixserve.server_args import ServerArgs

# `radixserve bench NAME` -> radixserve.bench.MODULE
BENCHMARKS = {"roofline": "roofline", "one-batch": "one_batch", "serving": "serving", "serving-peer": "serving_peer",
              "offline": "offline", "baseline": "baseline", "peer": "peer", "accuracy": "accuracy",
              "speculative": "speculative", "grammar": "grammar", "dashboard": "dashboard", "dp": "data_parallel",
              "collectives": "collectives", "embeddings": "embeddings", "lora": "lora_serving", "moe": "moe",
              "scale": "scale", "hicache": "hicache", "kv-capacity": "kv_capacity",
              "kv-accuracy": "kv_accuracy", "vision": "vision"}


def _serve(args: argparse.Namespace) -> None:
    from radixserve.entrypoints.launch_server import launch_server  # lazy: the serve path only

    # a stopped server leaves at once (process_exit.py): its scheduler processes are already gone
    run_then_exit(launch_server, ServerArgs.from_cli_args(args))


def _generate(args: argparse.Namespace) -> None:
    from radixserve.entrypoints.engine import Engine  # lazy: torch only for `generate`, not `--help`

    server_args = ServerArgs.from_cli_args(args)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        params["seed"] = args.seed
    kwargs = {k: getattr(server_args, k) for k in server_args.__dataclass_fields__}
    with Engine(**kwargs) as engine:
        prompt = args.prompt
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        if args.stream:
            for chunk in engine.generate(prompt, params, stream=True):
                sys.stdout.write(chunk["text"])
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            out = engine.generate(prompt, params)
            print(out["text"])
            if args.verbose:
                print(json.dumps(out["meta_info"], indent=2), file=sys.stderr)


def _inspect(args: argparse.Namespace) -> None:
    inspect_trace(args.file, limit=args.limit, show_tokens=args.tokens)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (also what tests/test_docs.py checks every documented command against)."""
    parser = argparse.ArgumentParser(prog="radixserve", description="LLM serving engine on PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    ServerArgs.add_cli_args(serve)
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="generate text for one prompt (offline Engine)")
    ServerArgs.add_cli_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--stream", action="store_true")
    gen.add_argument("--verbose", action="store_true", help="print meta_info to stderr")
    gen.set_defaults(func=_generate)

    insp = sub.add_parser("inspect", help="summarise a --trace-batches file step by step")
    insp.add_argument("file")
    insp.add_argument("--limit", type=int, default=None, help="show at most N steps")
    insp.add_argument("--tokens", action="store_true", help="also print input_ids / out_cache_loc")
    insp.set_defaults(func=_inspect)

    bench = sub.add_parser("bench", help=f"benchmarks: {' | '.join(BENCHMARKS)}")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=lambda a: _bench(a.name, a.rest))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


def _bench(name: str, rest: list[str]) -> None:
    import importlib

    module = BENCHMARKS.get(name.replace("_", "-"))
    if module is None:
        raise SystemExit(f"unknown benchmark {name!r}: {' | '.join(BENCHMARKS)}")
    importlib.import_module(f"radixserve.bench.{module}").main(rest)


if __name__ == "__main__":
    main()
