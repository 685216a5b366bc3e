"""How `python -m app.serve` joins Ray: its own local cluster unless --address names one."""

from __future__ import annotations

from pathlib import Path

import pytest


class Joined(Exception):
    pass


@pytest.mark.parametrize(("argv", "address"), [([], "local"), (["--address", "auto"], "auto")])
def test_without_an_address_the_server_starts_its_own_cluster(monkeypatch, tiny_model_dir, tmp_path, argv, address):
    """Given None, ray.init joins the cluster named in /tmp/ray/ray_current_cluster, and waits on it without a word
    when that cluster is gone."""
    import ray

    from app.serve import deployment

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        raise Joined

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Joined):
        deployment.main(["--model", str(tiny_model_dir), "--adapters", str(tmp_path), *argv])
    assert seen["address"] == address


def test_without_adapters_the_model_alone_is_served(tiny_model_dir, tmp_path):
    """A merged model (every weight trained) is served as --model with no adapters root; a root is kept as given."""
    from app.serve import deployment

    alone = deployment.settings_from_args(deployment.parse_args(["--model", str(tiny_model_dir)]))
    assert alone.adapters_root is None
    local = deployment.settings_from_args(deployment.parse_args(["--model", str(tiny_model_dir), "--adapters", "x"]))
    assert local.adapters_root == str(Path("x").resolve())
    s3 = ["--model", str(tiny_model_dir), "--adapters", "s3://bucket/run/export"]
    assert deployment.settings_from_args(deployment.parse_args(s3)).adapters_root == "s3://bucket/run/export"
