"""Watching a run as users do (issue 32, point 3): one real tiny job, watched three ways.

The module starts a Ray head with the Dashboard (`ray start --head`), a real Prometheus server that scrapes
the cluster through the config and service-discovery file Ray writes for it, and submits the tiny job with
`ray job submit`. While it runs, the fixture polls the Dashboard's HTTP API as the Dashboard's web page does.
Then:

1. the Dashboard listed the job and the run's named actors, alive while it ran;
2. every query of deploy/grafana/mazerl.json, its variables filled in as Grafana does, answers with data from
   Prometheus over the run's window (GPU queries excepted on a machine without a GPU, named below);
3. the run's HTML report renders in headless Chromium with every image loaded; its screenshot is kept
   (`report.png` in the test's tmp dir, and in $MAZERL_TEST_ARTEFACTS when set).

Needs prometheus, chromium and chromedriver (scripts/install_watch_tools.sh): skipped without them, failed
without them when MAZERL_REQUIRE_WATCH=1 (CI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.observe.watch_tools import (
    Browser,
    PrometheusServer,
    RayHead,
    dashboard_targets,
    grafana_substitute,
    regex_escape,
    tools_or_skip,
    until,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "mazerl.json"
ACTORS = ("rollout-0", "rollout-1", "trainer-0", "trainer-1", "evaluator", "consolidator")
SCRAPE_S = 2
JOB_TIMEOUT_S = 900  # about 1.5 minutes alone; the 2-core machine may be busy with other Ray clusters
# Small like tests/driver/test_loop.py's FAST: two steps, an eval at the start and at step 2, a checkpoint.
OVERRIDES = [
    "train.max_steps=2",
    "train.mazes_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_turns=9",
    "rollout.max_new_tokens=8",
    "eval.num_mazes=4",
    "eval.eval_interval=2",
    "checkpoint.ckpt_interval=2",
    "checkpoint.hf_save_interval=1",
    "placement.cpus_per_bundle=0.5",
    "metrics.progress_bar=false",
    "metrics.prometheus=true",
]
# Grafana's built-in variables, as Grafana would set them for a panel of this short run.
BUILTIN = {"__rate_interval": "1m", "__interval": f"{SCRAPE_S}s", "__interval_ms": str(SCRAPE_S * 1000)}
# Queries that may answer with nothing, and why; each is checked to answer with nothing (no stale excuses).
GPU_METRICS = ("ray_node_gram_used", "ray_node_gram_available", "ray_component_gpu_memory_mb")
NO_GPU_REASON = "GPU memory: the Ray node has no GPU, so Ray's reporter agent exports no GPU gauges"
PEAK_METRICS = ("_mfu", "_floor_s")
NO_PEAK_REASON = "utilisation: a CPU has no peak FLOP/s to measure a phase against, so the run exports none"


@dataclass
class Snapshot:
    at: float
    job_status: str | None  # the job's status in the Dashboard's job list, None when not listed
    actors: dict[str, str]  # actor name -> state, from the Dashboard's state API


@dataclass
class WatchedRun:
    ray: RayHead
    prometheus: PrometheusServer
    run_name: str
    run_dir: Path
    submission_id: str
    started: float
    finished: float
    snapshots: list[Snapshot] = field(default_factory=list)
    job: dict = field(default_factory=dict)


def _job_entry(ray: RayHead, submission_id: str) -> dict | None:
    return next((j for j in ray.api("/api/jobs/") if j.get("submission_id") == submission_id), None)


def _actor_states(ray: RayHead) -> dict[str, str]:
    answer = ray.api("/api/v0/actors?limit=10000&timeout=20", timeout=30)
    assert answer["result"], answer.get("msg")
    states: dict[str, str] = {}
    for actor in answer["data"]["result"]["result"]:
        name = actor.get("name")
        if name and states.get(name) != "ALIVE":  # a name re-used after a recovery: alive wins
            states[name] = actor["state"]
    return states


def _polled(call, *args):
    """One poll of the Dashboard; None when it did not answer in time (a busy machine): the next poll retries."""
    try:
        return call(*args)
    except Exception:  # noqa: BLE001
        return None


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory):
    tools_or_skip()
    work = tmp_path_factory.mktemp("watch")
    run_name = f"watch-{uuid.uuid4().hex[:8]}"
    submission_id = f"mazerl-{run_name}"
    ray = RayHead(num_cpus=2)
    prometheus = None
    try:
        ray.start()
        ray_config = ray.session_dir / "metrics" / "prometheus" / "prometheus.yml"
        until("Ray writing its Prometheus config", ray_config.exists, 60)
        prometheus = PrometheusServer(ray_config, work / "prometheus", scrape_interval_s=SCRAPE_S)
        for sd_file in prometheus.sd_files:  # Ray's service-discovery file, from Ray's own config
            until(f"Ray writing {sd_file}", Path(sd_file).exists, 60)
        prometheus.start()
        # scraping must cover the whole run: wait for this node's metrics export port to be scraped
        until(
            "Prometheus scraping Ray's metrics export port",
            lambda: any(t["labels"]["instance"].endswith(f":{ray.metrics_port}") for t in prometheus.targets_up()),
            120,
            period_s=SCRAPE_S,
        )

        started = time.time()
        submit = ray.cli(
            "job",
            "submit",
            "--address",
            ray.dashboard_url,
            "--submission-id",
            submission_id,
            "--working-dir",
            ".",
            "--no-wait",
            "--",
            "python",
            "-m",
            "app.main",
            "tests/tiny.yaml",
            f"output_dir={work / 'runs'}",
            f"run_name={run_name}",
            *OVERRIDES,
            cwd=ROOT,
            timeout=300,
        )
        assert submit.returncode == 0, submit.stdout[-2000:] + submit.stderr[-2000:]

        snapshots: list[Snapshot] = []
        job = None
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while True:
            listed, actors = _polled(_job_entry, ray, submission_id), _polled(_actor_states, ray)
            job = listed or job
            snapshots.append(Snapshot(time.time(), listed and listed["status"], actors or {}))
            if job and job["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            assert time.monotonic() < deadline, f"the job did not end within {JOB_TIMEOUT_S} s"
            time.sleep(2)
        finished = time.time()
        logs = ray.cli("job", "logs", "--address", ray.dashboard_url, submission_id).stdout
        assert job["status"] == "SUCCEEDED", f"{job['status']}: {job.get('message')}\n{logs[-4000:]}"
        time.sleep(3 * SCRAPE_S)  # the last samples of the run, scraped
        yield WatchedRun(
            ray, prometheus, run_name, work / "runs" / run_name, submission_id, started, finished, snapshots, job
        )
    finally:
        if prometheus is not None:
            prometheus.stop()
        ray.stop()


def test_ray_dashboard_lists_the_job_and_its_actors(watched_run):
    """While the job ran, the Dashboard's job list showed it RUNNING and its state API showed the six named actors
    alive; after it, the job list shows it SUCCEEDED with its entrypoint."""
    run = watched_run
    running = [s for s in run.snapshots if s.job_status == "RUNNING"]
    assert running, f"the Dashboard never listed the job as RUNNING: {[s.job_status for s in run.snapshots]}"
    all_alive = [s for s in running if all(s.actors.get(name) == "ALIVE" for name in ACTORS)]
    seen = {name: sorted({s.actors.get(name) for s in running if name in s.actors}) for name in ACTORS}
    assert all_alive, f"no poll of the running job saw all of {ACTORS} alive; states seen: {seen}"

    job = next(j for j in run.ray.api("/api/jobs/") if j.get("submission_id") == run.submission_id)
    assert job["status"] == "SUCCEEDED" and job["type"] == "SUBMISSION", job
    assert "app.main" in job["entrypoint"] and f"run_name={run.run_name}" in job["entrypoint"], job["entrypoint"]
    assert job["start_time"] and job["end_time"] and job["end_time"] > job["start_time"]
    # the named actors stay listed once the job ended (dead), so a user can look back at them
    after = {name: state for name, state in _actor_states(run.ray).items() if name in ACTORS}
    assert set(after) == set(ACTORS), after


def _variables(run: WatchedRun, dashboard: dict) -> dict[str, str]:
    """The dashboard's template variables, resolved against Prometheus the way Grafana resolves them:
    `label_values(selector, label)` over the run's window, this run picked where the user picks."""
    values = {"DS_PROMETHEUS": "prometheus", **BUILTIN, "__range": f"{int(run.finished - run.started) + 1}s"}
    prom = run.prometheus
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        definition = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition.strip())
        assert match, f"variable {variable['name']}: not a label_values() query: {definition}"
        selector = grafana_substitute(match.group(1), values)
        assert "$" not in selector, f"variable {variable['name']}: unresolved variable in {selector}"
        found = prom.label_values(match.group(2), selector, run.started, run.finished + 10)
        assert found, f"variable {variable['name']}: {definition} found nothing"
        if variable["name"] == "run":
            assert run.run_name in found, found
            values["run"] = regex_escape(run.run_name)
        elif variable["name"] == "session":
            assert found == [run.ray.session_dir.name], found  # this run's metrics come from this Ray session
            values["session"] = regex_escape(found[0])
        else:  # a variable added since this test was written: take what a user would see first
            values[variable["name"]] = regex_escape(sorted(found)[0])
    return values


def _last_value(result: list[dict]) -> float:
    return max(float(series["values"][-1][1]) for series in result)


def test_prometheus_answers_every_grafana_query(watched_run):
    """Each panel query of deploy/grafana/mazerl.json, as Grafana sends it for this run, answers with data."""
    run, prom = watched_run, watched_run.prometheus
    dashboard = json.loads(DASHBOARD.read_text())
    values = _variables(run, dashboard)
    nodes = run.ray.api("/api/v0/nodes?limit=100")["data"]["result"]["result"]
    gpus = sum(n["resources_total"].get("GPU", 0) for n in nodes if n["state"] == "ALIVE")

    targets = dashboard_targets(dashboard)
    assert len(targets) >= 30, f"expected the dashboard's ~40 queries, found {len(targets)}"
    empty, exempt, answers = {}, {}, {}
    for key, title, expr in targets:
        query = grafana_substitute(expr, values)
        assert "$" not in query, f"{title} ({key}): a variable the test does not fill in: {query}"
        result = prom.query_range(query, run.started, run.finished + 10, SCRAPE_S)
        answers[title] = answers.get(title) or result  # the first query of a panel, by the panel's title
        if not any(series["values"] for series in result):
            empty[f"{title} ({key})"] = query
        if not gpus and any(m in expr for m in GPU_METRICS):
            exempt[f"{title} ({key})"] = NO_GPU_REASON
        if not gpus and any(m in expr for m in PEAK_METRICS):
            exempt[f"{title} ({key})"] = NO_PEAK_REASON
    assert set(empty) == set(exempt), (
        f"queries without data: {sorted(set(empty) - set(exempt))}; "
        f"exempted but answered: {sorted(set(exempt) - set(empty))}; the empty queries: {empty}; "
        f"Prometheus targets: {[(t['scrapeUrl'], t['health']) for t in prom.api('targets')['activeTargets']]}"
    )
    assert len(exempt) <= len(targets) // 4, exempt  # the exceptions stay exceptions
    print(f"\n{len(targets) - len(empty)} of {len(targets)} dashboard queries answered; exempted: {exempt}")

    # the values are the run's: the last step and the recorded numbers reach the panels
    log = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max(e["step"] for e in log)
    assert _last_value(answers["Step"]) == last
    assert _last_value(answers["LoRA version"]) == next(e["lora_version"] for e in reversed(log) if "lora_version" in e)
    losses = {round(e["train_loss"], 6) for e in log if "train_loss" in e}
    seen_losses = {round(float(v), 6) for s in answers["Loss"] for _, v in s["values"]}
    assert seen_losses and seen_losses <= losses, (seen_losses, losses)


PROBE = """return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth,
    i.naturalHeight]);"""


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", png[16:24])


def test_report_renders_in_chromium_with_its_images(watched_run, tmp_path):
    """report.html in headless Chromium: every <img> of the page loaded (naturalWidth > 0), the plot and the
    replay among them; a screenshot of the whole page is kept."""
    report = watched_run.run_dir / "report.html"
    assert report.exists(), f"the job wrote no report: {sorted(p.name for p in watched_run.run_dir.iterdir())}"
    in_html = re.findall(r"<img\s[^>]*src=\"([^\"]+)\"", report.read_text())
    assert any(s.endswith(".png") for s in in_html) and any(s.endswith(".gif") for s in in_html), in_html

    browser = Browser(tmp_path / "chromium")
    try:
        browser.start()
        # the probe can fail: a page with a missing image reads naturalWidth 0
        broken = tmp_path / "broken.html"
        broken.write_text('<html><body><img src="missing.png"></body></html>')
        browser.open(broken.as_uri())
        assert until("the broken page loaded", lambda: browser.run(PROBE), 30) == [["missing.png", True, 0, 0]]

        browser.open(report.as_uri())
        images = until("the report's images loaded", lambda: all(i[1] for i in browser.run(PROBE)), 60) and (
            browser.run(PROBE)
        )
        assert [i[0] for i in images] == in_html, images
        not_loaded = [i for i in images if not (i[1] and i[2] > 0 and i[3] > 0)]
        assert not not_loaded, f"images that did not load: {not_loaded}"
        heading = browser.run("return document.querySelector('h1').innerText")
        assert watched_run.run_name in heading, heading

        height = browser.run("return document.documentElement.scrollHeight")
        browser.resize(1280, min(height + 200, 8000))  # the whole page in one screenshot
        png = browser.screenshot_png()
    finally:
        browser.stop()
    width, shot_height = _png_size(png)
    assert width >= 800 and shot_height >= min(height, 8000) - 200, (width, shot_height, height)
    shot = tmp_path / "report.png"
    shot.write_bytes(png)
    artefacts = os.environ.get("MAZERL_TEST_ARTEFACTS")
    if artefacts:
        Path(artefacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artefacts) / "report.png")
    print(f"\nreport screenshot: {shot} ({width}x{shot_height}, Chromium {browser.version})")
