"""GET /metrics: Prometheus text whose counters follow the requests actually served."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "radixserve:"


def _scrape(server) -> dict[str, float]:
    """sample name + sorted labels (model_name dropped) -> value."""
    # behind the API key like every route but /health (Prometheus sends it as a bearer token)
    r = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_follow_requests(server, http) -> None:
    before = _scrape(server)
    for key in ("num_running_reqs", "num_waiting_reqs", "token_usage", "cache_hit_rate", "num_used_tokens"):
        assert f"{PREFIX}{key}{{dp_rank=0}}" in before, key  # scheduler-side gauges: one series per replica
    usages, reasons = [], []
    for max_tokens in (3, 5):
        r = http.post(
            "/v1/completions",
            json={
                "prompt": "Metrics test prompt",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        usages.append(r.json()["usage"])
        reasons.append(r.json()["choices"][0]["finish_reason"])
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
    )
    usages.append(r.json()["usage"])
    reasons.append(r.json()["choices"][0]["finish_reason"])
    after = _scrape(server)

    def delta(name: str) -> float:
        return after.get(PREFIX + name, 0.0) - before.get(PREFIX + name, 0.0)

    assert delta("prompt_tokens_total{}") == sum(u["prompt_tokens"] for u in usages)
    assert delta("generation_tokens_total{}") == sum(u["completion_tokens"] for u in usages)
    assert delta("cached_tokens_total{}") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    for reason in ("stop", "length"):
        assert delta(f"num_requests_total{{finish_reason={reason}}}") == reasons.count(reason)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"{hist}_count{{}}") == 3
        assert delta(f"{hist}_bucket{{le=+Inf}}") == 3
        assert delta(f"{hist}_sum{{}}") > 0
    assert delta("time_per_output_token_seconds_count{}") == sum(u["completion_tokens"] > 1 for u in usages)
    assert after[PREFIX + "num_running_reqs{dp_rank=0}"] == 0
    assert after[PREFIX + "max_total_num_tokens{dp_rank=0}"] > 0
    assert 0 <= after[PREFIX + "cache_hit_rate{dp_rank=0}"] <= 1
