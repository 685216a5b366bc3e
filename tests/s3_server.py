"""S3 servers for tests: moto's in-process emulator, and a real single-node Ceph RADOS gateway.

moto (`moto_s3`) starts at once and suits the fast unit tests, but it is an emulator. The `s3`-marked
tests also run against Ceph RGW (`ceph_s3`), the one real S3 server Debian ships
(scripts/install_ceph_rgw.sh): 1 monitor, 1 memstore OSD (data in RAM) and radosgw on 127.0.0.1, with
cephx auth off, in a temp dir, as the current user.

Use from conftest.py (`from tests.s3_server import ceph_s3, moto_s3  # noqa`) or
`pytest_plugins = ["tests.s3_server"]`. The cluster is one per process however many modules import the
fixture. Without the Ceph binaries the fixture skips, unless MAZERL_REQUIRE_S3=1 (CI), then it fails.

By hand: `python -m tests.s3_server start DIR` (prints the endpoint and keys as shell exports, leaves the
daemons running) and `python -m tests.s3_server stop DIR`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

CEPH_BINARIES = ("ceph-mon", "ceph-osd", "radosgw", "radosgw-admin", "monmaptool", "ceph-authtool", "ceph")
REQUIRE_ENV = "MAZERL_REQUIRE_S3"
START_TIMEOUT_S = 120


@dataclass(frozen=True)
class S3Endpoint:
    endpoint_url: str
    access_key: str
    secret_key: str
    gateway_pid: int | None = None  # the radosgw process, for tests that stop the gateway (None: not ours)

    def env(self) -> dict[str, str]:
        """The environment that points boto3's standard credential chain at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def new_bucket(self, stem: str = "mazerl-test") -> str:
        name = f"{stem}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def missing_ceph_binaries() -> list[str]:
    return [b for b in CEPH_BINARIES if shutil.which(b) is None]


# ---------------------------------------------------------------- the Ceph cluster


def ceph_conf(workdir: Path, fsid: str, mon_port: int, rgw_port: int) -> str:
    return f"""[global]
fsid = {fsid}
mon host = v2:127.0.0.1:{mon_port}
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
auth cluster required = none
auth service required = none
auth client required = none
# without these two, radosgw keeps retrying the (disabled) secure auth handshake
ms mon client mode = crc
ms client mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 1000
# one node: commit monitor map changes at once instead of batching them for a second (start-up 17 s -> 1.5 s)
paxos propose interval = 0.01
paxos min wait = 0.001
# a nearly full CI disk must not stop the monitor (memstore keeps the data in RAM anyway)
mon data avail crit = 0
mon data avail warn = 0
osd objectstore = memstore
memstore device bytes = 2147483648
run dir = {workdir}/run
admin socket = {workdir}/run/$name.asok
pid file = {workdir}/run/$name.pid
log file = {workdir}/log/$name.log
keyring = {workdir}/keyring
mon data = {workdir}/mon/$id
osd data = {workdir}/osd/$id

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {workdir}/rgw
rgw thread pool size = 32
"""


class CephCluster:
    """One monitor, one memstore OSD and radosgw, all children of this process, under `workdir`."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = Path(workdir).resolve()
        self.conf = self.workdir / "ceph.conf"
        self.processes: list[subprocess.Popen] = []
        self.endpoint: S3Endpoint | None = None
        self.waits: dict[str, float] = {}  # seconds spent waiting per start-up phase, for slow-CI diagnosis

    def _run(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=self.workdir)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args[:3])} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
        return done.stdout

    def _daemon(self, *args: str) -> None:
        name = Path(args[0]).name
        with open(self.workdir / "log" / f"{name}.out", "ab") as out:
            # -f: stay in the foreground as our child, so stop() can end it by its pid
            self.processes.append(
                subprocess.Popen(
                    [*args, "-f", "-c", str(self.conf)],
                    cwd=self.workdir,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        (self.workdir / "pids").write_text("".join(f"{p.pid}\n" for p in self.processes))

    def _until(self, what: str, attempt, deadline: float):
        """Calls attempt() until it returns something truthy; errors count as 'not yet' until the deadline."""
        last, started = None, time.monotonic()
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                result = attempt()
                if result:
                    self.waits[what] = round(time.monotonic() - started, 2)
                    return result
            except Exception as e:  # noqa: BLE001 - any failure means "not ready yet" here
                last = e
            time.sleep(0.25)
        raise TimeoutError(
            f"Ceph: {what} did not happen within {START_TIMEOUT_S} s ({last}); logs in {self.workdir}/log"
        )

    def _check_alive(self) -> None:
        for p in self.processes:
            if p.poll() is not None:
                raise RuntimeError(f"Ceph daemon {p.args[0]} exited with {p.returncode}; logs: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
        logs = sorted((self.workdir / "log").glob("*"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in logs)

    def start(self) -> S3Endpoint:
        deadline = time.monotonic() + START_TIMEOUT_S
        for sub in ("run", "log", "mon/a", "osd/0", "rgw"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        fsid, mon_port, rgw_port = str(uuid.uuid4()), free_port(), free_port()
        self.conf.write_text(ceph_conf(self.workdir, fsid, mon_port, rgw_port))
        try:
            self._run(
                "monmaptool",
                "--create",
                "--addv",
                "a",
                f"[v2:127.0.0.1:{mon_port}]",
                "--fsid",
                fsid,
                str(self.workdir / "monmap"),
            )
            self._run("ceph-authtool", "--create-keyring", str(self.workdir / "keyring"), "--gen-key", "-n", "mon.")
            self._run("ceph-mon", "-c", str(self.conf), "--mkfs", "-i", "a", "--monmap", str(self.workdir / "monmap"))
            self._daemon("ceph-mon", "-i", "a")
            # the ceph CLI sleeps out its whole connect timeout when it comes too early: poll the port first,
            # and keep that timeout short (a monitor not yet in quorum costs one timeout, then we retry)
            self._until("the monitor listening", lambda: port_open(mon_port), deadline)
            osd_id = self._until(
                "registering the OSD",
                lambda: self._run(
                    "ceph", "-c", str(self.conf), "--connect-timeout", "2", "osd", "create", timeout=15
                ).strip(),
                deadline,
            )
            self._run("ceph-osd", "-c", str(self.conf), "-i", osd_id, "--mkfs")
            self._daemon("ceph-osd", "-i", osd_id)
            # radosgw creates its pools at once; if the OSD is not up yet, its client retries only 5 s later
            self._until(
                "the OSD up",
                lambda: json.loads(
                    self._run("ceph", "-c", str(self.conf), "--connect-timeout", "2", "osd", "stat", "-f", "json")
                )["num_up_osds"],
                deadline,
            )
            self._daemon("radosgw", "-n", "client.rgw")
            url = f"http://127.0.0.1:{rgw_port}"
            self._until("radosgw answering S3", lambda: urllib.request.urlopen(url, timeout=2).status == 200, deadline)
            access, secret = f"MAZERLTEST{uuid.uuid4().hex[:10].upper()}", uuid.uuid4().hex
            self._run(
                "radosgw-admin",
                "-c",
                str(self.conf),
                "user",
                "create",
                "--uid=mazerl",
                "--display-name=mazerl",
                f"--access-key={access}",
                f"--secret-key={secret}",
            )
            endpoint = S3Endpoint(url, access, secret, gateway_pid=self.processes[-1].pid)
            warm_up(endpoint)
        except BaseException:
            self.stop(remove=False)
            raise
        self.endpoint = endpoint
        (self.workdir / "endpoint.json").write_text(json.dumps(asdict(self.endpoint)))
        return self.endpoint

    def stop(self, remove: bool = True) -> None:
        """Stops the gateway, then the OSD, then the monitor (the reverse of start), then removes the dir."""
        for p in reversed(self.processes):
            stop_pid(p.pid)
            p.wait(timeout=10)
        self.processes.clear()
        (self.workdir / "pids").unlink(missing_ok=True)
        if remove:
            shutil.rmtree(self.workdir, ignore_errors=True)


def warm_up(endpoint: S3Endpoint) -> None:
    """RGW creates its index and data pools on the first bucket and the first object: pay
    that during start-up rather than inside whichever test comes first."""
    client = endpoint.client()
    bucket = endpoint.new_bucket("mazerl-warm-up")
    client.put_object(Bucket=bucket, Key="k", Body=b"x")
    client.delete_object(Bucket=bucket, Key="k")
    client.delete_bucket(Bucket=bucket)


def stop_pid(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after grace_s (an OSD can take its time to leave a monitor that is gone)."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if _exited(pid):
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _exited(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # reaps it when it is our child
        if done:
            return True
    except ChildProcessError:
        pass  # not our child (the CLI's `stop`): look at /proc instead
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "\nState:\tZ" in status.read_text()


# ---------------------------------------------------------------- pytest fixtures

_shared: dict = {"cluster": None, "users": 0}


def _ceph_or_skip() -> None:
    missing = missing_ceph_binaries()
    if missing:
        reason = f"Ceph RGW is not installed (missing {', '.join(missing)}): run scripts/install_ceph_rgw.sh"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the real S3 server)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def ceph_s3() -> Iterator[S3Endpoint]:
    """A running Ceph RGW for the whole session (started on first use)."""
    _ceph_or_skip()
    if _shared["cluster"] is None:
        cluster = CephCluster(tempfile.mkdtemp(prefix="mazerl-ceph-"))  # short path: unix sockets live there
        started = time.monotonic()
        cluster.start()
        print(
            f"\nCeph RGW up at {cluster.endpoint.endpoint_url} in {time.monotonic() - started:.1f} s "
            f"(waits: {cluster.waits})",
            file=sys.stderr,
        )
        _shared["cluster"] = cluster
    _shared["users"] += 1
    try:
        yield _shared["cluster"].endpoint
    finally:
        _shared["users"] -= 1
        if _shared["users"] == 0:
            _shared["cluster"].stop()
            _shared["cluster"] = None


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[S3Endpoint]:
    """moto's S3 emulator on a free local port, in a thread of this process."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield S3Endpoint(f"http://{host}:{port}", "moto-access-key", "moto-secret-key")
    server.stop()


# ---------------------------------------------------------------- by hand


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print("usage: python -m tests.s3_server start|stop DIR", file=sys.stderr)
        return 2
    command, workdir = argv[0], Path(argv[1]).resolve()
    if command == "start":
        missing = missing_ceph_binaries()
        if missing:
            print(f"missing {', '.join(missing)}: run scripts/install_ceph_rgw.sh", file=sys.stderr)
            return 1
        if (workdir / "pids").exists():
            print(f"{workdir} already holds a running cluster; stop it first", file=sys.stderr)
            return 1
        if workdir.exists() and any(workdir.iterdir()):
            if not (workdir / "ceph.conf").exists():
                print(f"{workdir} is not empty and not an old cluster directory; pick another", file=sys.stderr)
                return 1
            shutil.rmtree(workdir)  # a stopped cluster's leftovers: memstore kept no data worth keeping
        endpoint = CephCluster(workdir).start()
        print(f"export AWS_ENDPOINT_URL={endpoint.endpoint_url}")
        for key, value in endpoint.env().items():
            print(f"export {key}={value}")
        # for the recovery rehearsal (tests/driver/scenarios/reference.py), which makes its bucket itself
        print(f"export MAZERL_REHEARSAL_S3_ENDPOINT={endpoint.endpoint_url}")
        print(f"export MAZERL_REHEARSAL_S3_PID={endpoint.gateway_pid}")
        print("export MAZERL_REHEARSAL_S3_URI=s3://mazerl-rehearsal/run")
        return 0
    pids_file = workdir / "pids"
    if not pids_file.exists():
        print(f"no running cluster recorded in {workdir}", file=sys.stderr)
        return 1
    for pid in reversed([int(line) for line in pids_file.read_text().split()]):
        cmdline = Path(f"/proc/{pid}/cmdline")
        if cmdline.exists() and str(workdir) in cmdline.read_bytes().decode(errors="replace"):
            stop_pid(pid)  # only daemons started for this directory (a pid may have been reused)
    pids_file.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
