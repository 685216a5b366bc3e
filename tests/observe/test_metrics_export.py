"""MetricsSink → ray.util.metrics → the node's Prometheus endpoint, scraped over HTTP like Prometheus does.

Uses the session's real Ray cluster (tests/conftest.py): the endpoint is the metrics export port of the
driver's node, as ray.nodes() reports it. Ray's agent exports on a period, so the scrape is polled.
"""

from __future__ import annotations

import time
import urllib.request
import uuid

import pytest
from ray.util.metrics import Gauge

from app.observe.metrics import EXPORTED, MetricsSink, prometheus_name, ray_metric_name, read_log

POLL_S = 45  # Ray reports every few seconds; a busy 2-core machine can be slower


def _metrics_url() -> str:
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"])
    assert node["MetricsExportPort"], "the driver's node has no metrics export port"
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def _scrape(url: str, run: str) -> dict[str, list[tuple[dict, float]]]:
    """{metric name: [(labels, value)]} for the samples labelled with this run."""
    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=10).read().decode()
    found: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.labels.get("run") == run:
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def _values(step: int) -> dict:
    """A distinct value per exported metric, different between the two steps."""
    return {name: (100.0 if step == 1 else 0.0) + i + 0.25 for i, name in enumerate(sorted(EXPORTED)) if name != "step"}


def test_names():
    assert ray_metric_name("train_kl") == "mazerl_train_kl"
    assert prometheus_name("train_kl") == "ray_mazerl_train_kl"
    assert prometheus_name("time.rollout-s") == "ray_mazerl_time_rollout_s"
    assert "time_checkpoint_s" in EXPORTED
    for key in (
        "eval_solve_rate",
        "eval_solvable_bound",
        "rollout_solve_rate",
        "rollout_reward_mean",
        "train_loss",
        "train_kl",
        "train_clip_fraction",
        "train_entropy",
        "train_grad_norm",
        "rollout_generated_tokens_per_s",
        "time_rollout_s",
        "time_train_s",
        "time_sync_s",
        "time_eval_s",
        "time_step_s",
        "lora_version",
        "recoveries",
        "checkpoint_age_steps",
    ):
        assert key in EXPORTED, key


def test_every_exported_metric_can_be_made_a_ray_gauge():
    """Ray encodes a metric's description as ASCII: one other character and that gauge, and with it the export of
    every metric, fails."""
    for name, description in EXPORTED.items():
        assert description.isascii(), (name, [c for c in description if not c.isascii()])
        Gauge(ray_metric_name(name), description=description, tag_keys=("run",))


def test_metrics_reach_prometheus(ray_cluster, tmp_path):
    run = f"export-test-{uuid.uuid4().hex[:8]}"
    sink = MetricsSink(tmp_path, run, total_steps=2, prometheus=True, progress_bar=False)
    sink.record(1, {**_values(1), "not_exported": 5.0, "locations": ["x"], "flag": True})
    second = {**_values(2), "eval_solve_rate": float("nan")}  # not finite: skipped, the step-1 value stays
    sink.record(2, second)
    sink.close()
    log = read_log(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in log] == [1, 2] and log[0]["locations"] == ["x"]

    expected = {prometheus_name(k): v for k, v in second.items()} | {
        prometheus_name("step"): 2.0,
        prometheus_name("eval_solve_rate"): _values(1)["eval_solve_rate"],
    }
    assert set(expected) == {prometheus_name(k) for k in EXPORTED}
    url = _metrics_url()
    deadline, found, wrong = time.monotonic() + POLL_S, {}, {}
    while time.monotonic() < deadline:
        found = _scrape(url, run)
        wrong = {
            name: found.get(name)
            for name, value in expected.items()
            if not found.get(name) or any(v != pytest.approx(value) for _, v in found[name])
        }
        if not wrong:
            break
        time.sleep(1.0)
    assert not wrong, f"missing or stale on {url}: {sorted(wrong)[:8]} (found {sorted(found)[:8]})"
    assert not any(name.startswith(prometheus_name("not_exported")) or "flag" in name for name in found)
    labels = found[prometheus_name("train_kl")][0][0]
    assert labels["run"] == run
