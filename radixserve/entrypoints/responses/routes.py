"""SCAFFOLD: to be filled (see entrypoints/surfaces.py)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

SCHEMA_MODELS: list[Any] = []


def make_servings(tm: Any, args: Any, metrics: Any, servings: dict[str, Any]) -> dict[str, Any]:
    return {}


def add_routes(app: FastAPI, state: Any, servings: dict[str, Any]) -> None:
    return None
