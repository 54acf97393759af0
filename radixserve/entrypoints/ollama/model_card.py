"""GET /api/tags, /api/ps, /api/version and POST /api/show: what Ollama's clients read about the model before
they call it (VS Code's Ollama provider reads the version, then each model's capabilities and context length).

The one served model is listed under each served name with Ollama's `:latest` tag (plus any loaded LoRA
adapter); it is always loaded, so /api/ps lists it too, never expiring. `model_info` carries Ollama's GGUF-style
keys: general.architecture and <architecture>.context_length / .embedding_length / .vocab_size.
"""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from radixserve.entrypoints.ollama.protocol import (
    ListedModel,
    ModelDetails,
    PsResponse,
    RunningModel,
    ShowResponse,
    TagsResponse,
)
from radixserve.function_call.tool_prompt import template_supports_tools
from radixserve.lora.lora_registry import front_registry

if TYPE_CHECKING:
    from radixserve.entrypoints.http_server import ServerState

# The Ollama API version whose shapes this layer follows. Clients gate features on it (VS Code's provider
# needs >= 0.6.4; `think` came in 0.9); radixserve's own version is in /get_server_info.
OLLAMA_API_VERSION = "0.12.0"
_NEVER = "9999-12-31T23:59:59Z"  # /api/ps: a loaded model here never expires (keep_alive does not apply)


class ModelCards:
    def __init__(self, state: ServerState, thinks: Any) -> None:
        self.state, self.args = state, state.server_args
        self.thinks = thinks  # () -> bool: a reasoning parser splits this template's thinking

    def _family(self) -> str:
        # LlamaForCausalLM -> llama, Qwen3MoeForCausalLM -> qwen3moe: Ollama's (GGUF's) architecture names
        arch = self.state.handle.info.get("architecture") or ""
        for suffix in ("ForCausalLM", "ForSequenceClassification", "Model"):
            arch = arch.removesuffix(suffix)
        return arch.lower() or "unknown"

    def details(self) -> ModelDetails:
        path = self.args.resolved_model_path()
        family = self._family()
        fmt = "gguf" if path.endswith(".gguf") else "safetensors"
        return ModelDetails(format=fmt, family=family, families=[family])

    def _listed(self) -> list[str]:
        """The served names with Ollama's tag ('default' is implied, as /v1/models has it), then the adapters."""
        names = [n for n in self.args.model_names() if n != "default" or n == self.args.model_name()]
        adapters = [] if self.state.tm is None else sorted(front_registry(self.state.tm).names)
        return [n if ":" in n else n + ":latest" for n in names] + adapters

    def _entry(self, name: str) -> dict[str, Any]:
        digest = hashlib.sha256(f"{name}\0{os.path.basename(self.args.resolved_model_path())}".encode()).hexdigest()
        modified = datetime.fromtimestamp(self.state.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"name": name, "model": name, "modified_at": modified, "size": self._size(), "digest": digest,
                "details": self.details()}

    def _size(self) -> int:
        return int(self.state.handle.info.get("weight_bytes") or 0)

    def tags(self) -> TagsResponse:
        return TagsResponse(models=[ListedModel(**self._entry(n)) for n in self._listed()])

    def ps(self) -> PsResponse:
        ctx = int(self.state.handle.info["context_len"])
        return PsResponse(models=[RunningModel(**self._entry(n), expires_at=_NEVER, size_vram=0, context_length=ctx)
                                  for n in self._listed()])

    def capabilities(self) -> list[str]:
        if self.args.is_embedding:
            return ["embedding"]
        caps = ["completion"]
        template = getattr(self.state.tokenizer, "chat_template", None)
        if template and template_supports_tools(template):
            caps.append("tools")
        if self.thinks():
            caps.append("thinking")
        return caps

    def show(self, name: str) -> ShowResponse:
        info = self.state.handle.info
        family = self._family()
        model_info: dict[str, Any] = {
            "general.architecture": family,
            "general.basename": self.args.model_name(),
            f"{family}.context_length": int(info["context_len"]),
            f"{family}.embedding_length": int(info.get("hidden_size") or 0),
            f"{family}.vocab_size": int(info.get("vocab_size") or 0),
        }
        template = getattr(self.state.tokenizer, "chat_template", None) or ""
        modified = datetime.fromtimestamp(self.state.created, timezone.utc).isoformat().replace("+00:00", "Z")
        return ShowResponse(modelfile=f"# served by radixserve\nFROM {name}\n",
                            parameters=f"num_ctx {int(info['context_len'])}", template=template,
                            details=self.details(), model_info=model_info, capabilities=self.capabilities(),
                            modified_at=modified)
