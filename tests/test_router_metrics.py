"""The engine's load under the metric names routers read (tokenizer_proc/router_metrics.py): the
Gateway API Inference Extension's queue depth, running requests, KV usage and LoRA adapters, as
vLLM names them, beside the engine's own; and the adapter kept current by the operations."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.config import EngineConfig
from engine.messages import admin as ops
from tokenizer_proc.core import DoorSettings, FrontDoor, door_settings

STATS = {"running": 3, "waiting": 5, "kv_tokens_in_use": 30, "kv_tokens_free": 90}


def samples(door: FrontDoor, stats: dict[str, float]) -> dict[str, tuple[dict, float]]:
    text = door.metrics.render(door.stats(stats)).decode()
    return {
        s.name: (s.labels, s.value)
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("vllm:") or s.name.startswith("mlx_engine_requests_running")
    }


def test_queue_running_and_kv_usage_under_the_names_routers_read():
    got = samples(FrontDoor(DoorSettings("served", 100, 64, 8)), STATS)
    assert got["vllm:num_requests_waiting"] == ({"model_name": "served"}, 5)
    assert got["vllm:num_requests_running"] == ({"model_name": "served"}, 3)
    # NOTE: a fraction (1 = full), under vLLM's current name and the one before it
    assert got["vllm:kv_cache_usage_perc"] == ({"model_name": "served"}, 0.25)
    assert got["vllm:gpu_cache_usage_perc"] == ({"model_name": "served"}, 0.25)
    # NOTE: beside the engine's own, which say the same
    assert got["mlx_engine_requests_running"][1] == 3


def test_no_stats_yet_is_an_empty_engine_not_an_error():
    got = samples(FrontDoor(DoorSettings("served", 100, 64, 8)), {})
    assert got["vllm:kv_cache_usage_perc"][1] == 0.0
    assert got["vllm:num_requests_waiting"][1] == 0.0


def test_the_lora_adapter_loaded_follows_launch_and_the_operations(tmp_path):
    config = EngineConfig(adapter_path=str(tmp_path / "tuned"))
    door = FrontDoor(door_settings(config, ("served", 100, 64, 4)))
    labels, stamp = samples(door, STATS)["vllm:lora_requests_info"]
    assert labels == {
        "max_lora": "1",
        "running_lora_adapters": "tuned",
        "waiting_lora_adapters": "",
    }
    assert stamp > 1e9  # NOTE: when read: a reader keeps the latest series
    door.operation_sent(ops.LoadAdapter("/a/b/other", "other"))
    door.operation_done(ops.LoadAdapter("/a/b/other", "other"), {"lora_adapter": "other"})
    assert samples(door, STATS)["vllm:lora_requests_info"][0]["running_lora_adapters"] == "other"
    door.operation_done(ops.UnloadAdapter(), {"lora_adapter": None, "paused": False})
    assert samples(door, STATS)["vllm:lora_requests_info"][0]["running_lora_adapters"] == ""
    door.operation_done(ops.LoadAdapter("/x", "x"), None)  # NOTE: a failed one changes nothing
    assert samples(door, STATS)["vllm:lora_requests_info"][0]["running_lora_adapters"] == ""
