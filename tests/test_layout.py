"""The layout keeps its shape: data flows one way through the folders, modules stay small, the lab stays apart.

Layers, lowest first: a package imports only from its own layer's package or from layers below it.

    app.config                                  every knob, typed and checked
    app.world                                   the maze, its picture, the dialogue, the sampler
    app.model                                   Qwen3-VL models built or loaded, the LoRA as data
    app.rollout                                 engines and the episode loop
    app.learning, app.storage, app.observe      the GRPO update; checkpoints and stores; metrics and reports
    app.serve                                   the OpenAI-compatible serving app
    actors, placement                           Ray actors over the library; where they go
    app.driver                                  the cluster's lifecycle and the phases of a step
    app.main                                    the entry point and the driver loop
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    {"app.config"},
    {"app.world"},
    {"app.model"},
    {"app.rollout"},
    {"app.learning", "app.storage", "app.observe"},
    {"app.serve"},
    {"actors", "placement"},
    {"app.driver"},
    {"app.main"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
PRODUCT = ("app", "actors", "placement")
MAX_LINES = 400


def package_of(module: str) -> str:
    parts = [p for p in module.split(".") if p != "__init__"]
    return ".".join(parts[:2]) if parts[0] == "app" and len(parts) > 1 else parts[0]


def product_modules() -> list[Path]:
    return sorted(p for top in PRODUCT for p in (ROOT / top).rglob("*.py"))


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if node.module == "app" else node.module for a in node.names]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return found


def test_every_product_package_has_a_layer():
    packages = {package_of(".".join(p.relative_to(ROOT).with_suffix("").parts)) for p in product_modules()}
    assert packages - {"app"} <= set(LAYER), f"add {sorted(packages - set(LAYER) - {'app'})} to LAYERS"


@pytest.mark.parametrize("path", product_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_down_the_layers_and_never_reach_the_lab(path):
    here = package_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
    for line, module in imports_of(path):
        top = module.split(".")[0]
        assert top not in ("scripts", "tests"), f"{path.name}:{line} imports {module}: the product never imports those"
        if top not in PRODUCT or here == "app":
            continue
        there = package_of(module)
        if there == here:
            continue
        assert LAYER[there] < LAYER[here], (
            f"{path.relative_to(ROOT)}:{line} imports {module}: {here} (layer {LAYER[here]}) may only import "
            f"from the layers below it, and {there} is layer {LAYER[there]}"
        )


@pytest.mark.parametrize(
    "path", product_modules() + sorted((ROOT / "scripts").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_modules_stay_under_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by idea"


def test_product_files_speak_of_the_product_not_of_experiments():
    # a diary's words (the Nth attempt or run), the notes outside the repository, and in code the lab's folder
    diary = re.compile(
        r"\battempt\b|\battempts\b(?! *[=:\"])|\.\./shared|\b(?:first|second|third|fourth|fifth|sixth|"
        r"seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth) (?:GPU )?(?:attempt|run)\b",
        re.IGNORECASE,
    )
    files = [
        *product_modules(),
        ROOT / "setup.cfg",
        *(ROOT / "configs" / n for n in ("tiny.yaml", "h200.yaml", "hyperpod.yaml")),
    ]
    found = [
        f"{f.relative_to(ROOT)}:{i}: {line.strip()}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if diary.search(line.replace("max_attempts", "")) or (f.suffix == ".py" and "scripts/lab" in line)
    ]
    assert not found, "\n".join(found)
