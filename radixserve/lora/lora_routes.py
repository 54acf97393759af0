"""POST /load_lora_adapter and /unload_lora_adapter (SGLang's routes; vLLM's /v1/ spellings too).

    load:    {"lora_name": "sql", "lora_path": "/adapters/sql"}   -> every replica reads and checks it
    unload:  {"lora_name": "sql"}  -> new requests for it get a 404 at once; the call answers when the
             requests already using it have finished (their weights go then)

Names follow lora_config.check_adapter_name (no '/', no '..': a 400); with --lora-dir, a path must lie
inside that folder once resolved (symlinks included), else a 400.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.entrypoints.openai_protocol import _Request
from radixserve.entrypoints.openai_serving import APIError, parse_body
from radixserve.lora.lora_config import check_adapter_name
from radixserve.lora.lora_registry import front_registry
from radixserve.managers.io_struct import LoRAControlReq, RpcOutput

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

UNLOAD_POLL_S = 0.05
UNLOAD_WAIT_S = 3600.0  # the longest an unload call waits for the adapter's requests (each has its own bounds)


class LoadLoRARequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(_Request):
    lora_name: str


async def lora_control(tm: Any, op: str, name: str = "", path: str | None = None,
                       uids: list[int] | None = None) -> list[dict[str, Any]]:
    """One control call to every replica; the first refusal is raised as an APIError."""
    answers: list[RpcOutput] = await tm._rpc(
        lambda i, k: LoRAControlReq(rpc_id=i, op=op, name=name, path=path, uid=uids[k] if uids else 0), f"lora {op}")
    for a in answers:
        if not a.ok:
            status = a.data.get("status", 400)
            raise APIError(status, a.data["error"], "lora_name" if status == 404 else "lora_path",
                           "lora_not_found" if status == 404 else "invalid_lora")
    return [a.data for a in answers]


def check_lora_path(path: str, lora_dir: str | None) -> str:
    """The path to read; with --lora-dir it must resolve inside that folder."""
    if not path or "\x00" in path:
        raise APIError(400, "lora_path: must be a non-empty path", "lora_path")
    if lora_dir is None:
        return path
    root = os.path.realpath(lora_dir)
    full = os.path.realpath(path if os.path.isabs(path) else os.path.join(root, path))
    if os.path.commonpath([root, full]) != root:
        raise APIError(400, f"lora_path: {path!r} is outside --lora-dir {lora_dir!r}", "lora_path", "path_refused")
    return full


def _check_name(name: str) -> None:
    try:
        check_adapter_name(name)
    except ValueError as e:
        raise APIError(400, f"lora_name: {e}", "lora_name", "invalid_lora_name") from None


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    args = state.server_args

    async def load(request: Request) -> Response:
        tm = state.tm_or_503()
        req: LoadLoRARequest = await parse_body(request, LoadLoRARequest)
        _check_name(req.lora_name)
        path = check_lora_path(req.lora_path, args.lora_dir)
        if not args.enable_lora:
            raise APIError(400, "LoRA is not enabled on this server: start it with --enable-lora or --lora-paths",
                           "lora_name", "lora_disabled")
        await lora_control(tm, "load", req.lora_name, path)
        front_registry(tm).add(req.lora_name, path)
        return JSONResponse({"success": True, "message": f"LoRA adapter {req.lora_name!r} loaded",
                             "loaded_adapters": sorted(front_registry(tm).names)})

    async def unload(request: Request) -> Response:
        tm = state.tm_or_503()
        req: UnloadLoRARequest = await parse_body(request, UnloadLoRARequest)
        _check_name(req.lora_name)
        answers = await lora_control(tm, "unload", req.lora_name)
        front_registry(tm).remove(req.lora_name)
        uids = [a["uid"] for a in answers]
        users = sum(a["users"] for a in answers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UNLOAD_WAIT_S
        while users and loop.time() < deadline:  # the adapter's requests finish; new ones already get 404s
            await asyncio.sleep(UNLOAD_POLL_S)
            users = sum(a["users"] for a in await lora_control(tm, "users", req.lora_name, uids=uids))
        return JSONResponse({"success": True, "message": f"LoRA adapter {req.lora_name!r} unloaded",
                             "in_flight_requests": users, "loaded_adapters": sorted(front_registry(tm).names)})

    for path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
        app.add_api_route(path, load, methods=["POST"])
    for path in ("/unload_lora_adapter", "/v1/unload_lora_adapter"):
        app.add_api_route(path, unload, methods=["POST"])
