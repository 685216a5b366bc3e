"""deploy/grafana/mazerl.json: a well-formed Grafana dashboard whose queries name only metrics that exist.

mazerl metrics must be ones app/observe/metrics.py exports (EXPORTED through prometheus_name); Ray's own metrics
must be on an allow-list, each checked against the Ray source installed here (the reporter agent's
gauges, exported under Ray's `ray` namespace).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from app.observe.metrics import EXPORTED, prometheus_name

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "mazerl.json"
DS = "${DS_PROMETHEUS}"

# Ray node/component metrics the dashboard may use (node RAM, GPU RAM, per-actor memory).
RAY_SYSTEM_METRICS = {
    "ray_node_mem_used",
    "ray_node_mem_total",
    "ray_node_gram_used",
    "ray_node_gram_available",
    "ray_component_rss_mb",
    "ray_component_gpu_memory_mb",
}

PROMQL_FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "avg_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "count_over_time",
    "deriv",
    "delta",
    "exp",
    "floor",
    "histogram_quantile",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "log2",
    "log10",
    "max_over_time",
    "min_over_time",
    "predict_linear",
    "quantile_over_time",
    "rate",
    "resets",
    "round",
    "scalar",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev_over_time",
    "sum_over_time",
    "time",
    "timestamp",
    "vector",
    # aggregation operators
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
}
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: every identifier that is not a function call, a keyword,
    a label name (inside {...} or by/without/on/ignoring/group_x (...)), a string, a duration or a variable."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    text = re.sub(r"\$\{[^}]*\}|\$\w+", " ", text)  # Grafana variables
    text = re.sub(r"\{[^{}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # range/subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", r"\1", text)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\(|\s+(?:by|without)\b)?", text):
        word, call = match.group(1), match.group(2)
        if word in PROMQL_KEYWORDS:
            continue
        if call:  # f(...) or an aggregation written `sum by (...) (...)`
            assert word in PROMQL_FUNCTIONS, f"unknown PromQL function {word!r} in {expr!r}"
        else:
            names.add(word)
    return names


def exported_names() -> set[str]:
    return {prometheus_name(name) for name in EXPORTED}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels of collapsed rows
    return out


def _targets(dashboard: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _panels(dashboard) if p["type"] != "row" for t in p["targets"]]


def test_parser():
    assert metric_names('max by (run) (ray_mazerl_train_kl{run=~"$run", x="a{b}"})') == {"ray_mazerl_train_kl"}
    assert metric_names("sum without (ip) (rate(foo_total[5m] offset 1h)) / on() group_left(a, b) bar") == {
        "foo_total",
        "bar",
    }
    assert metric_names('sum(ray_node_gram_used{SessionName=~"$session"}) * 1024 * 1024 + 1e3') == {
        "ray_node_gram_used"
    }
    assert metric_names("a and b unless c or d > bool 1") == {"a", "b", "c", "d"}
    assert metric_names("max(x) by (ip) + topk by (run) (3, y)") == {"x", "y"}
    with pytest.raises(AssertionError):
        metric_names("sumx(foo)")


def test_structure(dashboard):
    assert dashboard["schemaVersion"] >= 36 and dashboard["title"] and dashboard["uid"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    run = variables["run"]
    assert run["type"] == "query" and run["datasource"]["uid"] == DS
    query = run["query"]["query"] if isinstance(run["query"], dict) else run["query"]
    match = re.fullmatch(r"label_values\((\w+)(\{[^}]*\})?,\s*run\)", query)
    assert match and match.group(1) in exported_names(), query
    for v in variables.values():
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            assert metric_names(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q)) <= exported_names(), q

    panels = _panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat"}, p["type"]
        assert p["datasource"] == {"type": "prometheus", "uid": DS}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DS and t["expr"].strip(), p["title"]
    titles = " | ".join(p["title"].lower() for p in panels)
    for word in (
        "solve rate",
        "reward",
        "step anatomy",
        "throughput",
        "loss",
        "kl",
        "clip",
        "entropy",
        "grad norm",
        "lora version",
        "recoveries",
        "checkpoint age",
        "node memory",
        "gpu memory",
    ):
        assert word in titles, word


def test_queries_name_only_exported_metrics(dashboard):
    exported, used = exported_names(), set()
    for title, expr in _targets(dashboard):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        unknown = names - exported - RAY_SYSTEM_METRICS
        assert not unknown, f"{title}: {sorted(unknown)} is neither exported by app/observe/metrics.py nor a Ray metric"
        mazerl = {n for n in names if n.startswith(prometheus_name(""))}
        if mazerl:
            assert 'run=~"$run"' in expr, f"{title}: mazerl metrics must be filtered by the run variable: {expr}"
        used |= names
    wanted = {
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
        "time_checkpoint_s",
        "time_step_s",
        "lora_version",
        "recoveries",
        "checkpoint_age_steps",
    }
    assert {prometheus_name(n) for n in wanted} <= used
    assert {"ray_node_mem_used", "ray_node_gram_used"} <= used


def test_ray_metrics_exist_in_ray_source():
    """Each allowed Ray metric is a gauge of Ray's reporter agent, exported with the `ray_` namespace."""
    root = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    agent = (root / "dashboard" / "modules" / "reporter" / "reporter_agent.py").read_text()
    recorder = (root / "_private" / "telemetry" / "open_telemetry_metric_recorder.py").read_text()
    assert re.search(r'^NAMESPACE = "ray"$', recorder, re.M)
    assert 'name=f"{NAMESPACE}_{name}"' in recorder
    for name in RAY_SYSTEM_METRICS:
        bare = name.removeprefix("ray_")
        assert re.search(rf'"{bare}": Gauge\(\s*"{bare}"', agent), f"{name} is not a Ray reporter-agent gauge"
