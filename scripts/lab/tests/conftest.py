"""The product's test fixtures (tests/conftest.py: the tiny model, engines, S3 servers) for the lab's tests, and the
one sft+grpo run that the learn.sh tests of several modules share."""

import pytest
from lab_shell import SMOKE, run_script

from tests.conftest import *  # noqa: F403  (fixtures and the GPU/vLLM skip hook)
from tests.conftest import pytest_collection_modifyitems  # noqa: F401


@pytest.fixture(scope="session")
def sft_then_grpo(tmp_path_factory):
    """One sft+grpo call of the tiny model: (OUT, WORK, the finished process)."""
    root = tmp_path_factory.mktemp("learn")
    out, work = root / "out", root / "work"
    # this is about the stages' plumbing (GRPO's learning has tests/learning/test_learning.py); 6 minutes bound the
    # stages on a busy machine, the run itself stops after its one GRPO step and 3 control steps
    done = run_script(
        ["scripts/lab/learn.sh", "sft+grpo", str(out), str(work), "6"],
        CONFIG="tests/tiny.yaml",
        DEVICE="cpu",
        EVAL_EVERY="1",
        SFT_MINUTES="0.1",
        SIZES="7",
        SFT_LRS="3e-4",
        WARMUP="1",
        EXTRA=f"sft.steps=3 train.max_steps=1 {SMOKE}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out, work, done
