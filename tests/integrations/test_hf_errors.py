"""AdaptiveBatchSizeTrainer's refusals and packaging: settings it cannot honour, invalid schedulers, a
missing or too old framework named with its fix; the example runs end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _hf_common import PointSet, Recorder
from _hf_helpers import quiet_args
from transformers import TrainingArguments

from batchpilot.controllers import Constant
from batchpilot.integrations.hf import AdaptiveBatchSizeTrainer

REPO = Path(__file__).resolve().parents[2]
SAMPLING_STRATEGY = "train_sampling_strategy" in TrainingArguments.__dataclass_fields__  # newer 5.x releases


def test_an_own_train_sampler_is_refused(tmp_path):
    class Weighted(AdaptiveBatchSizeTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.WeightedRandomSampler([1.0] * 20, 20)

    with pytest.raises(ValueError, match="Weighted overrides _get_train_sampler"):
        Weighted(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(auto_find_batch_size=True), "auto_find_batch_size"),
        (dict(logging_steps=0.1), "logging_steps=0.1"),
        (dict(train_sampling_strategy="group_by_length") if SAMPLING_STRATEGY else dict(group_by_length=True),
         "train_sampling_strategy"),
    ],
)
def test_unsupported_arguments_are_rejected(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path, **overrides))


def test_invalid_scheduler_settings_fail_at_construction(tmp_path):
    with pytest.raises(ValueError, match="min_batch_size=8 is larger than max_batch_size=4"):
        AdaptiveBatchSizeTrainer(model=Recorder(), train_dataset=PointSet(20), args=quiet_args(tmp_path),
                                 min_batch_size=8, max_batch_size=4)
    with pytest.raises(ValueError, match="callable"):
        AdaptiveBatchSizeTrainer(batch_size_scheduler=42, model=Recorder(), train_dataset=PointSet(20),
                                 args=quiet_args(tmp_path))
    # Trainer's positional order would make the model (a callable nn.Module) the scheduler.
    with pytest.raises(TypeError, match="got a torch.nn.Module \\(Recorder\\); pass the model and the rest by keyword"):
        AdaptiveBatchSizeTrainer(Recorder(), quiet_args(tmp_path), train_dataset=PointSet(20))
    with pytest.raises(ValueError, match="must be an instance, got the class Constant"):
        AdaptiveBatchSizeTrainer(batch_size_scheduler=Constant, model=Recorder(), train_dataset=PointSet(20),
                                 args=quiet_args(tmp_path))


def test_a_scheduler_returning_nonsense_is_stopped(tmp_path):
    trainer = AdaptiveBatchSizeTrainer(
        batch_size_scheduler=lambda step, size: 0, model=Recorder(), train_dataset=PointSet(20),
        args=quiet_args(tmp_path, num_train_epochs=1),
    )
    with pytest.raises(ValueError, match="returned 0"):
        trainer.train()


@pytest.mark.parametrize("module, extra", [("transformers", "hf"), ("lightning", "lightning")])
def test_missing_framework_names_the_extra_and_the_core_never_imports_it(module, extra):
    integration = "hf" if extra == "hf" else "lightning"
    code = (
        "import sys\n"
        "import batchpilot, batchpilot.integrations, batchpilot.controllers, batchpilot.lr\n"
        f"assert {module!r} not in sys.modules, 'the core imported {module}'\n"
        f"sys.modules[{module!r}] = None\n"
        "try:\n"
        f"    import batchpilot.integrations.{integration}\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f'pip install -e ".[{extra}]"' in out.stdout and "which is not installed" in out.stdout


@pytest.mark.parametrize("package, fake, expected", [
    # transformers 5 turns Trainer into a placeholder under torch < 2.6: say so instead of failing later.
    ("torch", "2.5.1+cpu", "needs torch >= 2.6"),
    # The trainer overrides Trainer internals of transformers 5; a 4.x install must be told, not misbehave.
    ("transformers", "4.45.2", "needs transformers >= 5.0, < 6"),
])
def test_the_hf_integration_names_the_versions_it_needs(package, fake, expected):
    code = (f"import {package}\n{package}.__version__ = {fake!r}\ntry:\n    import batchpilot.integrations.hf\n"
            "except ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout and fake in out.stdout


def test_example_runs_end_to_end(tmp_path):
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "hf_text_classification.py"), "--output-dir", str(tmp_path),
         "--epochs", "2", "--train-samples", "120", "--eval-samples", "40", "--interval", "5", "--max-size", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["samples_seen"] == 240 and summary["epochs"] == 2.0 and summary["final_batch_size"] > 4

