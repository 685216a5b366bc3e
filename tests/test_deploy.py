"""The deployment files: KubeRay manifests, the GPU image, the job script and docs/OPERATING.md.

- deploy/k8s/*.yaml are validated against the KubeRay CRD schemas vendored in deploy/k8s/schemas, in strict mode
  (unknown fields fail, as with `kubectl apply`), with negative cases showing that the validation bites. The
  structure the application depends on is checked too: the `head` resource, 3 workers x 2 GPUs, the RWX
  volume at /shared, the RayJob entrypoint, agreement with configs/hyperpod.yaml, and the placement that
  `python -m app.main configs/hyperpod.yaml --plan --cluster ...` prints for that cluster.
- deploy/Dockerfile and deploy/requirements-gpu.lock: the pins agree with setup.cfg and deploy/gpu-wheels.txt
  (the repository's copy of ../shared/gpu/wheels.txt), the user is not root, no `latest` tag, the image is offline.
- scripts/train_job.sh: --dry-run (creates nothing), --prepare-only (idempotent), and what a second run does for
  each state of an earlier job, against a fake job API and a fake `ray` command.
- docs/OPERATING.md: the files, commands, flags and metric names it mentions exist.
Nothing here needs a cluster, Docker, a GPU or ../shared.
"""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = K8S / "schemas"
KUBERAY_VERSION = "v1.7.0"
WHEELS = DEPLOY / "gpu-wheels.txt"  # the set proven on the H200 machine, copied from SHARED_WHEELS
SHARED_WHEELS = ROOT.parent / "shared" / "gpu" / "wheels.txt"  # absent in a fresh clone
SCRIPT = ROOT / "scripts" / "train_job.sh"
DRIVER_ENV_KEYS_FALLBACK = {"HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"}


# ---------------------------------------------------------------- loading


def load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def load_one(path: Path) -> dict:
    docs = load_yaml_docs(path)
    assert len(docs) == 1, f"{path} should hold exactly one object"
    return docs[0]


@pytest.fixture(scope="module")
def cluster() -> dict:
    return load_one(K8S / "raycluster.yaml")


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return load_one(K8S / "rayjob.yaml")


@pytest.fixture(scope="module")
def pvc() -> dict:
    return load_one(K8S / "pvc.yaml")


@pytest.fixture(scope="module")
def hyperpod() -> dict:
    return yaml.safe_load((ROOT / "configs" / "hyperpod.yaml").read_text())


@pytest.fixture(scope="module")
def setup_cfg() -> configparser.ConfigParser:
    cp = configparser.ConfigParser()
    cp.read(ROOT / "setup.cfg")
    return cp


def requirement_lines(text: str) -> list[str]:
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def lock() -> dict[str, tuple[str, list[str]]]:
    """deploy/requirements-gpu.lock as {name: (version, [sha256, ...])}; every line must be pinned and hashed."""
    text = (DEPLOY / "requirements-gpu.lock").read_text().replace("\\\n", " ")
    out: dict[str, tuple[str, list[str]]] = {}
    for line in requirement_lines(text):
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)((?:\s+--hash=sha256:[0-9a-f]{64})+)", line)
        assert m, f"lock line is not 'name==version --hash=sha256:...': {line!r}"
        name = norm(m.group(1))
        assert name not in out, f"{name} is pinned twice in the lock file"
        out[name] = (m.group(2), re.findall(r"sha256:([0-9a-f]{64})", m.group(3)))
    return out


def setup_requirements(cp: configparser.ConfigParser, section: str, key: str) -> dict[str, str]:
    """{name: specifier} from a setup.cfg requirements list (extras like ray[default] dropped)."""
    out = {}
    for line in requirement_lines(cp.get(section, key)):
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", line)
        out[norm(m.group(1))] = m.group(3).strip()
    return out


# ---------------------------------------------------------------- schema validation


def strict(schema):
    """The CRD schema as the API server applies it: unknown fields in a typed object are an error."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


FORMATS = jsonschema.FormatChecker()


@FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


def validator(crd: str) -> jsonschema.Draft7Validator:
    raw = json.loads((SCHEMAS / f"ray.io_{crd}.{KUBERAY_VERSION}.json").read_text())
    schema = strict({k: v for k, v in raw.items() if k != "$comment"})
    return jsonschema.Draft7Validator(schema, format_checker=FORMATS)


@pytest.fixture(scope="module")
def validators() -> dict[str, jsonschema.Draft7Validator]:
    return {"RayCluster": validator("rayclusters"), "RayJob": validator("rayjobs")}


def schema_errors(validators, obj: dict) -> list[str]:
    assert obj.get("apiVersion") == "ray.io/v1", obj.get("apiVersion")
    errors = sorted(validators[obj["kind"]].iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message[:200]}" for e in errors]


def test_vendored_schemas_are_small_and_say_where_they_come_from():
    files = sorted(SCHEMAS.glob("*.json"))
    assert [f.name for f in files] == [
        f"ray.io_rayclusters.{KUBERAY_VERSION}.json",
        f"ray.io_rayjobs.{KUBERAY_VERSION}.json",
    ]
    assert sum(f.stat().st_size for f in files) < 1_000_000
    for f in files:
        comment = json.loads(f.read_text())["$comment"]
        assert "ray-project/kuberay" in comment and KUBERAY_VERSION in comment and "commit" in comment
    assert KUBERAY_VERSION in (SCHEMAS / "README.md").read_text()


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_manifests_match_the_kuberay_crd_schema(validators, name):
    assert schema_errors(validators, load_one(K8S / name)) == []


def _worker(obj):
    return obj["spec"]["workerGroupSpecs"][0]


def _head_container(obj):
    return obj["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


NEGATIVE_CASES = {
    "replicas as a string": ("RayCluster", lambda c: _worker(c).__setitem__("replicas", "3")),
    "rayStartParams value not a string": (
        "RayCluster",
        lambda c: _worker(c)["rayStartParams"].__setitem__("num-cpus", 32),
    ),
    "unknown field (typo)": ("RayCluster", lambda c: c["spec"]["headGroupSpec"].__setitem__("rayStartParam", {})),
    "containers as a mapping": (
        "RayCluster",
        lambda c: c["spec"]["headGroupSpec"]["template"]["spec"].__setitem__("containers", {"name": "ray-head"}),
    ),
    "authOptions.mode outside its enum": (
        "RayCluster",
        lambda c: c["spec"]["authOptions"].__setitem__("mode", "oauth"),
    ),
    "GPU quantity not a quantity": (
        "RayCluster",
        lambda c: _worker(c)["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__(
            "nvidia.com/gpu", "two"
        ),
    ),
    "replicas beyond int32": ("RayCluster", lambda c: _worker(c).__setitem__("replicas", 2**31)),
    "worker group without groupName": ("RayCluster", lambda c: _worker(c).pop("groupName")),
    "RayJob backoffLimit as a string": ("RayJob", lambda j: j["spec"].__setitem__("backoffLimit", "3")),
    "RayJob shutdownAfterJobFinishes not a bool": (
        "RayJob",
        lambda j: j["spec"].__setitem__("shutdownAfterJobFinishes", "yes"),
    ),
    "RayJob entrypoint as a list": (
        "RayJob",
        lambda j: j["spec"].__setitem__("entrypoint", ["python", "-m", "app.main"]),
    ),
    "RayJob preRunningDeadlineSeconds below its minimum": (
        "RayJob",
        lambda j: j["spec"].__setitem__("preRunningDeadlineSeconds", 0),
    ),
    "RayJob deletion rule policy outside its enum": (
        "RayJob",
        lambda j: j["spec"].__setitem__(
            "deletionStrategy",
            {"deletionRules": [{"policy": "DeleteEverything", "condition": {"jobStatus": "FAILED"}}]},
        ),
    ),
    "RayJob inline cluster with a wrong type": (
        "RayJob",
        lambda j: j["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].__setitem__("minReplicas", "3"),
    ),
}


@pytest.mark.parametrize("case", sorted(NEGATIVE_CASES))
def test_a_wrong_manifest_fails_validation(validators, cluster, rayjob, case):
    kind, mutate = NEGATIVE_CASES[case]
    obj = copy.deepcopy(cluster if kind == "RayCluster" else rayjob)
    mutate(obj)
    assert schema_errors(validators, obj), f"'{case}' passed schema validation"


# ---------------------------------------------------------------- what the application needs from the cluster


def ray_containers(spec: dict) -> list[tuple[str, dict, dict]]:
    """(group, pod spec, Ray container) for the head and every worker group."""
    out = [
        ("head", spec["headGroupSpec"]["template"]["spec"], spec["headGroupSpec"]["template"]["spec"]["containers"][0])
    ]
    for g in spec["workerGroupSpecs"]:
        out.append((g["groupName"], g["template"]["spec"], g["template"]["spec"]["containers"][0]))
    return out


def quantity_bytes(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    m = re.fullmatch(r"([0-9.]+)([KMGT]i?)?", str(q))
    return float(m.group(1)) * units.get(m.group(2) or "", 1)


def kuberay_resources(params: dict) -> dict:
    """rayStartParams['resources'] parsed the way KubeRay parses it (pod.go getResourcesMap)."""
    return json.loads(params.get("resources", "{}").strip("'\"` "))


def test_head_has_the_head_resource_cpus_memory_dashboard_and_metrics(cluster, hyperpod):
    from app.config import Config, PlacementConfig
    from placement.plan import HEAD_RESOURCE, consolidator_options, make_plan

    head = cluster["spec"]["headGroupSpec"]
    params = head["rayStartParams"]
    resources = kuberay_resources(params)
    assert resources == {HEAD_RESOURCE: 1}
    # the consolidator asks for exactly this resource when the cluster advertises it
    plan = make_plan(Config(placement=PlacementConfig()))
    assert HEAD_RESOURCE in consolidator_options(plan, {"CPU": 16, HEAD_RESOURCE: 1})["resources"]
    placement = hyperpod.get("placement", {})
    head_cpus = float(params["num-cpus"])
    assert head_cpus >= placement.get("consolidator_cpus", 0.1) + placement.get("evaluator_cpus", 0.1)
    assert params.get("num-gpus", "0") == "0"
    container = _head_container(cluster)
    assert quantity_bytes(container["resources"]["limits"]["memory"]) >= 64 * 2**30, "consolidation needs a big head"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["dashboard"] == 8265 and params.get("dashboard-port", "8265") == "8265"
    assert params.get("dashboard-host") == "0.0.0.0"
    assert ports["metrics"] == int(params["metrics-export-port"])


def test_gpu_workers_are_three_pods_of_two_gpus_matching_the_hyperpod_placement(cluster, hyperpod):
    groups = cluster["spec"]["workerGroupSpecs"]
    assert len(groups) == 1
    g = groups[0]
    assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 3
    container = g["template"]["spec"]["containers"][0]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert int(limits["nvidia.com/gpu"]) == 2 and int(requests.get("nvidia.com/gpu", 2)) == 2
    assert int(g["rayStartParams"].get("num-gpus", limits["nvidia.com/gpu"])) == 2
    assert {k: str(v) for k, v in requests.items()} == {k: str(v) for k, v in limits.items()}, "Guaranteed QoS"
    # the placement group of configs/hyperpod.yaml fits: 6 bundles of 1 GPU, 2 bundles per pod
    p = hyperpod["placement"]
    assert p["num_bundles"] * p["gpus_per_bundle"] == g["replicas"] * 2
    bundles_per_pod = 2 // p["gpus_per_bundle"]
    assert float(g["rayStartParams"]["num-cpus"]) >= bundles_per_pod * p["cpus_per_bundle"]
    assert float(g["rayStartParams"]["num-cpus"]) <= float(limits["cpu"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == int(g["rayStartParams"]["metrics-export-port"])
    assert not cluster["spec"].get("enableInTreeAutoscaling", False)


def test_every_ray_pod_mounts_the_rwx_volume_at_shared_and_a_memory_dev_shm(cluster, pvc, hyperpod):
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for group, pod, container in ray_containers(cluster["spec"]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/shared"]]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"], group
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory", group
        params = (
            cluster["spec"]["headGroupSpec"]["rayStartParams"]
            if group == "head"
            else next(g["rayStartParams"] for g in cluster["spec"]["workerGroupSpecs"] if g["groupName"] == group)
        )
        # Ray falls back to a slow disk object store when /dev/shm is smaller than the store
        assert quantity_bytes(shm["sizeLimit"]) > int(params["object-store-memory"]), group
        assert quantity_bytes(shm["sizeLimit"]) < quantity_bytes(container["resources"]["limits"]["memory"]), group
    # the config's paths live on that volume
    for path in (
        hyperpod["output_dir"],
        hyperpod["model"]["path"],
        hyperpod["model"]["adapter_init"],
        hyperpod["checkpoint"]["export_dir"],
    ):
        assert path.startswith("/shared/"), path


def test_token_auth_is_kept_and_comes_from_a_secret(cluster, setup_cfg):
    spec = cluster["spec"]
    assert spec["authOptions"]["mode"] == "token" and spec["authOptions"]["secretName"]
    # KubeRay refuses token mode without a rayVersion >= 2.52.0; it must be the Ray that the image installs
    ray_pin = setup_requirements(setup_cfg, "options", "install_requires")["ray"]
    assert ray_pin == f"=={spec['rayVersion']}" and Version(spec["rayVersion"]) >= Version("2.52.0")
    for group, _, container in ray_containers(spec):
        names = {e["name"] for e in container.get("env", [])}
        # KubeRay injects RAY_AUTH_MODE/RAY_AUTH_TOKEN only where they are not set already
        assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, group


def test_pods_run_as_the_image_user(cluster):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    uid = re.findall(r"(?m)^USER\s+(\d+)", dockerfile)[-1]
    for group, pod, container in ray_containers(cluster["spec"]):
        assert str(pod["securityContext"]["runAsUser"]) == uid and pod["securityContext"]["runAsNonRoot"], group
        assert container["workingDir"] == "/app", group  # where the RayJob entrypoint finds configs/


def test_kuberay_operator_rules_beyond_the_schema(cluster, rayjob):
    """A few checks that KubeRay's webhook-less validation (utils/validation.go) makes at reconcile time."""
    for spec in (cluster["spec"], rayjob["spec"]["rayClusterSpec"]):
        assert spec["headGroupSpec"]["template"]["spec"]["containers"]
        for g in spec["workerGroupSpecs"]:
            if not spec.get("enableInTreeAutoscaling"):
                assert "minReplicas" in g and "maxReplicas" in g
            assert 0 <= g["minReplicas"] <= g.get("replicas", g["minReplicas"]) <= g["maxReplicas"]
    j = rayjob["spec"]
    assert not (j.get("clusterSelector") and j.get("backoffLimit", 0) > 0), "backoffLimit needs an inline cluster"
    assert not (j.get("ttlSecondsAfterFinished", 0) > 0 and not j.get("shutdownAfterJobFinishes"))
    assert not (j.get("suspend") and not j.get("shutdownAfterJobFinishes"))
    assert len(rayjob["metadata"]["name"]) <= 47  # RayJob names leave room for the generated cluster suffix


def test_rayjob_runs_app_main_on_the_same_cluster_and_retries_into_a_resume(rayjob, cluster, hyperpod):
    spec = rayjob["spec"]
    assert shlex.split(spec["entrypoint"]) == ["python", "-m", "app.main", "configs/hyperpod.yaml"]
    assert (ROOT / "configs" / "hyperpod.yaml").is_file()
    assert spec["rayClusterSpec"] == cluster["spec"], "rayjob.yaml must carry raycluster.yaml's spec unchanged"
    assert "clusterSelector" not in spec
    # a re-submitted job resumes: the config resumes from the latest checkpoint on the shared volume
    assert hyperpod["checkpoint"]["resume_mode"] == "latest"
    assert spec["backoffLimit"] >= 1 and spec["submitterConfig"]["backoffLimit"] >= 1
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec.get("submissionMode", "K8sJobMode") == "K8sJobMode"
    assert spec["jobId"] == f"mazerl-{hyperpod['run_name']}"  # the id scripts/train_job.sh uses
    runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "{}") or {}
    assert not set(runtime_env.get("env_vars", {})) & DRIVER_ENV_KEYS_FALLBACK


def test_image_references_agree_everywhere(cluster, rayjob, setup_cfg):
    images = {
        c["image"] for _, _, c in ray_containers(cluster["spec"]) + ray_containers(rayjob["spec"]["rayClusterSpec"])
    }
    assert len(images) == 1, images
    image = images.pop()
    repo, _, tag = image.rpartition(":")
    assert repo and "@" not in repo and tag not in ("", "latest")
    version = setup_cfg.get("metadata", "version")
    assert tag == version
    assert re.search(rf"(?m)^ARG MAZERL_VERSION={re.escape(version)}$", (DEPLOY / "Dockerfile").read_text())
    assert image in (DEPLOY / "Dockerfile").read_text(), "the build command in the Dockerfile's header names the image"


def cluster_description(spec: dict) -> str:
    """The --cluster argument of `app.main --plan` for the Ray nodes a RayCluster spec starts."""
    head = spec["headGroupSpec"]["rayStartParams"]
    parts = [f"head:CPU={head['num-cpus']}," + ",".join(f"{k}={v:g}" for k, v in kuberay_resources(head).items())]
    for g in spec["workerGroupSpecs"]:
        p = g["rayStartParams"]
        parts.append(f"{g['replicas']}x {g['groupName']}:GPU={p['num-gpus']},CPU={p['num-cpus']}")
    return ";".join(parts)


def plan_on(cluster_arg: str, capsys) -> tuple[int, str, str]:
    """`python -m app.main configs/hyperpod.yaml --plan --cluster ARG`, in this process (it starts nothing)."""
    import importlib.util

    from app.main import main

    # rollout.engine: vllm needs vllm importable; the engine does not change the placement
    overrides = [] if importlib.util.find_spec("vllm") else ["rollout.engine=hf"]
    capsys.readouterr()
    code = main(["configs/hyperpod.yaml", *overrides, "--plan", "--cluster", cluster_arg])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("which", ["the issue's cluster", "the manifest's cluster"])
def test_hyperpod_plan_places_two_bundles_per_gpu_pod_and_the_consolidator_on_the_head(cluster, capsys, which):
    arg = (
        "head:CPU=32,head=1;3x worker:GPU=2,CPU=32"
        if which == "the issue's cluster"
        else cluster_description(cluster["spec"])
    )
    worker = "worker" if which == "the issue's cluster" else "gpu"
    code, out, err = plan_on(arg, capsys)
    assert code == 0, err
    assert "placement group: 6 bundles, strategy PACK" in out
    for i in range(6):
        assert re.search(
            rf"(?m)^  bundle {i}: \{{'CPU': 8\.0, 'GPU': 1\}} -> rollout-{i} \(GPU 0\.5, CPU 4, 8 threads\), "
            rf"trainer-{i} \(GPU 0\.5, CPU 4, 8 threads\)$",
            out,
        ), out
    assert "consolidator: CPU 0.1, pinned to the head node (resource 'head')" in out
    assert "total: 6 GPUs, 48.2 CPUs" in out
    assert "on the described cluster (4 nodes, PACK):" in out
    placed = re.findall(r"(?m)^  bundle (\d) -> (\S+)$", out)
    assert placed == [(str(i), f"{worker}-{i // 2}") for i in range(6)]
    assert re.search(r"(?m)^  consolidator -> head$", out)
    # the validated config printed first is the seed run
    assert "run_name: hyperpod-maze2d" in out and "rank: 32" in out and "gpu_memory_utilization: 0.45" in out


def test_hyperpod_plan_fails_on_a_cluster_that_cannot_hold_it(cluster, capsys):
    small = copy.deepcopy(cluster["spec"])
    small["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = "1"  # 3 GPUs for 6 bundles
    code, out, err = plan_on(cluster_description(small), capsys)
    assert code == 2 and "fits on no node of the described cluster" in err
    code, _, err = plan_on("head:CPU=16,head=1;3x gpu:GPU=2,CPU=12", capsys)  # 2 x 8 CPUs do not fit in 12
    assert code == 2 and "fits on no node" in err


# ---------------------------------------------------------------- the image


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", "\n".join(x for x in text.splitlines() if not x.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"(?m)^\s*([A-Za-z]+)\s+(.*)$", text)]


def test_dockerfile_base_image_is_pinned_cuda_runtime_matching_torch(lock):
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    froms = [a for k, a in ins if k == "FROM"]
    assert froms == ["${CUDA_IMAGE}"]
    base = args["CUDA_IMAGE"]
    m = re.fullmatch(
        r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(?:cudnn-)?runtime-ubuntu(\d+\.\d+)(@sha256:[0-9a-f]{64})?", base
    )
    assert m, f"base image {base!r} is not a fully versioned nvidia/cuda runtime tag"
    assert "latest" not in (DEPLOY / "Dockerfile").read_text().lower().replace("the latest", "")
    # torch 2.11.0 on PyPI is built for CUDA 13.0: the base image must be the same major.minor
    toolkit = Version(lock["cuda-toolkit"][0])
    assert (int(m.group(1)), int(m.group(2))) == (toolkit.major, toolkit.minor)


def test_dockerfile_installs_the_lock_then_mazerl_without_deps_into_the_venv_as_non_root():
    ins = dockerfile_instructions()
    runs = [a for k, a in ins if k == "RUN"]
    lock_install = next(i for i, r in enumerate(runs) if "requirements-gpu.lock" in r and "pip install" in r)
    r = runs[lock_install]
    assert all(flag in r for flag in ("--no-deps", "--require-hashes", "--only-binary=:all:")), r
    app_install = next(i for i, r in enumerate(runs) if re.search(r"pip install .*--no-deps.* \.(\s|$)", r))
    assert app_install > lock_install
    assert "python -m pip" in runs[app_install]  # the venv python on PATH, the one `ray start` runs
    env = " ".join(a for k, a in ins if k == "ENV")
    assert "PATH=/opt/venv/bin:" in env and "VIRTUAL_ENV=/opt/venv" in env
    assert re.search(r"\bHF_HUB_OFFLINE=1\b", env)
    users = [a for k, a in ins if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0") and users[-1].startswith("1000")
    assert [k for k, _ in ins].index("USER") > max(i for i, (k, _) in enumerate(ins) if k == "RUN")
    assert any(k == "WORKDIR" and a == "/app" for k, a in ins)
    copied = " ".join(a for k, a in ins if k == "COPY")
    for path in ("app", "actors", "placement", "configs", "scripts", "setup.cfg", "pyproject.toml", "README.md"):
        assert re.search(rf"(^|\s){re.escape(path)}(\s|$)", copied), path
    text = (DEPLOY / "Dockerfile").read_text()
    for forbidden in ("snapshot_download", "huggingface-cli", "hf download", "from_pretrained", "curl ", "wget http"):
        assert forbidden not in text, f"the image must not download models ({forbidden})"
    assert not re.search(r"(?m)^ENV .*RAY_AUTH_MODE", text), "the image keeps Ray's default token auth"


def test_lock_pins_equal_setup_cfg_and_the_gpu_wheels(lock, setup_cfg):
    for extra_or_base, reqs in (
        ("gpu", setup_requirements(setup_cfg, "options.extras_require", "gpu")),
        ("install_requires", setup_requirements(setup_cfg, "options", "install_requires")),
    ):
        for name, spec in reqs.items():
            assert name in lock, f"{name} ({extra_or_base}) is missing from the lock"
            version = lock[name][0]
            if spec.startswith("=="):
                assert version == spec[2:], f"{name}: lock {version}, setup.cfg {spec}"
            else:
                assert Version(version) in SpecifierSet(spec), f"{name}: lock {version} outside setup.cfg {spec}"
    assert lock["torch"][0] == "2.11.0" and lock["vllm"][0] == "0.26.0"
    wheels = requirement_lines(WHEELS.read_text())
    assert len(wheels) > 50 and "vllm==0.26.0" in wheels
    mismatched = [line for line in wheels if lock.get(norm(line.split("==")[0]), ("absent",))[0] != line.split("==")[1]]
    assert mismatched == [], "deploy/gpu-wheels.txt pins that the lock does not have"


def test_the_wheels_copy_equals_the_shared_original():
    if not SHARED_WHEELS.is_file():
        pytest.skip(f"{SHARED_WHEELS} is not here (a fresh clone); deploy/gpu-wheels.txt is checked on its own")
    assert requirement_lines(WHEELS.read_text()) == requirement_lines(SHARED_WHEELS.read_text()), (
        "refresh deploy/gpu-wheels.txt from ../shared/gpu/wheels.txt"
    )


# ---------------------------------------------------------------- scripts/train_job.sh


class FakeJobAPI(BaseHTTPRequestHandler):
    """The two endpoints of Ray's job API that the script's status lookup reads; STATUSES: submission id -> status."""

    STATUSES: dict[str, str] = {}

    def do_GET(self):  # noqa: N802
        job = self.path.removeprefix("/api/jobs/").strip("/")
        if self.path == "/api/version":
            self.reply(200, {"version": "4", "ray_version": "2.60.0", "ray_commit": "fake", "session_name": "fake"})
        elif self.path.startswith("/api/jobs/") and job in self.STATUSES:
            self.reply(
                200,
                {
                    "type": "SUBMISSION",
                    "submission_id": job,
                    "status": self.STATUSES[job],
                    "entrypoint": "python -m app.main tests/tiny.yaml",
                },
            )
        else:
            self.reply(404, f"Job {job} does not exist")

    def reply(self, code: int, body):
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


FAKE_RAY = """#!/usr/bin/env bash
# stands in for the `ray` command: records its arguments, one shell-quoted line per call
printf '%q ' "$@" >> "$FAKE_RAY_LOG"; echo >> "$FAKE_RAY_LOG"
[ "$2" = logs ] && echo "fake log of $*"
exit 0
"""

JOB_STATES = {"absent": None, "running": "RUNNING", "succeeded": "SUCCEEDED", "failed": "FAILED"}


def run_scripts(*invocations: tuple[tuple[str, ...], dict], timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Runs several (args, extra env) train_job.sh invocations at once; each is two or three short Pythons."""
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    base.update(
        PYTHON=sys.executable,
        RAY_AUTH_MODE="disabled",
        OMP_NUM_THREADS="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )  # the fake job API is local
    procs = [
        subprocess.Popen(
            ["bash", str(SCRIPT), *args],
            cwd=ROOT,
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, env in invocations
    ]
    results = []
    for (args, _), proc in zip(invocations, procs):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory) -> dict:
    """Every train_job.sh run this module checks: two rounds of parallel runs, the second after the first's files."""
    tmp = tmp_path_factory.mktemp("train_job")
    dry_out = Path("runs") / f"test-deploy-dry-{os.getpid()}"  # relative to the repository, as in configs/tiny.yaml
    prep_out, job_out = tmp / "prep", tmp / "jobs"
    fake_ray = tmp / "ray"
    fake_ray.write_text(FAKE_RAY)
    fake_ray.chmod(0o755)
    FakeJobAPI.STATUSES = {f"mazerl-job-{state}": s for state, s in JOB_STATES.items() if s}
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJobAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"http://127.0.0.1:{server.server_address[1]}"
    closed = ThreadingHTTPServer(("127.0.0.1", 0), FakeJobAPI)  # bound, then closed: nothing listens there
    unreachable = f"http://127.0.0.1:{closed.server_address[1]}"
    closed.server_close()
    tiny = ("tests/tiny.yaml",)
    try:
        names = ["dry", "cluster", "first", "missing", "unreachable", *(f"job-{s}" for s in JOB_STATES)]
        runs = run_scripts(
            ((*tiny, f"output_dir={dry_out}", "--dry-run"), {}),
            (("configs/hyperpod.yaml", "--dry-run"), {}),
            ((*tiny, f"output_dir={prep_out}", "--prepare-only"), {}),
            ((str(ROOT.parent / "elsewhere.yaml"),), {}),
            (
                (*tiny, f"output_dir={job_out}", "run_name=job-x", "--address", unreachable),
                {"RAY_CLI": str(fake_ray), "FAKE_RAY_LOG": str(tmp / "unreachable.log")},
            ),
            *(
                (
                    (*tiny, f"output_dir={job_out}", f"run_name=job-{state}", "--address", address),
                    {"RAY_CLI": str(fake_ray), "FAKE_RAY_LOG": str(tmp / f"job-{state}.log")},
                )
                for state in JOB_STATES
            ),
        )
        eval_set = prep_out / "tiny" / "eval_set.json"
        first_content = eval_set.read_bytes() if eval_set.is_file() else None
        second, changed = run_scripts(
            ((*tiny, f"output_dir={prep_out}", "--prepare-only"), {}),
            ((*tiny, f"output_dir={prep_out}", "eval.num_mazes=4", "--prepare-only"), {}),
        )
    finally:
        server.shutdown()
        server.server_close()

    def ray_calls(name: str) -> list[list[str]]:
        log = tmp / f"{name}.log"
        return [shlex.split(line) for line in log.read_text().splitlines()] if log.is_file() else []

    return {
        **dict(zip(names, runs)),
        "dry_out": dry_out,
        "prep_out": prep_out,
        "job_out": job_out,
        "first_content": first_content,
        "second": second,
        "changed": changed,
        "ray_calls": ray_calls,
    }


def submit_argv(stdout: str) -> list[str]:
    return shlex.split(next(line for line in stdout.splitlines() if " job submit " in line))


def test_train_job_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


def test_dry_run_prints_the_submission_and_creates_nothing(script_runs):
    out, r = script_runs["dry_out"], script_runs["dry"]
    assert r.returncode == 0, r.stdout + r.stderr
    assert "placement group:" in r.stdout
    where = ROOT / out
    assert (
        f"would write {where}/tiny/eval_set.json" in r.stderr and f"would create {where}/tiny/checkpoints" in r.stderr
    )
    # a relative output_dir means one folder here and another in the job's working_dir: the script says so
    assert f"WARNING: output_dir={out} is relative" in r.stderr
    argv = submit_argv(r.stdout)
    assert argv[:3] == ["ray", "job", "submit"]
    assert argv[argv.index("--submission-id") + 1] == "mazerl-tiny"
    assert argv[argv.index("--working-dir") + 1] == "."
    assert argv[argv.index("--address") + 1] == "http://127.0.0.1:8265"
    assert argv[argv.index("--") + 1 :] == ["python", "-m", "app.main", "tests/tiny.yaml", f"output_dir={out}"]
    assert not where.exists(), "--dry-run must not create anything"


def driver_env_keys(monkeypatch) -> set[str]:
    """The env_vars keys that app.driver.cluster.connect_ray puts in its own ray.init runtime_env."""
    import ray

    from app.config import Config, PlacementConfig
    from app.driver.cluster import connect_ray

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
    connect_ray(Config(placement=PlacementConfig(ray_address="auto")))
    return set((seen.get("runtime_env") or {}).get("env_vars", {}))


def test_job_runtime_env_never_sets_the_drivers_env_vars(script_runs, monkeypatch):
    """Ray refuses to start a driver whose ray.init runtime_env shares env_vars keys with the job's."""
    argv = submit_argv(script_runs["dry"].stdout)
    job_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
    driver_keys = driver_env_keys(monkeypatch)
    assert driver_keys >= {"HF_HUB_OFFLINE"}
    assert not set(job_env.get("env_vars", {})) & driver_keys
    assert not set(job_env) - {"env_vars", "excludes"}, "a runtime_env field that the driver also sets would clash"
    assert not DRIVER_ENV_KEYS_FALLBACK - driver_keys, "update DRIVER_ENV_KEYS_FALLBACK (used for rayjob.yaml)"


def test_config_errors_stop_before_anything_is_created(script_runs):
    r = script_runs["missing"]
    assert r.returncode == 2 and "does not exist" in r.stderr and "job submit" not in r.stdout
    if Path("/shared/models").exists():
        pytest.skip("/shared/models exists here: the cluster config may be valid")
    r = script_runs["cluster"]
    assert r.returncode == 2, r.stdout + r.stderr
    assert "config error at '" in r.stderr and "nothing was created or submitted" in r.stderr
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:  # otherwise rollout.engine=vllm fails first
        assert "config error at 'model.path': /shared/models/Qwen3-VL-8B-Instruct is not a folder" in r.stderr
    assert "job submit" not in r.stdout


def test_a_config_outside_the_repository_is_refused(tmp_path):
    """The job runs in Ray's copy of the repository (its working_dir): a config outside it would not be there."""
    config = tmp_path / "tiny.yaml"
    config.write_text((ROOT / "tests" / "tiny.yaml").read_text())
    r = subprocess.run(["bash", str(SCRIPT), str(config), "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "is outside" in r.stderr and "job submit" not in r.stdout


def test_prepare_only_creates_the_run_and_eval_set_once(script_runs):
    from app.config import load_config
    from app.world.sampler import eval_mazes

    out, first = script_runs["prep_out"], script_runs["first"]
    assert first.returncode == 0, first.stdout + first.stderr
    run_dir = out / "tiny"
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "export"):
        assert folder.is_dir()
    eval_set = run_dir / "eval_set.json"
    content = script_runs["first_content"]
    data = json.loads(content)
    cfg = load_config(ROOT / "tests" / "tiny.yaml", [f"output_dir={out}"])
    expected = eval_mazes(cfg.eval.seed, cfg.eval.num_mazes, cfg.maze.size)
    assert [(m["seed"], m["identity"]) for m in data["mazes"]] == [(m.seed, m.identity) for m in expected]
    assert data["num_mazes"] == cfg.eval.num_mazes and data["max_turns"] == cfg.rollout.max_turns
    assert data["solvable_within_max_turns"] == sum(m["solvable"] for m in data["mazes"])
    assert "job submit" not in first.stdout

    second = script_runs["second"]  # run again: nothing changes
    assert second.returncode == 0, second.stdout + second.stderr
    assert "WARNING" not in second.stderr and f"exists      {eval_set}" in second.stderr
    changed = script_runs["changed"]  # another eval set: the file is kept, with a warning
    assert changed.returncode == 0 and "WARNING" in changed.stderr
    assert eval_set.read_bytes() == content


def test_running_again_acts_on_the_state_of_the_earlier_job(script_runs):
    """absent: submit; RUNNING: attach only; SUCCEEDED: nothing; FAILED: save its logs, delete, submit again."""
    out, calls = script_runs["job_out"], script_runs["ray_calls"]
    job = "mazerl-job-{}".format
    for state in JOB_STATES:
        r = script_runs[f"job-{state}"]
        assert r.returncode == 0, (state, r.stdout + r.stderr)
        assert (out / f"job-{state}" / "eval_set.json").is_file(), state

    def verbs(state):
        return [c[:2] for c in calls(f"job-{state}")]

    assert verbs("absent") == [["job", "submit"], ["job", "logs"]]
    submit, follow = calls("job-absent")
    assert submit[submit.index("--submission-id") + 1] == job("absent") and "--no-wait" in submit
    assert submit[submit.index("--") + 1 :] == [
        "python",
        "-m",
        "app.main",
        "tests/tiny.yaml",
        f"output_dir={out}",
        "run_name=job-absent",
    ]
    assert follow[-2:] == ["--follow", job("absent")]

    assert verbs("running") == [["job", "logs"]] and calls("job-running")[0][-2:] == ["--follow", job("running")]
    assert verbs("succeeded") == [] and "already succeeded" in script_runs["job-succeeded"].stdout

    assert verbs("failed") == [["job", "logs"], ["job", "delete"], ["job", "submit"], ["job", "logs"]]
    logs, delete, submit, follow = calls("job-failed")
    assert "--follow" not in logs and logs[-1] == delete[-1] == job("failed")
    assert submit[submit.index("--submission-id") + 1] == job("failed") and follow[-2:] == ["--follow", job("failed")]
    saved = list((out / "job-failed").glob("ray-job-*.log"))
    assert len(saved) == 1 and "fake log of job logs" in saved[0].read_text()


def test_an_unreachable_job_api_fails_without_submitting(script_runs):
    r = script_runs["unreachable"]
    assert r.returncode != 0 and "cannot reach the Ray job API" in r.stderr
    assert script_runs["ray_calls"]("unreachable") == []


# ---------------------------------------------------------------- docs/OPERATING.md

OPERATING = ROOT / "docs" / "OPERATING.md"


def doc_problems(text: str) -> list[str]:
    """What in an operating doc does not exist: repository paths, app.main overrides and flags, app.serve flags,
    train_job.sh options, exported metric names."""
    from app.config import field_docs
    from app.main import parse_args
    from app.observe.metrics import EXPORTED, prometheus_name

    problems = []
    for path in set(
        re.findall(r"(?<![\w/.-])((?:app|actors|placement|configs|deploy|scripts|tests)/[\w./-]*\w)", text)
    ):
        if not (ROOT / path).exists():
            problems.append(f"no such file: {path}")
    knobs = {name for name, _ in field_docs()}
    commands = re.sub(r"\\\n\s*", " ", text)
    for line in re.findall(r"python -m app\.main [^`\n]*", commands):
        try:
            args = parse_args(shlex.split(line)[3:])
        except SystemExit:
            problems.append(f"app.main rejects: {line}")
            continue
        problems += [f"no config knob: {key}" for key in (o.split("=")[0] for o in args.overrides) if key not in knobs]
    for override in re.findall(r"`((?:[a-z_]+\.)+[a-z_]+)=[^`\s]+", text):
        if override not in knobs:
            problems.append(f"no config knob: {override}")
    serve_source = "".join(p.read_text() for p in sorted((ROOT / "app" / "serve").glob("*.py")))
    for line in re.findall(r"python -m app\.serve [^`\n]*", commands):
        problems += [
            f"app.serve has no {flag}"
            for flag in re.findall(r"(?<!\S)(--[a-z-]+)", line)
            if f'"{flag}"' not in serve_source
        ]
    script = SCRIPT.read_text()
    for line in re.findall(r"train_job\.sh [^`\n]*", commands):
        problems += [
            f"train_job.sh has no {flag}"
            for flag in re.findall(r"(?<!\S)(--[a-z-]+)", line)
            if f"{flag})" not in script
        ]
        problems += [f"no config knob: {o}" for o in re.findall(r"(?<!\S)([a-z_.]+)=", line) if o not in knobs]
    exported = {prometheus_name(name) for name in EXPORTED}
    problems += [
        f"not an exported metric: {m}"
        for m in set(re.findall(r"\bray_mazerl_[a-z0-9_]*[a-z0-9]", text))
        if m not in exported
    ]
    return sorted(problems)


def test_operating_doc_covers_the_issue_and_names_only_things_that_exist():
    text = OPERATING.read_text()
    for section in ("Launch", "Watch", "Recover", "Export", "Serve"):
        assert re.search(rf"(?m)^## \d+\. {section}$", text), section
    for needed in (
        "deploy/grafana/mazerl.json",
        "(SERVING.md)",
        "python -m app.serve",
        "ray_mazerl_",
        "scripts/train_job.sh",
        "deploy/k8s/rayjob.yaml",
        "deploy/k8s/raycluster.yaml",
    ):
        assert needed in text, needed
    assert doc_problems(text) == []


DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "scripts/lab/README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_doc_names_only_files_knobs_and_flags_that_exist(doc):
    # the journal (docs/journal/) is history: it keeps the paths as they were
    assert doc_problems((ROOT / doc).read_text()) == []


def test_doc_check_finds_what_does_not_exist():
    bad = (
        "see `deploy/k8s/missing.yaml`; `python -m app.main configs/hyperpod.yaml train.learning_rate=1`; "
        "`python -m app.main --no-such-flag`; `python -m app.serve --model m --gpus 2`; "
        "`scripts/train_job.sh --resume lr=1`; `ray_mazerl_solve_rate`; set `rollout.top_k=5`"
    )
    assert set(doc_problems(bad)) == {
        "no such file: deploy/k8s/missing.yaml",
        "no config knob: train.learning_rate",
        "app.main rejects: python -m app.main --no-such-flag",
        "app.serve has no --gpus",
        "train_job.sh has no --resume",
        "no config knob: lr",
        "not an exported metric: ray_mazerl_solve_rate",
        "no config knob: rollout.top_k",
    }
