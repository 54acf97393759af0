"""LoRARegistry: the front end's view of the adapters (names only): what the OpenAI `model` field may
name, and what /v1/models lists. The scheduler's LoRAManager is the authority (a request for an adapter
unloaded between the two checks still gets its 404 there); this view follows every load and unload.

    model = "<base>"            the base model (any served name, or 'default')
    model = "<adapter>"         adapter <adapter> on the base model (vLLM's convention)
    model = "<base>:<adapter>"  the same, naming the base too
"""

from __future__ import annotations

from typing import Any

from radixserve.lora.lora_config import LoRANotFound, parse_lora_paths


class LoRARegistry:
    def __init__(self, lora_paths: tuple[str, ...] | None, enabled: bool) -> None:
        self.enabled = enabled
        self.names: dict[str, str] = dict(parse_lora_paths(lora_paths))  # name -> path

    def resolve_model(self, model: str | None, base_names: list[str]) -> tuple[bool, str | None]:
        """(known, adapter) for an OpenAI `model`: known False = no such model; adapter None = the base.
        LoRANotFound when a `base:adapter` name has a served base but an unknown adapter."""
        if not model or model in base_names:
            return True, None
        if model in self.names:
            return True, model
        base, sep, adapter = model.rpartition(":")
        if sep and base in base_names:
            if adapter in self.names:
                return True, adapter
            raise LoRANotFound(adapter)
        return False, None

    def add(self, name: str, path: str) -> None:
        self.names[name] = path

    def remove(self, name: str) -> None:
        self.names.pop(name, None)


def front_registry(tm: Any) -> LoRARegistry:
    """The registry of a TokenizerManager (made on first use, from its ServerArgs)."""
    reg = getattr(tm, "_lora_registry", None)
    if reg is None:
        args = tm.server_args
        reg = tm._lora_registry = LoRARegistry(args.lora_paths, args.enable_lora)
    return reg
