"""What the reference run's knobs must refuse before any actor starts: each is a policy the engines would not sample,
a file that does not fit the run, or a secret that would be printed.

Every refusal is one ConfigError naming the field and the fix (tests/config/test_config.py checks that shape).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.config import ConfigError, describe, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "tiny.yaml"


def adapter_folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    base = {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "peft_type": "LORA",
    }
    (folder / "adapter_config.json").write_text(json.dumps({**base, **config}))
    return folder


def refusal(*overrides: str, path: Path | None = TINY) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_config(path, list(overrides))
    return caught.value


def test_lora_dropout_is_refused_because_the_engines_sample_without_it():
    err = refusal("lora.dropout=0.05")
    assert err.field_path == "lora.dropout" and "lora.dropout=0" in err.fix


def test_an_adapter_init_that_fits_lora_passes(tmp_path):
    cfg = load_config(TINY, [f"model.adapter_init={adapter_folder(tmp_path)}"])
    assert cfg.model.adapter_init.endswith("adapter")


@pytest.mark.parametrize(
    "mismatch,field,fix",
    [
        ({"r": 32}, "lora.rank", "lora.rank=32"),
        ({"lora_alpha": 64}, "lora.alpha", "lora.alpha=64"),
        ({"target_modules": ["q_proj", "v_proj"]}, "lora.target_modules", "[q_proj, v_proj]"),
        ({"target_modules": "model.*(q_proj|v_proj)"}, "model.adapter_init", "list"),
        ({"use_rslora": True}, "model.adapter_init", "rslora"),
        ({"use_dora": True}, "model.adapter_init", "DoRA"),
        ({"peft_type": "IA3"}, "model.adapter_init", "LoRA"),
    ],
    ids=["rank", "alpha", "targets", "regex-targets", "rslora", "dora", "not-lora"],
)
def test_an_adapter_init_that_does_not_fit_lora_is_refused_at_load(tmp_path, mismatch, field, fix):
    err = refusal(f"model.adapter_init={adapter_folder(tmp_path, **mismatch)}")
    assert err.field_path == field and fix.lower() in (err.fix + err.problem).lower(), str(err)


def test_an_unreadable_adapter_config_is_one_clear_error(tmp_path):
    folder = adapter_folder(tmp_path)
    (folder / "adapter_config.json").write_text("{not json")
    assert refusal(f"model.adapter_init={folder}").field_path == "model.adapter_init"


def test_a_kl_penalty_is_refused_when_the_run_starts_from_a_warm_start(tmp_path):
    # the KL reference is the model with the adapter disabled: the pre-SFT base, not the policy the run starts from
    err = refusal(f"model.adapter_init={adapter_folder(tmp_path)}", "train.kl_coef=0.01")
    assert err.field_path == "train.kl_coef"
    assert refusal("sft.steps=5", "train.kl_coef=0.01").field_path == "train.kl_coef"
    assert load_config(TINY, ["train.kl_coef=0.01"]).train.kl_coef == 0.01  # from the base itself: the reference


def test_top_p_below_one_is_refused_because_the_trainer_scores_the_whole_distribution():
    err = refusal("rollout.top_p=0.9")
    assert err.field_path == "rollout.top_p" and "rollout.top_p=1" in err.fix


def test_an_empty_config_file_is_refused_not_run_on_the_defaults(tmp_path):
    for text in ("", "   \n# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        assert refusal(path=empty).field_path == "<config file>"
    assert load_config(None).run_name  # no file at all (tests, library use) still means the defaults


def test_credentials_in_the_s3_endpoint_are_refused_and_never_echoed():
    secret = "AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
    err = refusal(f"checkpoint.s3_endpoint_url=http://{secret}@127.0.0.1:7480", "checkpoint.s3_uri=s3://b/p")
    assert err.field_path == "checkpoint.s3_endpoint_url"
    assert "AKIA" not in str(err) and "wJalr" not in str(err) and "AWS_ACCESS_KEY_ID" in err.fix
    cfg = load_config(TINY, ["checkpoint.s3_endpoint_url=http://127.0.0.1:7480", "checkpoint.s3_uri=s3://b/p"])
    assert "127.0.0.1:7480" in describe(cfg)
