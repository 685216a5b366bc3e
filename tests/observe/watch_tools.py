"""What a user watches a run with, started for real by tests/observe/test_watching.py.

- `RayHead`: `ray start --head` with the Dashboard and a fixed metrics export port, in its own temp dir and on
  free ports (another Ray cluster may run on this machine), stopped by its process group.
- `PrometheusServer`: Debian's /usr/bin/prometheus on a free port, configured from the Prometheus config Ray
  writes for its session (`<session>/metrics/prometheus/prometheus.yml`, which reads Ray's service-discovery
  file `<session>/prom_metrics_service_discovery.json`), with a short scrape interval and temp storage.
- `Browser`: headless Chromium driven by chromedriver over its W3C WebDriver HTTP API (plain urllib).
- `dashboard_targets` and `grafana_substitute`: the Grafana dashboard's queries, with its variables filled in
  the way Grafana does.

scripts/install_watch_tools.sh installs the three programs. Without them `tools_or_skip` skips, unless
MAZERL_REQUIRE_WATCH=1 (CI), then it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.s3_server import free_port, port_open

REQUIRE_ENV = "MAZERL_REQUIRE_WATCH"
TOOLS = ("prometheus", "chromium", "chromedriver")


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def tools_or_skip() -> None:
    missing = missing_tools()
    if missing:
        reason = f"the watch tools are not installed (missing {', '.join(missing)}): run scripts/install_watch_tools.sh"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires them)", pytrace=False)
        pytest.skip(reason)


def http(url: str, body: dict | None = None, method: str | None = None, timeout: float = 30):
    """JSON in, JSON out; an HTTP error's body goes into the exception (WebDriver and Prometheus explain there)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read().decode())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{request.method} {url} -> {e.code}: {e.read().decode(errors='replace')[:2000]}") from e


def until(what: str, attempt, timeout_s: float, alive=None, period_s: float = 1.0):
    """Calls attempt() until it returns something truthy; errors count as 'not yet' until the deadline."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            result = attempt()
            if result:
                return result
        except Exception as e:  # noqa: BLE001 - any failure means "not ready yet" here
            last = e
        time.sleep(period_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:.0f} s (last error: {last})")


def _stop_group(process: subprocess.Popen, grace_s: float = 60) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


# ---------------------------------------------------------------- Ray


class RayHead:
    """A single-node cluster started as a user would, with the Dashboard and Ray's metrics export."""

    def __init__(self, num_cpus: int = 2, env: dict[str, str] | None = None):
        bin_dir = str(Path(sys.executable).parent)  # the venv that has mazerl and ray
        self.ray = f"{bin_dir}/ray"
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "RAY_AUTH_MODE": "disabled",
            **(env or {}),
        }
        self.num_cpus = num_cpus
        self.temp_dir = Path(tempfile.mkdtemp(prefix="rw", dir="/tmp"))  # Ray's socket paths stay short
        self.dashboard_port, self.metrics_port = free_port(), free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 240) -> None:
        ports = {
            "--port": free_port(),
            "--dashboard-port": self.dashboard_port,
            "--metrics-export-port": self.metrics_port,
            # every fixed default port of `ray start --head`: a second cluster on this machine must not collide
            "--ray-client-server-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
        }
        self.process = subprocess.Popen(
            [
                self.ray,
                "start",
                "--head",
                *(f"{flag}={port}" for flag, port in ports.items()),
                "--dashboard-host=127.0.0.1",
                "--include-dashboard=true",
                f"--num-cpus={self.num_cpus}",
                "--block",
                "--disable-usage-stats",
                f"--temp-dir={self.temp_dir}",
            ],
            env=self.env,
            stdout=open(self.temp_dir / "ray-start.log", "wb"),  # noqa: SIM115 - closed when the process ends
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Up means a job runs: the dashboard answers before the node's job agent has registered, and a submit
        # then fails with "No available agent to submit job" (tests/driver/test_job_submit.py).
        until(
            "ray start --head running a job",
            lambda: self.cli("job", "submit", "--address", self.dashboard_url, "--", "true").returncode == 0,
            timeout_s,
            alive=self._check_alive,
            period_s=2,
        )

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            log = (self.temp_dir / "ray-start.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"ray start --head exited with {self.process.returncode}:\n{log}")

    def cli(self, *args: str, timeout: float = 120, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.ray, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)

    @property
    def session_dir(self) -> Path:
        return (self.temp_dir / "session_latest").resolve()

    def api(self, path: str, timeout: float = 30):
        return http(self.dashboard_url + path, timeout=timeout)

    def stop(self) -> None:
        if self.process is not None:
            _stop_group(self.process)  # `ray start --block` stops what it started
        shutil.rmtree(self.temp_dir, ignore_errors=True)


# ---------------------------------------------------------------- Prometheus


class PrometheusServer:
    """Debian's Prometheus scraping a Ray cluster through the config Ray generated for it."""

    def __init__(self, ray_prometheus_yml: Path, workdir: Path, scrape_interval_s: int = 2):
        config = yaml.safe_load(ray_prometheus_yml.read_text())
        # Ray's own config, only faster: a tiny job lasts a minute or two, Ray's default scrape is every 10 s
        interval = f"{scrape_interval_s}s"
        config.setdefault("global", {}).update(
            scrape_interval=interval, evaluation_interval=interval, scrape_timeout=interval
        )
        self.sd_files = [f for job in config["scrape_configs"] for sd in job["file_sd_configs"] for f in sd["files"]]
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> None:
        self.process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.config}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=open(self.workdir / "prometheus.log", "wb"),  # noqa: SIM115 - closed when the process ends
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        until("prometheus ready", lambda: port_open(self.port) and self._ready(), timeout_s, alive=self._check_alive)

    def _ready(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as r:
            return r.status == 200

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-chars:]

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; params with list values repeat (match[])."""
        query = urllib.parse.urlencode(params, doseq=True)
        answer = http(f"{self.url}/api/v1/{path}?{query}")
        assert answer["status"] == "success", answer
        return answer["data"]

    def targets_up(self) -> list[dict]:
        return [t for t in self.api("targets")["activeTargets"] if t["health"] == "up"]

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s}s")["result"]

    def label_values(self, label: str, match: str, start: float, end: float) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": [match], "start": f"{start:.3f}", "end": f"{end:.3f}"})

    def stop(self) -> None:
        if self.process is not None:
            _stop_group(self.process, grace_s=30)


# ---------------------------------------------------------------- Grafana's queries


def dashboard_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # panels of collapsed rows
    return out


def dashboard_targets(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel id and refId, panel title, expr) of every query of every panel."""
    return [
        (f"{p['id']}{t.get('refId', '?')}", p["title"], t["expr"])
        for p in dashboard_panels(dashboard)
        if p.get("type") != "row"
        for t in p.get("targets", [])
        if t.get("expr", "").strip() and not t.get("hide")
    ]


def regex_escape(value: str) -> str:
    """How Grafana writes one selected value of a multi-value variable into a Prometheus regex matcher
    (prometheusSpecialRegexEscape): a backslash before regex specials, doubled inside a PromQL string."""
    return re.sub(r"([\\^$*+?.()|\[\]{}'])", r"\\\\\1", value)


def grafana_substitute(expr: str, values: dict[str, str]) -> str:
    """Replaces $name, ${name} and ${name:format} with values[name] (longest names first)."""
    for name in sorted(values, key=len, reverse=True):
        expr = re.sub(rf"\$\{{{re.escape(name)}(?::\w+)?\}}|\${re.escape(name)}\b", lambda _: values[name], expr)
    return expr


# ---------------------------------------------------------------- Chromium through chromedriver


CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",  # required as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)


class Browser:
    """chromedriver on a free port and one headless Chromium session, over the W3C WebDriver HTTP API."""

    def __init__(self, workdir: Path, width: int = 1280, height: int = 900):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.size = (width, height)
        self.process: subprocess.Popen | None = None
        self.session: str | None = None

    def start(self, timeout_s: float = 60) -> None:
        self.process = subprocess.Popen(
            ["chromedriver", f"--port={self.port}", f"--log-path={self.workdir / 'chromedriver.log'}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        until("chromedriver ready", lambda: http(f"{self.url}/status", timeout=5)["value"]["ready"], timeout_s)
        profile = self.workdir / "profile"
        profile.mkdir()
        options = {
            "binary": shutil.which("chromium"),
            "args": [*CHROMIUM_ARGS, f"--user-data-dir={profile}", "--window-size={},{}".format(*self.size)],
        }
        capabilities = {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}
        answer = http(f"{self.url}/session", {"capabilities": capabilities}, timeout=timeout_s)
        self.session = answer["value"]["sessionId"]
        self.version = answer["value"]["capabilities"].get("browserVersion")

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float = 60):
        return http(f"{self.url}/session/{self.session}{path}", body, method=method, timeout=timeout)["value"]

    def open(self, url: str) -> None:
        """Navigates and returns after the page's load event (WebDriver's 'normal' page load strategy)."""
        self._call("POST", "/url", {"url": url}, timeout=120)

    def run(self, script: str, *args):
        return self._call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def resize(self, width: int, height: int) -> None:
        self._call("POST", "/window/rect", {"width": width, "height": height})

    def screenshot_png(self) -> bytes:
        import base64

        return base64.b64decode(self._call("GET", "/screenshot"))

    def stop(self) -> None:
        if self.session is not None:
            try:
                self._call("DELETE", "", timeout=30)  # ends Chromium
            except Exception:  # noqa: BLE001 - chromedriver's exit below ends it anyway
                pass
            self.session = None
        if self.process is not None:
            _stop_group(self.process, grace_s=10)
