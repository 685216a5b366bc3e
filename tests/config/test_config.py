"""Tests for app.config: YAML + dotted overrides, and validation that fails before anything starts.

Every bad config must end in one `ConfigError` whose message is one line, names the field and says
"Fix:"; no other exception may escape `load_config`, whatever the YAML or the overrides hold.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.machinery
import importlib.util
import json
import math
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import app.config.checks as config_module
from app.config import (
    LANGUAGE_MODEL_PROJECTIONS,
    Config,
    ConfigError,
    apply_override,
    check_combinations,
    describe,
    field_docs,
    from_dict,
    load_config,
    min_maze_turns,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
TINY, H200, HYPERPOD = ROOT / "tests" / "tiny.yaml", CONFIGS / "h200.yaml", CONFIGS / "hyperpod.yaml"

fast = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def get_path(obj: Any, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), obj)


def assert_one_line_error(err: ConfigError, field_path: str) -> None:
    """The shape every ConfigError must have: one line, the field named, and a fix."""
    text = str(err)
    assert isinstance(err, ValueError)
    assert "\n" not in text and "\r" not in text, f"message spans several lines: {text!r}"
    if field_path.isprintable():
        assert f"'{field_path}'" in text, text
    else:  # control characters are shown escaped, as ConfigError writes them
        escaped = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in field_path)
        assert escaped in text, text
    assert "Fix:" in text, text
    assert err.fix.strip() and err.problem.strip(), text


def _fake_find_spec(installed: bool):
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec("vllm", None) if installed else None
        return real(name, *args, **kwargs)

    return find_spec


@pytest.fixture
def vllm_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the vllm-availability check pass whether or not vllm is in this venv."""
    monkeypatch.setattr(config_module.importlib.util, "find_spec", _fake_find_spec(True))


@pytest.fixture
def vllm_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module.importlib.util, "find_spec", _fake_find_spec(False))


# ---------------------------------------------------------------- the table of bad configs

MISSING, FOLDER = object(), object()  # special sources: a config file that does not exist / is a folder

# (id, source, overrides, field_path, substring of the message, check_paths)
# source: None (defaults), YAML text ("{tmp}" becomes tmp_path), bytes (written raw), MISSING or FOLDER.
BAD = [
    # unknown keys, with a did-you-mean
    ("unknown-top-level", "trian:\n  lr: 0.1\n", [], "trian", "did you mean 'train'", False),
    ("unknown-nested-lr_rate", "train: {lr_rate: 1}\n", [], "train.lr_rate", "did you mean 'lr'", False),
    (
        "unknown-nested-typo",
        "rollout: {temprature: 1.0}\n",
        [],
        "rollout.temprature",
        "did you mean 'temperature'",
        False,
    ),
    ("unknown-deep-override", None, ["model.tiny.hidden=64"], "model.tiny.hidden", "did you mean 'hidden_size'", False),
    ("unknown-nothing-close", "train: {zzzzzz: 1}\n", [], "train.zzzzzz", "valid keys: lr, epochs", False),
    ("unknown-section-override", None, ["optimizer.lr=0.1"], "optimizer", "unknown key", False),
    # a section given a scalar or a list
    ("section-scalar", "train: 5\n", [], "train", "key: value", False),
    ("section-list", "model: [a, b]\n", [], "model", "key: value", False),
    ("nested-section-scalar", "model: {tiny: 3}\n", [], "model.tiny", "key: value", False),
    ("section-override-scalar", None, ["lora=8"], "lora", "key: value", False),
    # wrong types
    ("str-for-int", "train: {epochs: three}\n", [], "train.epochs", "whole number", False),
    ("float-for-int", "rollout: {max_turns: 15.5}\n", [], "rollout.max_turns", "whole number", False),
    ("integral-float-for-int", "train: {epochs: 2.0}\n", [], "train.epochs", "whole number", False),
    (
        "int-for-bool",
        "model: {gradient_checkpointing: 1}\n",
        [],
        "model.gradient_checkpointing",
        "true or false",
        False,
    ),
    ("str-for-bool", None, ["eval.at_start=sometimes"], "eval.at_start", "true or false", False),
    ("bool-for-int", "train: {epochs: true}\n", [], "train.epochs", "whole number", False),
    ("bool-for-float", "train: {lr: true}\n", [], "train.lr", "number", False),
    ("str-for-float", "rollout: {temperature: hot}\n", [], "rollout.temperature", "number", False),
    ("null-for-int", "train: {epochs: null}\n", [], "train.epochs", "whole number", False),
    ("list-for-str", "run_name: [a, b]\n", [], "run_name", "quote", False),
    ("int-for-str", None, ["model.path=7"], "model.path", "quote", False),
    ("dict-for-optional-str", "checkpoint: {s3_uri: {bucket: b}}\n", [], "checkpoint.s3_uri", "quote", False),
    ("str-for-list", "lora: {target_modules: q_proj}\n", [], "lora.target_modules", "YAML list", False),
    ("list-item-wrong-type", "lora: {target_modules: [q_proj, 3]}\n", [], "lora.target_modules[1]", "quote", False),
    # Literal choices
    ("engine-tgi", "rollout: {engine: tgi}\n", [], "rollout.engine", "'vllm'", False),
    ("continuous-on-hf", None, ["rollout.engine=hf", "rollout.schedule=continuous"], "rollout.schedule", "vLLM", False),
    ("glob-in-output-dir", None, ["rollout.engine=vllm", "output_dir=/tmp/run[1]"], "output_dir", "glob", False),
    ("glob-in-model-path", None, ["rollout.engine=vllm", "model.path=/m/qwen*"], "model.path", "glob", False),
    (
        "checkpointed-share-without-checkpointing",
        None,
        ["model.checkpointed_layers=0.5"],
        "model.checkpointed_layers",
        "gradient_checkpointing is off",
        False,
    ),
    (
        "tower-rate-without-tower",
        None,
        ["lora.tower_lr_scale=0.5"],
        "lora.tower_lr_scale",
        "only the LoRA trains",
        False,
    ),
    (
        "keep-weights-no-sleep",
        None,
        ["rollout.sleep_level=0", "rollout.keep_weights=true"],
        "rollout.keep_weights",
        "sleep_level",
        False,
    ),
    ("play-ahead-sleeping", None, ["rollout.play_ahead=true"], "rollout.play_ahead", "sleep_level=0", False),
    (
        "play-ahead-uncorrected",
        None,
        ["rollout.play_ahead=true", "rollout.sleep_level=0"],
        "rollout.play_ahead",
        "rollout_ratio_cap",
        False,
    ),
    (
        "play-ahead-keeping-weights",
        None,
        ["rollout.play_ahead=true", "rollout.sleep_level=0", "rollout.keep_weights=true"],
        "rollout.play_ahead",
        "keep_weights=false",
        False,
    ),
    (
        "process-on-hf",
        None,
        ["rollout.engine=hf", "rollout.engine_process=true"],
        "rollout.engine_process",
        "vLLM",
        False,
    ),
    (
        "resume-mode-sometimes",
        "checkpoint: {resume_mode: sometimes}\n",
        [],
        "checkpoint.resume_mode",
        "'latest'",
        False,
    ),
    ("sleep-level-2", "rollout: {sleep_level: 2}\n", [], "rollout.sleep_level", "use one of 0, 1", False),
    ("sleep-level-bool", "rollout: {sleep_level: true}\n", [], "rollout.sleep_level", "use one of 0, 1", False),
    ("sleep-level-float", "rollout: {sleep_level: 1.0}\n", [], "rollout.sleep_level", "use one of 0, 1", False),
    ("dtype-float16", None, ["model.dtype=float16"], "model.dtype", "'bfloat16'", False),
    ("advantage-ppo", None, ["train.advantage=ppo"], "train.advantage", "'drgrpo'", False),
    # out-of-range values
    ("lr-zero", "train: {lr: 0}\n", [], "train.lr", "> 0.0", False),
    ("lr-negative", "train: {lr: -0.001}\n", [], "train.lr", "> 0.0", False),
    ("lr-above-one", None, ["train.lr=2.0"], "train.lr", "<= 1.0", False),
    ("n-samples-zero", "rollout: {n_samples_per_prompt: 0}\n", [], "rollout.n_samples_per_prompt", ">= 1", False),
    ("temperature-zero", "rollout: {temperature: 0}\n", [], "rollout.temperature", "> 0.0", False),
    ("gpu-mem-1.5", "rollout: {gpu_memory_utilization: 1.5}\n", [], "rollout.gpu_memory_utilization", "<= 0.95", False),
    ("lora-dropout-1", "lora: {dropout: 1.0}\n", [], "lora.dropout", "< 1.0", False),
    ("lora-rank-1024", None, ["lora.rank=1024"], "lora.rank", "<= 512", False),
    ("maze-size-3", "maze: {size: 3}\n", [], "maze.size", ">= 5", False),
    ("gpus-per-bundle-2", None, ["placement.gpus_per_bundle=2"], "placement.gpus_per_bundle", "<= 1", False),
    ("clip-high-nan", "train: {clip_high: .nan}\n", [], "train.clip_high", "not a finite number", False),
    ("huge-int-for-float", None, ["train.clip_high=" + "9" * 400], "train.clip_high", "Fix:", False),
    # impossible combinations
    (
        "batch-not-divisible",
        None,
        ["train.mazes_per_step=3", "rollout.n_samples_per_prompt=3", "placement.num_bundles=2"],
        "train.mazes_per_step",
        "multiple of placement.num_bundles (2)",
        False,
    ),
    (
        "hyperpod-batch-over-5-ranks",
        None,
        ["train.mazes_per_step=48", "placement.num_bundles=5"],
        "train.mazes_per_step",
        "placement.num_bundles (5)",
        False,
    ),
    (
        "maze-11-in-15-turns",
        "maze: {size: 11}\nrollout: {max_turns: 15}\n",
        [],
        "rollout.max_turns",
        "at least 17",
        False,
    ),
    ("maze-even", None, ["maze.size=8"], "maze.size", "odd size", False),
    (
        "informative-without-refill",
        None,
        ["train.min_informative_groups=4"],
        "train.refill_rounds",
        "set train.refill_rounds",
        False,
    ),
    (
        "informative-unreachable",
        None,
        ["train.mazes_per_step=4", "train.min_informative_groups=9", "train.refill_rounds=1"],
        "train.min_informative_groups",
        "2 rounds of 4 mazes",
        False,
    ),
    (
        "grpo-one-sample",
        None,
        ["rollout.n_samples_per_prompt=1", "train.advantage=grpo"],
        "rollout.n_samples_per_prompt",
        "2 or more",
        False,
    ),
    (
        "kv-heads-not-dividing",
        "model: {tiny: {num_heads: 4, num_kv_heads: 3}}\n",
        [],
        "model.tiny.num_kv_heads",
        "divisor",
        False,
    ),
    (
        "vision-lora-qkv",
        None,
        ["lora.target_modules=[q_proj, qkv]"],
        "lora.target_modules",
        "language model only",
        False,
    ),
    (
        "vision-lora-fc1",
        None,
        ["lora.target_modules=[linear_fc1]"],
        "lora.target_modules",
        "language model only",
        False,
    ),
    (
        "resume-path-without-path",
        "checkpoint: {resume_mode: path}\n",
        [],
        "checkpoint.resume_path",
        "set checkpoint.resume_path",
        False,
    ),
    ("s3-not-s3", None, ["checkpoint.s3_uri=http://bucket/prefix"], "checkpoint.s3_uri", "s3://bucket/prefix", False),
    ("s3-no-bucket", None, ["checkpoint.s3_uri=s3://"], "checkpoint.s3_uri", "s3://bucket/prefix", False),
    ("s3-empty-bucket", None, ["checkpoint.s3_uri=s3:///prefix"], "checkpoint.s3_uri", "s3://bucket/prefix", False),
    ("run-name-slash", "run_name: a/b\n", [], "run_name", "plain folder name", False),
    ("run-name-empty", None, ["run_name="], "run_name", "plain folder name", False),
    ("run-name-dotdot", None, ["run_name=.."], "run_name", "plain folder name", False),
    # missing paths (check_paths=True)
    ("model-path-missing", None, ["model.path={tmp}/no-such-model"], "model.path", "is not a folder", True),
    ("model-path-no-config-json", None, ["model.path={tmp}"], "model.path", "config.json", True),
    (
        "adapter-init-no-adapter-config",
        None,
        ["model.adapter_init={tmp}"],
        "model.adapter_init",
        "adapter_config.json",
        True,
    ),
    (
        "adapter-init-missing",
        None,
        ["model.adapter_init={tmp}/nope"],
        "model.adapter_init",
        "adapter_config.json",
        True,
    ),
    (
        "resume-path-missing",
        None,
        ["checkpoint.resume_mode=path", "checkpoint.resume_path={tmp}/ckpt-9"],
        "checkpoint.resume_path",
        "does not exist",
        True,
    ),
    # bad overrides
    ("override-no-equals", None, ["train.lr"], "train.lr", "train.lr=1e-5", False),
    ("override-empty-segment", None, ["train..lr=1"], "train..lr", "dotted names", False),
    ("override-value-as-section", "train: {lr: 0.1}\n", ["train.lr.x=1"], "train.lr.x", "'lr' is a value", False),
    ("override-value-as-section-no-file", None, ["run_name.x=1"], "run_name", "quote", False),
    # the file itself
    ("yaml-syntax-error", "train: {lr: 1\n", [], "<config file>", "not valid YAML", False),
    ("yaml-bad-indent", "train:\n  lr: 1\n   epochs: 2\n", [], "<config file>", "not valid YAML", False),
    ("yaml-is-a-list", "- a\n- b\n", [], "<config file>", "not a mapping", False),
    ("yaml-is-a-scalar", "42\n", [], "<config file>", "not a mapping", False),
    ("yaml-duplicate-tag-garbage", "train: {lr: !!float abc}\n", [], "<config file>", "Fix:", False),
    ("yaml-int-tag-garbage", "train: {epochs: !!int x}\n", [], "<config file>", "Fix:", False),
    ("yaml-bool-tag-garbage", "model: {gradient_checkpointing: !!bool maybe}\n", [], "<config file>", "Fix:", False),
    ("yaml-not-utf8", b"train:\n  lr: \xff\xfe\n", [], "<config file>", "Fix:", False),
    ("config-file-missing", MISSING, [], "<config file>", "does not exist", False),
    ("config-file-is-folder", FOLDER, [], "<config file>", "Fix:", False),
]


def _load_case(tmp_path: Path, source: Any, overrides: list[str], check_paths: bool) -> Config:
    tmp = str(tmp_path)
    overrides = [o.replace("{tmp}", tmp) for o in overrides]
    if source is None:
        path = None
    elif source is MISSING:
        path = tmp_path / "no-such-config.yaml"
    elif source is FOLDER:
        path = tmp_path
    else:
        path = tmp_path / "run.yaml"
        if isinstance(source, bytes):
            path.write_bytes(source)
        else:
            path.write_text(source.replace("{tmp}", tmp))
    return load_config(path, overrides, check_paths=check_paths)


@pytest.mark.parametrize(
    ("source", "overrides", "field_path", "needle", "check_paths"),
    [row[1:] for row in BAD],
    ids=[row[0] for row in BAD],
)
def test_bad_config_is_one_config_error(
    tmp_path: Path, source: Any, overrides: list[str], field_path: str, needle: str, check_paths: bool
) -> None:
    with pytest.raises(ConfigError) as info:
        _load_case(tmp_path, source, overrides, check_paths)
    err = info.value
    assert err.field_path == field_path, str(err)
    assert needle in str(err), str(err)
    assert_one_line_error(err, field_path)


def test_table_is_big_enough_and_ids_unique() -> None:
    ids = [row[0] for row in BAD]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 25


def test_vllm_engine_without_vllm(vllm_missing: None) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm"])
    assert info.value.field_path == "rollout.engine"
    assert "rollout.engine=hf" in str(info.value)
    assert_one_line_error(info.value, "rollout.engine")


def test_vllm_cpu_head_dim(vllm_installed: None) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm", "placement.gpus_per_bundle=0", "model.tiny.head_dim=48"])
    assert info.value.field_path == "model.tiny.head_dim"
    assert_one_line_error(info.value, "model.tiny.head_dim")
    # on a GPU bundle, or with hf, the same head_dim is fine
    assert load_config(
        None, ["rollout.engine=vllm", "placement.gpus_per_bundle=1", "model.dtype=bfloat16", "model.tiny.head_dim=48"]
    )
    assert load_config(None, ["rollout.engine=hf", "model.tiny.head_dim=48"])


@pytest.mark.parametrize(
    ("overrides", "field_path"),
    [
        (['model.path="a\\nb"'], "model.path"),
        (['model.adapter_init="a\\nb"'], "model.adapter_init"),
        (["checkpoint.resume_mode=path", 'checkpoint.resume_path="a\\nb"'], "checkpoint.resume_path"),
    ],
    ids=["model.path", "adapter_init", "resume_path"],
)
def test_values_with_newlines_still_give_one_line(overrides: list[str], field_path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.field_path == field_path
    assert_one_line_error(info.value, field_path)


def test_unknown_key_with_newline_gives_one_line(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text('train: {"l\\nr": 1}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "\n" not in text and "Fix:" in text, repr(text)


def test_empty_model_path_is_rejected(tmp_path: Path) -> None:
    """'' is not a model folder; the check must not fall back to the current directory."""
    for check_paths in (False, True):
        with pytest.raises(ConfigError) as info:
            load_config(None, ["model.path="], check_paths=check_paths)
        assert info.value.field_path == "model.path"
        assert_one_line_error(info.value, "model.path")


def test_config_file_that_is_a_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "does not exist" not in str(info.value), "the folder exists; the message should say it is not a file"


def test_override_of_a_plain_value_as_section_suggests_the_right_fix() -> None:
    """run_name is a value: the fix must not tell the user to write run_name.<key>."""
    raw = {"run_name": "x"}
    with pytest.raises(ConfigError) as info:
        apply_override(raw, "run_name.sub=1")
    assert info.value.field_path == "run_name.sub"
    assert "run_name.<key>" not in info.value.fix, str(info.value)


def test_override_with_empty_key_names_something() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["=5"])
    assert info.value.field_path, "the error must name the override it rejects"
    assert "Fix:" in str(info.value)


# ---------------------------------------------------------------- combinations that are fine


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.advantage=drgrpo", "rollout.n_samples_per_prompt=1"],
        ["train.mazes_per_step=3", "rollout.n_samples_per_prompt=2", "placement.num_bundles=3"],
        ["maze.size=11", "rollout.max_turns=17"],
        ["maze.size=5", "rollout.max_turns=5"],
        ["model.tiny.num_heads=8", "model.tiny.num_kv_heads=8"],
        ["checkpoint.s3_uri=s3://bucket", "checkpoint.s3_uri=s3://bucket/a/b"],
        ["checkpoint.resume_mode=none", "checkpoint.resume_path=/nowhere"],
        ["run_name=my-run_2"],
        ["rollout.play_ahead=true", "rollout.sleep_level=0", "train.rollout_ratio_cap=2"],
    ],
    ids=[
        "drgrpo-one-sample",
        "divides",
        "maze11-17turns",
        "maze5-5turns",
        "mha",
        "s3",
        "resume-none",
        "run-name",
        "play-ahead",
    ],
)
def test_valid_edge_combinations_load(overrides: list[str]) -> None:
    assert isinstance(load_config(None, overrides), Config)


def test_turn_budget_boundary() -> None:
    for size in (5, 7, 9, 11, 13):
        need = min_maze_turns(size)
        assert load_config(None, [f"maze.size={size}", f"rollout.max_turns={need}"]).rollout.max_turns == need
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"maze.size={size}", f"rollout.max_turns={need - 1}"])
        assert info.value.field_path == "rollout.max_turns"
    assert min_maze_turns(9) <= 15 < min_maze_turns(11)


def test_existing_paths_pass(tmp_path: Path) -> None:
    model, adapter, ckpt = tmp_path / "model", tmp_path / "adapter", tmp_path / "ckpt"
    for folder in (model, adapter, ckpt):
        folder.mkdir()
    (model / "config.json").write_text("{}")
    peft = {"r": 32, "lora_alpha": 64, "target_modules": LANGUAGE_MODEL_PROJECTIONS, "peft_type": "LORA"}
    (adapter / "adapter_config.json").write_text(json.dumps(peft))
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            f"model.adapter_init={adapter}",
            "checkpoint.resume_mode=path",
            f"checkpoint.resume_path={ckpt}",
        ],
    )
    assert cfg.model.path == str(model) and cfg.checkpoint.resume_path == str(ckpt)


def test_check_paths_false_skips_the_file_system(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            f"model.path={tmp_path}/absent",
            f"model.adapter_init={tmp_path}/absent",
            "checkpoint.resume_mode=path",
            f"checkpoint.resume_path={tmp_path}/absent",
        ],
        check_paths=False,
    )
    assert cfg.model.path.endswith("absent")


# ---------------------------------------------------------------- bounds, derived from the declarations


def _leaf_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(_leaf_fields(hints[f.name], name))
        else:
            out.append((name, f, hints[f.name]))
    return out


LEAVES = _leaf_fields()
SECTIONS = sorted(
    {name.rsplit(".", 1)[0] for name, _, _ in LEAVES if "." in name}
    | {name.rsplit(".", 2)[0] for name, _, _ in LEAVES if name.count(".") >= 2}
)
BOUNDED = [
    (name, key, f.metadata[key], tp)
    for name, f, tp in LEAVES
    for key in ("ge", "gt", "le", "lt")
    if f.metadata.get(key) is not None
]


def _raw_with(path: str, value: Any, base: dict | None = None) -> dict:
    raw = copy.deepcopy(base) if base else {}
    node = raw
    parts = path.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
    return raw


@pytest.mark.parametrize(("path", "key", "bound", "tp"), BOUNDED, ids=[f"{b[0]}-{b[1]}" for b in BOUNDED])
def test_every_declared_bound_is_enforced(path: str, key: str, bound: float, tp: type) -> None:
    step = 1 if tp is int else 0.5
    outside = {"ge": bound - step, "gt": bound, "le": bound + step, "lt": bound}[key]
    inside = {"ge": bound, "gt": bound + step, "le": bound, "lt": bound - step}[key]
    if tp is int:
        outside, inside = int(outside), int(inside)
    with pytest.raises(ConfigError) as info:
        from_dict(Config, _raw_with(path, outside), "")
    assert info.value.field_path == path
    assert_one_line_error(info.value, path)
    from_dict(Config, _raw_with(path, inside), "")  # the bound itself (or just inside) is accepted


# ---------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("override", "path", "expected", "tp"),
    [
        ("train.lr=1e-5", "train.lr", 1e-5, float),
        ("train.lr=3e-6", "train.lr", 3e-6, float),
        ("train.lr=1.0e-5", "train.lr", 1e-5, float),
        ("train.lr=0.25", "train.lr", 0.25, float),
        ("train.lr=1", "train.lr", 1.0, float),
        ("train.epochs=3", "train.epochs", 3, int),
        ("model.gradient_checkpointing=true", "model.gradient_checkpointing", True, bool),
        ("eval.at_start=false", "eval.at_start", False, bool),
        ("rollout.engine=hf", "rollout.engine", "hf", str),
        ("rollout.sleep_level=0", "rollout.sleep_level", 0, int),
        ("lora.target_modules=[q_proj, v_proj]", "lora.target_modules", ["q_proj", "v_proj"], list),
        ("model.adapter_init=null", "model.adapter_init", None, type(None)),
        ("checkpoint.s3_uri=s3://bucket/prefix", "checkpoint.s3_uri", "s3://bucket/prefix", str),
        ("checkpoint.ckpt_path=", "checkpoint.ckpt_path", "", str),
        ("run_name=a=b", "run_name", "a=b", str),
        (" train.seed = 7", "train.seed", 7, int),
        ("placement.ray_address=auto", "placement.ray_address", "auto", str),
    ],
)
def test_override_values_are_yaml_typed(override: str, path: str, expected: Any, tp: type) -> None:
    value = get_path(load_config(None, [override]), path)
    assert value == expected
    assert type(value) is tp


def test_exponent_without_dot_in_a_yaml_file_is_a_number(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-5\n")
    assert load_config(path).train.lr == 1e-5


def test_later_overrides_win() -> None:
    cfg = load_config(None, ["train.epochs=3", "train.epochs=5", "rollout.engine=hf"])
    assert cfg.train.epochs == 5
    cfg = load_config(TINY, ["maze.size=9", "rollout.max_turns=13", "maze.size=7"])
    assert (cfg.maze.size, cfg.rollout.max_turns) == (7, 13)


def test_overrides_apply_on_top_of_the_file() -> None:
    base = load_config(TINY)
    cfg = load_config(TINY, ["train.seed=7", "lora.rank=8"])
    assert (cfg.train.seed, cfg.lora.rank) == (7, 8)
    # everything else is the file's, not the defaults'
    assert cfg.lora.alpha == base.lora.alpha == 32
    assert cfg.train.lr == base.train.lr == 2e-4
    assert dataclasses.replace(cfg, train=base.train, lora=base.lora) == base


def test_override_replaces_a_value_from_the_file_with_a_section_error(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train: 5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["train.lr=0.1"])
    assert info.value.field_path == "train.lr"
    assert_one_line_error(info.value, "train.lr")


def test_override_creates_nested_sections() -> None:
    cfg = load_config(None, ["model.tiny.hidden_size=64", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1"])
    assert (cfg.model.tiny.hidden_size, cfg.model.tiny.num_heads, cfg.model.tiny.num_kv_heads) == (64, 2, 1)
    assert cfg.model.tiny.num_layers == Config().model.tiny.num_layers
    assert cfg.model.path == "tiny"


def test_override_fills_an_empty_section(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\ntrain:\n  lr: 0.5\n")
    cfg = load_config(path, ["model.dtype=bfloat16"])
    assert cfg.model.dtype == "bfloat16" and cfg.train.lr == 0.5


def test_override_on_h200_switches_engine_without_vllm(vllm_missing: None) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(H200)
    assert info.value.field_path == "rollout.engine"
    fix = str(info.value).split("rollout.engine=hf", 1)[1].split()  # the whole fix, in overrides
    cfg = load_config(H200, ["rollout.engine=hf", *[word for word in fix if "=" in word]])
    assert cfg.rollout.engine == "hf" and cfg.run_name == "h200"


def test_apply_override_parses_into_the_raw_dict() -> None:
    raw: dict = {"train": {"lr": 0.1}}
    apply_override(raw, "train.epochs=4")
    apply_override(raw, "model.tiny.seed=3")
    apply_override(raw, "lora.target_modules=[q_proj]")
    assert raw == {
        "train": {"lr": 0.1, "epochs": 4},
        "model": {"tiny": {"seed": 3}},
        "lora": {"target_modules": ["q_proj"]},
    }


def test_every_knob_can_be_overridden_with_its_default() -> None:
    defaults = dataclasses.asdict(Config())
    overrides = []
    for name, _, _ in LEAVES:
        value = functools.reduce(lambda d, k: d[k], name.split("."), defaults)
        text = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
        overrides.append(f"{name}={text}")
    assert load_config(None, overrides) == Config()


# ---------------------------------------------------------------- shipped configs


def test_defaults_are_valid() -> None:
    assert load_config(None) == Config()
    check_combinations(Config())


def test_tiny_yaml_loads() -> None:
    cfg = load_config(TINY)
    assert cfg.run_name == "tiny" and cfg.model.path == "tiny"
    assert cfg.rollout.engine == "hf" and cfg.placement.gpus_per_bundle == 0
    assert cfg.maze.size == 7 and cfg.rollout.max_turns >= min_maze_turns(7)
    assert cfg.episodes_per_step % cfg.placement.num_bundles == 0
    assert cfg.episodes_per_step == 32 and cfg.total_steps == 8


def test_h200_yaml_loads(vllm_installed: None) -> None:
    cfg = load_config(H200)
    assert cfg.run_name == "h200" and cfg.rollout.engine == "vllm"
    assert cfg.placement.gpus_per_bundle == 1 and cfg.model.dtype == "bfloat16"
    assert cfg.train.lr == 1e-5


def test_hyperpod_yaml_has_the_published_values(vllm_installed: None) -> None:
    cfg = load_config(HYPERPOD, check_paths=False)
    assert cfg.lora.rank == 32
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.rollout.max_turns == 15
    assert cfg.eval.eval_interval == 10
    assert cfg.checkpoint.ckpt_interval == 20
    assert cfg.checkpoint.hf_save_interval == 20
    assert cfg.checkpoint.resume_mode == "latest"
    assert cfg.train.lr == 3e-6
    assert cfg.train.epochs == 20
    assert cfg.placement.num_bundles == 6 and cfg.placement.gpus_per_bundle == 1
    assert cfg.rollout.gpu_memory_utilization == 0.45
    assert cfg.placement.colocate_all is True
    assert cfg.maze.size == 9 and cfg.rollout.engine == "vllm"
    assert cfg.episodes_per_step % cfg.placement.num_bundles == 0


def test_hyperpod_yaml_checks_paths(vllm_installed: None) -> None:
    if Path("/shared/models/Qwen3-VL-8B-Instruct").exists():
        pytest.skip("the /shared volume is mounted here")
    with pytest.raises(ConfigError) as info:
        load_config(HYPERPOD)
    assert info.value.field_path == "model.path"
    assert_one_line_error(info.value, "model.path")


@pytest.mark.parametrize("path", [TINY, H200, HYPERPOD], ids=lambda p: p.name)
def test_describe_round_trips(path: Path, vllm_installed: None) -> None:
    cfg = load_config(path, check_paths=False)
    text = describe(cfg)
    again = from_dict(Config, yaml.safe_load(text), "")
    assert again == cfg


# ---------------------------------------------------------------- docs


def test_every_knob_has_a_one_line_doc() -> None:
    docs = field_docs()
    names = [name for name, _ in docs]
    assert len(names) == len(set(names))
    assert set(names) == {name for name, _, _ in LEAVES}
    for name, doc in docs:
        assert isinstance(doc, str) and doc.strip(), f"{name} has no doc"
        assert "\n" not in doc and "\r" not in doc, f"{name}'s doc spans several lines"
        get_path(Config(), name)  # every listed name is a real attribute


def test_every_section_has_a_one_line_doc() -> None:
    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            doc = f.metadata.get("doc", "")
            assert doc.strip() and "\n" not in doc, f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(Config, "")


# ---------------------------------------------------------------- properties: never a traceback

KNOWN_PATHS = [name for name, _, _ in LEAVES] + SECTIONS
FIELD_NAMES = sorted({part for p in KNOWN_PATHS for part in p.split(".")})
TINY_RAW = yaml.safe_load(TINY.read_text())

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["tiny", "hf", "vllm", "latest", "path", "grpo", "s3://b/p", "q_proj", "qkv", ""])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
placements = st.lists(st.tuples(st.sampled_from(KNOWN_PATHS), json_values), min_size=1, max_size=3)


def _build(base: dict, placed: list[tuple[str, Any]]) -> dict:
    raw = copy.deepcopy(base)
    for path, value in placed:
        raw = _raw_with(path, value, raw)
    return raw


@fast
@given(base=st.sampled_from([{}, TINY_RAW]), placed=placements, check_paths=st.booleans())
@example(base={}, placed=[("train.clip_high", 10**400)], check_paths=False)
@example(base={}, placed=[("rollout.temperature", 10**400)], check_paths=False)
@example(base={}, placed=[("train", None)], check_paths=False)
def test_any_value_anywhere_is_config_or_config_error(base: dict, placed: list, check_paths: bool) -> None:
    raw = _build(base, placed)
    try:
        cfg = from_dict(Config, raw, "")
        check_combinations(cfg, check_paths=check_paths)
    except ConfigError as err:
        assert err.field_path is not None and "Fix:" in str(err)
    else:
        assert isinstance(cfg, Config)


@fast
@given(placed=placements)
@example(placed=[("model.path", "a\nb")])
@example(placed=[("model", {"a\nb": 1})])
def test_any_config_error_is_one_line_naming_its_field(placed: list) -> None:
    try:
        cfg = from_dict(Config, _build({}, placed), "")
        check_combinations(cfg, check_paths=True)
    except ConfigError as err:
        assert_one_line_error(err, err.field_path)


@fast
@given(
    path=st.sampled_from(KNOWN_PATHS),
    text=st.text(max_size=20)
    | json_values.map(
        lambda v: yaml.safe_dump(v, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()
    ),
)
@example(path="train.lr", text="!!float abc")
@example(path="train.epochs", text="!!int x")
@example(path="model.gradient_checkpointing", text="!!bool maybe")
@example(path="checkpoint.s3_uri", text="!!timestamp x")
def test_any_override_value_is_config_or_config_error(path: str, text: str) -> None:
    try:
        cfg = load_config(None, [f"{path}={text}"], check_paths=False)
    except ConfigError as err:
        assert "Fix:" in str(err)
    else:
        assert isinstance(cfg, Config)


@fast
@given(item=st.text(max_size=30))
@example(item="=")
@example(item="a.=1")
@example(item="train.lr=[")
def test_any_override_string_is_config_or_config_error(item: str) -> None:
    try:
        load_config(None, [item], check_paths=False)
    except ConfigError as err:
        assert "Fix:" in str(err)


@fast
@given(text=st.text(max_size=60) | json_values.map(lambda v: yaml.safe_dump(v, width=10**6)))
@example(text="train: {lr: !!float abc}\n")
@example(text="? [a]\n: 1\n")
@example(text="a: &x [*x]\nlora: {target_modules: *x}\n")
def test_any_yaml_file_is_config_or_config_error(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("y", numbered=True) / "run.yaml"
    path.write_text(text)
    try:
        load_config(path, check_paths=False)
    except ConfigError as err:
        assert "Fix:" in str(err)


def test_non_finite_floats_in_bounded_fields() -> None:
    for path in ("train.lr", "rollout.temperature", "rollout.top_p", "lora.dropout"):
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ConfigError) as info:
                from_dict(Config, _raw_with(path, value), "")
            assert info.value.field_path == path


def test_lora_default_targets_are_language_model_only() -> None:
    assert Config().lora.target_modules == LANGUAGE_MODEL_PROJECTIONS
    assert Config().lora.target_modules is not LANGUAGE_MODEL_PROJECTIONS  # no shared mutable default


def test_vllm_on_gpu_refuses_float32(vllm_installed: None) -> None:
    # vLLM's Triton LoRA kernels assert fp16/bf16 inputs: found on the H200, where the engine died at start
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm", "placement.gpus_per_bundle=1", "model.dtype=float32"])
    assert_one_line_error(info.value, "model.dtype")
    assert "bfloat16" in str(info.value)
    assert load_config(None, ["rollout.engine=vllm", "placement.gpus_per_bundle=1", "model.dtype=bfloat16"])
    assert load_config(None, ["rollout.engine=vllm", "placement.gpus_per_bundle=0", "model.dtype=float32"])


def test_a_fractional_gpu_bundle_lets_two_jobs_share_one_gpu():
    from placement.plan import make_plan

    cfg = load_config(
        None,
        [
            "rollout.engine=vllm",
            "model.dtype=bfloat16",
            "placement.gpus_per_bundle=0.5",
            "rollout.gpu_memory_utilization=0.2",
        ],
    )
    plan = make_plan(cfg)
    assert plan.total_gpus == 0.5 and plan.rollout_gpus == plan.trainer_gpus == 0.25


def test_engines_sharing_a_gpu_need_a_given_kv_cache_and_room(vllm_installed: None) -> None:
    gpu = [
        "rollout.engine=vllm",
        "model.dtype=bfloat16",
        "placement.gpus_per_bundle=1",
        "placement.rollouts_per_bundle=4",
    ]
    with pytest.raises(ConfigError) as info:  # engines starting together would measure each other's memory
        load_config(None, [*gpu, "rollout.gpu_memory_utilization=0.1"])
    assert_one_line_error(info.value, "rollout.kv_cache_gb")
    with pytest.raises(ConfigError) as info:  # 4 x 0.2 of the GPU at start is more than the rollout half of it
        load_config(None, [*gpu, "rollout.kv_cache_gb=2", "rollout.gpu_memory_utilization=0.2"])
    assert_one_line_error(info.value, "rollout.gpu_memory_utilization")
    assert "0.125" in str(info.value)
    cfg = load_config(None, [*gpu, "rollout.kv_cache_gb=2", "rollout.gpu_memory_utilization=0.1"])
    from placement.plan import describe, make_plan

    plan = make_plan(cfg)
    assert plan.num_rollouts == 4 and plan.num_pairs == 1
    assert plan.rollout_gpus == 0.125 and plan.trainer_gpus == 0.5 and plan.total_gpus == 1
    assert [plan.rollout_bundle(j) for j in range(4)] == [0, 0, 0, 0]
    assert "rollout-3 (GPU 0.125" in describe(plan)
    # on a CPU, or with the transformers engine, nothing is measured: several engines a bundle need no kv_cache_gb
    assert load_config(None, ["placement.rollouts_per_bundle=3"]).placement.rollouts_per_bundle == 3


def test_rollout_actors_fill_bundles_in_order() -> None:
    from placement.plan import describe, make_plan

    plan = make_plan(
        load_config(None, ["placement.num_bundles=2", "placement.rollouts_per_bundle=3", "placement.cpus_per_bundle=6"])
    )
    assert [plan.rollout_bundle(j) for j in range(plan.num_rollouts)] == [0, 0, 0, 1, 1, 1]
    assert plan.rollout_cpus == 1.0 and plan.trainer_cpus == 3.0 and plan.total_cpus == 12 + 0.2
    text = describe(plan)
    assert "bundle 1: {'CPU': 6.0} -> rollout-3 (GPU 0, CPU 1, 2 threads), rollout-4" in text
    assert "trainer-1 (GPU 0, CPU 3, 6 threads)" in text  # phases alternate: the trainer computes with the bundle


def test_colocated_actors_compute_with_the_whole_bundles_cpus_as_threads() -> None:
    from placement import plan as placement
    from placement.plan import make_plan

    def plan(*overrides):
        return make_plan(load_config(None, list(overrides)))

    one = plan("placement.cpus_per_bundle=1.8")  # the default job's 2-core laptop: the head keeps 0.2
    placement.check_cluster(one, {"CPU": 2.0})  # 1.8 + 0.1 + 0.1 in floats is 2.0000000000000004
    placement.check_nodes(one, [{"CPU": 2.0, "node:__internal_head__": 1.0}])
    assert placement.simulate(one, [("laptop", {"CPU": 2.0})]) == ["laptop"]
    assert (one.trainer_cpus, one.trainer_threads, one.rollout_threads) == (0.9, 2, 2)
    assert (plan("placement.cpus_per_bundle=0.5").trainer_threads, plan().rollout_threads) == (1, 1)
    apart = plan("placement.colocate_all=false", "placement.cpus_per_bundle=4")
    assert (apart.trainer_cpus, apart.trainer_threads, apart.rollout_threads) == (4, 4, 4)
    chosen = plan("placement.cpus_per_bundle=8", "placement.threads=3", "placement.rollouts_per_bundle=2")
    assert (chosen.trainer_threads, chosen.rollout_threads) == (3, 1)
    with pytest.raises(ConfigError, match="placement.threads"):
        load_config(None, ["placement.threads=-1"])
