"""Pilot state at the edges: a step the loop left unfinished, a pending set_batch_size(), loads and saves in the
wrong place, checkpoints of differently built runs, a closed Pilot, and arguments that are not what they seem."""

from __future__ import annotations

import copy
import json
import logging
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

import batchpilot
from batchpilot.lr import SampleLRSchedule


def make_problem(n: int = 96, dropout: float = 0.0, batchnorm: bool = False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(6, 16)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(16))
    layers.append(torch.nn.Tanh())
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(16, 2))
    return TensorDataset(x, y), torch.nn.Sequential(*layers).double()


def build(**kwargs):
    ds, model = make_problem(dropout=kwargs.pop("dropout", 0.0), batchnorm=kwargs.pop("batchnorm", False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    settings = dict(batch_size=12, max_micro_batch_size=4, progress=False, seed=3)
    return model, batchpilot.Pilot(model, opt, ds, **{**settings, **kwargs})


def train(pilot, model, steps, stop=None, sizes=None):
    """Train to ``steps``; ``stop(pilot)`` True after a backward leaves the loop there (inside the step)."""
    for x, y in pilot.batches(max_steps=steps):
        if sizes is not None and pilot.micro_batch.micro_index == 0:
            sizes.append(pilot.micro_batch.global_size)
        with pilot.micro_step():  # needed with oom_recovery, a no-op without
            pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        if stop is not None and stop(pilot):
            break


def state_of(model):
    return [t.detach().clone() for t in model.state_dict().values()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def in_step_two(pilot):
    return pilot.step == 2 and pilot.micro_batch.micro_index == 1


@pytest.mark.parametrize("options", [dict(dropout=0.5), dict(dropout=0.5, batchnorm=True, oom_recovery=True)])
def test_a_step_left_unfinished_runs_again_with_the_same_random_draws(tmp_path, options):
    """Leaving the loop inside a step rewinds torch's RNG to the step's start (dropout draws again what the
    uninterrupted run drew), and with oom_recovery the module's buffers (BatchNorm's running statistics)."""
    model, pilot = build(**options)
    train(pilot, model, 6)
    reference = state_of(model)

    model, pilot = build(**options)
    train(pilot, model, 6, stop=in_step_two)
    assert pilot.step == 2
    pilot.save_checkpoint(tmp_path / "left.pt")
    train(pilot, model, 6)  # in the same process
    assert same(state_of(model), reference)

    model, pilot = build(**options)
    pilot.load_checkpoint(tmp_path / "left.pt")
    train(pilot, model, 6)  # in a new Pilot from the checkpoint
    assert same(state_of(model), reference)


def test_a_pending_set_batch_size_is_saved_and_a_load_replaces_it(tmp_path):
    def set_and_leave(pilot):
        if pilot.step == 2 and pilot.micro_batch.is_last:
            pilot.set_batch_size(20)
            assert pilot.batch_size == 20  # inside the step: the next step's size
            return True
        return False

    model, pilot = build(batch_size=8, max_micro_batch_size=None)
    train(pilot, model, 10, stop=set_and_leave)
    assert pilot.batch_size == 8  # between steps: the unfinished step runs again first, at its own size
    pilot.save_checkpoint(tmp_path / "pending.pt")
    continued: list[int] = []
    train(pilot, model, 6, sizes=continued)
    assert continued == [8, 20, 20, 20]

    model, resumed = build(batch_size=8, max_micro_batch_size=None)
    resumed.load_checkpoint(tmp_path / "pending.pt")
    sizes: list[int] = []
    train(resumed, model, 6, sizes=sizes)
    assert sizes == continued

    model, replaced = build(batch_size=8, max_micro_batch_size=None)
    train(replaced, model, 10, stop=set_and_leave)
    replaced.set_batch_size(12)  # between loops: replaces the 20 still pending from the unfinished step
    sizes = []
    train(replaced, model, 5, sizes=sizes)
    assert sizes == [12, 12, 12]

    model, other = build(batch_size=8, max_micro_batch_size=None)
    other.save_checkpoint(tmp_path / "plain.pt")  # step 0, nothing pending
    train(other, model, 10, stop=set_and_leave)
    other.load_checkpoint(tmp_path / "plain.pt")  # the stale 20 goes with the state it belonged to
    sizes = []
    train(other, model, 3, sizes=sizes)
    assert sizes == [8, 8, 8]


def test_loading_or_saving_inside_a_step_is_refused_and_changes_nothing(tmp_path):
    model, pilot = build(lr_rule="linear", base_batch_size=4)
    pilot.save_checkpoint(tmp_path / "start.pt")
    for x, y in pilot.batches(max_steps=3):
        pilot.backward(torch.nn.functional.cross_entropy(model(x), y))
        if pilot.step == 1 and pilot.micro_batch.micro_index == 0:
            lr = pilot.optimizer.param_groups[0]["lr"]
            with pytest.raises(RuntimeError, match=r"save_checkpoint\(\) was called in the middle of a step"):
                pilot.save_checkpoint(tmp_path / "mid.pt")
            with pytest.raises(RuntimeError, match=r"load_state_dict\(\) was called in the middle of a step"):
                pilot.load_checkpoint(tmp_path / "start.pt")
            assert pilot.optimizer.param_groups[0]["lr"] == lr == pytest.approx(0.3)  # the step's own LR
    assert pilot.step == 3 and not (tmp_path / "mid.pt").exists()


def _with_schedulers(kind):
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedulers = {"step": [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)],
                  "cosine": [torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)],
                  "samples": [SampleLRSchedule(opt, lambda s: 1.0 / (1 + s / 100))]}[kind]
    return model, batchpilot.Pilot(model, opt, ds, batch_size=8, progress=False, lr_schedulers=schedulers)


@pytest.mark.parametrize("saved, loaded", [("step", "cosine"), ("samples", "step"), ("step", "samples")])
def test_other_lr_schedulers_are_refused_before_anything_loads(tmp_path, saved, loaded):
    model, pilot = _with_schedulers(saved)
    train(pilot, model, 3)
    path = pilot.save_checkpoint(tmp_path / "s.pt")
    model, other = _with_schedulers(loaded)
    weights = state_of(model)
    with pytest.raises(batchpilot.CheckpointError, match="(?s)nothing was loaded.*LR schedulers are"):
        other.load_checkpoint(path)
    assert other.step == 0 and same(state_of(model), weights)
    # A checkpoint from before the classes were recorded: the state itself is checked against a copy.
    state = batchpilot.checkpoint.load_checkpoint(path)
    del state["pilot"]["lr_scheduler_classes"]
    if {saved, loaded} == {"step", "cosine"}:  # torch's schedulers share most keys: T_max is what cosine lacks
        with pytest.raises(batchpilot.CheckpointError, match=r"LR scheduler 0 \(.*CosineAnnealingLR\).*T_max"):
            other.load_state_dict(state)
    else:
        with pytest.raises(batchpilot.CheckpointError, match="LR scheduler 0"):
            other.load_state_dict(state)
    assert other.step == 0 and same(state_of(model), weights)


@pytest.mark.parametrize("kind", ["cyclic", "sequential", "onecycle", "lambda"])
def test_a_run_resumes_with_each_kind_of_torch_scheduler(kind):
    """The schedulers' states are tried on copies first: one that pops keys from the dict it loads (CyclicLR)
    must still load for real afterwards."""
    from torch.optim import lr_scheduler as lrs

    def make():
        ds, model = make_problem()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scheduler = {"cyclic": lambda: lrs.CyclicLR(opt, 0.01, 0.1, step_size_up=4),
                     "sequential": lambda: lrs.SequentialLR(opt, [lrs.LinearLR(opt, 0.1, total_iters=3),
                                                                  lrs.ExponentialLR(opt, 0.9)], milestones=[3]),
                     "onecycle": lambda: lrs.OneCycleLR(opt, max_lr=0.1, total_steps=100),
                     "lambda": lambda: lrs.LambdaLR(opt, lambda e: 0.9 ** e)}[kind]()
        return model, batchpilot.Pilot(model, opt, ds, batch_size=8, progress=False, lr_schedulers=[scheduler])

    model, pilot = make()
    train(pilot, model, 5)
    state = copy.deepcopy(pilot.state_dict())  # as torch.save would: the model's tensors are live
    train(pilot, model, 9)
    model2, resumed = make()
    resumed.load_state_dict(state)
    train(resumed, model2, 9)
    assert resumed.optimizer.param_groups[0]["lr"] == pilot.optimizer.param_groups[0]["lr"]
    assert same(state_of(model2), state_of(model))


def test_schedulers_that_cannot_be_copied_or_keep_attributes_out_of_their_state_still_resume(tmp_path):
    """The trial load on a copy is a check, not a requirement: a scheduler whose function belongs to an object
    that cannot be copied (an open file here), or that leaves an attribute out of its state as LambdaLR does,
    resumes as before."""
    from torch.optim import lr_scheduler as lrs

    class Schedule:
        def __init__(self, path):
            self.file = open(path, "a")  # noqa: SIM115 - an uncopyable member, closed below

        def factor(self, step):
            return 0.9 ** step

    class Halving(lrs.LRScheduler):
        def __init__(self, optimizer, fn):
            self.fn = fn  # not saved, like LambdaLR's lambdas
            super().__init__(optimizer)

        def get_lr(self):
            return [base * self.fn(self.last_epoch) for base in self.base_lrs]

        def state_dict(self):
            return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "fn")}

    schedule = Schedule(tmp_path / "side.txt")

    def make():
        ds, model = make_problem()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        schedulers = [lrs.LambdaLR(opt, schedule.factor), Halving(opt, lambda e: 0.5 ** e)]
        return model, batchpilot.Pilot(model, opt, ds, batch_size=8, progress=False, lr_schedulers=schedulers)

    model, pilot = make()
    train(pilot, model, 3)
    path = pilot.save_checkpoint(tmp_path / "s.pt")
    model, resumed = make()
    resumed.load_checkpoint(path)
    assert resumed.step == 3 and resumed.optimizer.param_groups[0]["lr"] == pilot.optimizer.param_groups[0]["lr"]
    schedule.file.close()


def test_a_state_that_is_not_a_pilot_state_gets_a_clear_error():
    model, pilot = build()
    with pytest.raises(batchpilot.CheckpointError, match="not a Pilot state .*lacks pilot, model"):
        pilot.load_state_dict(model.state_dict())
    with pytest.raises(batchpilot.CheckpointError, match="a Pilot state is a dict"):
        pilot.load_state_dict([1, 2])  # type: ignore[arg-type]
    state = pilot.state_dict()
    del state["pilot"]["samples_seen"]
    with pytest.raises(batchpilot.CheckpointError, match="pilot.samples_seen"):
        pilot.load_state_dict(state)


def test_a_loaded_batch_size_outside_this_pilots_bounds_is_clamped(tmp_path, caplog):
    model, pilot = build(batch_size=32, max_micro_batch_size=None, log_path=tmp_path / "log.jsonl")
    train(pilot, model, 2)
    path = pilot.save_checkpoint(tmp_path / "big.pt")
    train(pilot, model, 3)  # lines past the checkpoint: the resumed run cuts them, not its own decision
    pilot.close()
    model, bounded = build(batch_size=8, max_batch_size=16, max_micro_batch_size=None, log_path=tmp_path / "log.jsonl")
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        bounded.load_checkpoint(path)
    assert "batch size 32 lies outside" in caplog.text
    sizes: list[int] = []
    train(bounded, model, 4, sizes=sizes)
    assert sizes == [16, 16]
    bounded.close()
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["type"], r.get("step")) for r in lines] == [("step", 1), ("step", 2), ("decision", 2), ("step", 3),
                                                           ("step", 4)]
    assert lines[2]["old_size"] == 32 and lines[2]["new_size"] == 16


@pytest.mark.parametrize("how", ["state_dict", "save_checkpoint"])
def test_a_clamped_resume_trains_its_first_step_at_the_lr_of_the_clamped_size(tmp_path, how):
    # state_dict() taken between steps holds the coupling scaled for 32; loaded outside the loop into a Pilot
    # bounded at 16, its first step used 32's factor (twice the LR) because batches() saw it scaled already.
    model, pilot = build(batch_size=32, max_micro_batch_size=None, lr_rule="linear", base_batch_size=8)
    saved = {}
    pilot.add_callback(lambda p, record: saved.setdefault("state", copy.deepcopy(p.state_dict())) if p.step == 2 else None)
    pilot.add_callback(lambda p, record: p.save_checkpoint(tmp_path / "c.pt") if p.step == 2 else None)
    train(pilot, model, 3)
    model, bounded = build(batch_size=8, max_batch_size=16, max_micro_batch_size=None, lr_rule="linear",
                           base_batch_size=8)
    if how == "state_dict":
        bounded.load_state_dict(saved["state"])
    else:
        bounded.load_checkpoint(tmp_path / "c.pt")
    sizes: list[int] = []
    train(bounded, model, 3, sizes=sizes)
    assert sizes == [16] and bounded.last_record["lr"] == pytest.approx(0.1 * 16 / 8)


def test_resuming_without_a_feature_the_run_had_warns(tmp_path, caplog):
    model, pilot = build(lr_rule="adascale", noise_every=2)
    train(pilot, model, 2)
    path = pilot.save_checkpoint(tmp_path / "ada.pt")
    model, plain = build()
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        plain.load_checkpoint(path)
    assert "saved with lr_rule='adascale', this Pilot runs without it" in caplog.text
    caplog.clear()
    model, other_period = build(lr_rule="adascale", noise_every=8)
    with caplog.at_level(logging.WARNING, logger="batchpilot"):
        other_period.load_checkpoint(path)
    assert "noise_every=8, but the checkpoint's run measured the noise scale every 2 steps" in caplog.text
    assert other_period._noise is not None and other_period._noise.every == 2


def test_save_checkpoint_into_a_folder(tmp_path):
    model, pilot = build()
    train(pilot, model, 2)
    (tmp_path / "existing").mkdir()
    assert pilot.save_checkpoint(tmp_path / "existing") == tmp_path / "existing" / "step-000000002.pt"
    assert pilot.save_checkpoint(f"{tmp_path / 'new'}/") == tmp_path / "new" / "step-000000002.pt"
    model, resumed = build()
    assert resumed.load_checkpoint(tmp_path / "new") == tmp_path / "new" / "step-000000002.pt"
    assert resumed.step == 2


def test_a_closed_pilot_keeps_training_and_logging(tmp_path):
    model, pilot = build(log_path=tmp_path / "log.jsonl")
    train(pilot, model, 2)
    pilot.close()
    train(pilot, model, 4)
    path = pilot.save_checkpoint(tmp_path / "after-close.pt")
    pilot.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()
             if '"type": "step"' in line]
    assert steps == [1, 2, 3, 4] and path.is_file()


@pytest.mark.parametrize("kwargs, message", [
    (dict(shuffle="False"), "shuffle must be True or False, got 'False'"),
    (dict(drop_last="no"), "drop_last must be True or False"),
    (dict(skip_nonfinite="off"), "skip_nonfinite must be True or False"),
    (dict(progress="yes"), "progress must be True or False"),
    (dict(prefetch_factor=4), "prefetch_factor=4 needs worker processes"),
    (dict(collate_fn=3), "collate_fn must be a function"),
    (dict(lr_schedulers=[lambda: None]), r"lr_schedulers\[0\] .* has no step\(\), state_dict\(\), load_state_dict"),
    (dict(lr_schedulers="cosine"), "lr_schedulers must be a list"),
])
def test_arguments_that_are_not_what_they_seem_are_refused(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        build(**kwargs)


def test_a_dataloader_or_a_plain_object_passed_as_the_dataset_is_refused():
    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"dataset is a torch DataLoader; pass its dataset \(loader.dataset\)"):
        batchpilot.Pilot(model, opt, torch.utils.data.DataLoader(ds, batch_size=8), batch_size=8)

    class Sized:
        def __len__(self):
            return 10

    with pytest.raises(TypeError, match="cannot be indexed"):
        batchpilot.Pilot(model, opt, Sized(), batch_size=8)


def test_the_default_progress_setting_goes_without_a_bar_quietly_when_tqdm_is_missing(monkeypatch, recwarn):
    from batchpilot.logs import ProgressBar

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    ProgressBar(100, None)
    assert not [w for w in recwarn if "tqdm" in str(w.message)]
    with pytest.warns(UserWarning, match="progress=True needs tqdm"):
        ProgressBar(100, True)


def test_a_missing_tensorboard_leaves_no_log_file_behind(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[tensorboard\]"'):
        build(log_path=tmp_path / "log.jsonl", tensorboard_dir=tmp_path / "tb")
    assert not (tmp_path / "log.jsonl").exists()


def test_add_callback_refuses_what_it_cannot_call():
    _, pilot = build()
    with pytest.raises(TypeError, match=r"add_callback\(\) takes a function"):
        pilot.add_callback(3)  # type: ignore[arg-type]


def test_a_failing_controller_saves_the_finished_step_before_stopping(tmp_path):
    """A controller returning 0 at step 5 stops the run with its error; with a checkpoint_dir the finished step
    is saved first (none was due until step 100), so a fixed controller resumes from step 5, nothing lost."""
    def controller(step, size):
        return 0 if step == 5 else size

    model, pilot = build(controller=controller, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=100)
    with pytest.raises(batchpilot.controllers.InvalidDecisionError) as info:
        train(pilot, model, 20)
    assert pilot.step == 5
    if sys.version_info >= (3, 11):
        assert any("saved the finished step 5" in note for note in info.value.__notes__)
    weights = state_of(model)
    model, resumed = build(controller=lambda step, size: size, checkpoint_dir=tmp_path / "ckpt")
    assert resumed.load_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step-000000005.pt"
    assert resumed.step == 5 and same(state_of(model), weights)


def test_numpy_integers_as_settings_give_loadable_checkpoints_and_plain_int_decisions(tmp_path):
    np = pytest.importorskip("numpy")
    model, pilot = build(noise_every=np.int64(2), controller=lambda step, size: 64, max_batch_size=np.int64(16),
                         max_micro_batch_size=None, lr_rule="adascale", log_path=tmp_path / "log.jsonl",
                         grad_clip=np.float32(1.0))
    train(pilot, model, 3)
    path = pilot.save_checkpoint(tmp_path / "np.pt")
    pilot.close()
    model, resumed = build(noise_every=2, controller=lambda step, size: 64, max_batch_size=16,
                           max_micro_batch_size=None, lr_rule="adascale")
    resumed.load_checkpoint(path)  # torch.load(weights_only=True) refuses numpy scalars
    assert resumed.step == 3
    decisions = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines() if '"decision"' in line]
    assert decisions and all(type(d["new_size"]) is int for d in decisions)  # not the string "16"


def test_a_skipped_step_does_not_step_per_step_schedulers():
    from torch.optim import lr_scheduler as lrs

    ds, model = make_problem()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = lrs.StepLR(opt, step_size=1, gamma=0.5)
    pilot = batchpilot.Pilot(model, opt, ds, batch_size=8, progress=False, lr_schedulers=[scheduler])
    for x, y in pilot.batches(max_steps=3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        pilot.backward(loss * float("nan") if pilot.step == 1 else loss)
    assert pilot.skipped_steps == 1 and scheduler.last_epoch == 2  # two updates, two scheduler steps
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_half_precision_gradient_norms_do_not_overflow():
    from batchpilot.clipping import grad_norm

    layer = torch.nn.Linear(300, 300).half()
    layer.weight.grad = torch.full((300, 300), 300.0, dtype=torch.float16)  # every element finite, norm 90000
    layer.bias.grad = torch.zeros(300, dtype=torch.float16)
    assert grad_norm(layer.parameters()) == pytest.approx(90000, rel=1e-3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(amp="fp16", half=True), "amp='fp16' needs float32 parameters"),
    (dict(lr_knee=0), "lr_knee must be"),
    (dict(batch_size=0, lr_rule="linaer"), r"(?s)batch_size.*unknown lr_rule 'linaer'"),  # reported together
    (dict(other_optimizer=True), "built on another optimizer"),
])
def test_settings_refused_when_the_pilot_is_built(kwargs, message):
    from torch.optim import lr_scheduler as lrs

    ds, model = make_problem()
    if kwargs.pop("half", False):
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if kwargs.pop("other_optimizer", False):
        kwargs["lr_schedulers"] = [lrs.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)]
    kwargs.setdefault("batch_size", 8)
    with pytest.raises((TypeError, ValueError), match=message):
        batchpilot.Pilot(model, opt, ds, progress=False, **kwargs)


def test_a_checkpoint_of_a_partly_compiled_model_names_the_real_difference(tmp_path):
    ds, model = make_problem()
    model[0] = torch.compile(model[0], backend="eager")  # one submodule compiled: its keys gain '_orig_mod.'
    pilot = batchpilot.Pilot(model, torch.optim.SGD(model.parameters(), lr=0.1), ds, batch_size=8, progress=False)
    path = pilot.save_checkpoint(tmp_path / "part.pt")
    _, eager = build()
    with pytest.raises(batchpilot.CheckpointError, match="only torch.compile's '_orig_mod.' in the names differs"):
        eager.load_checkpoint(path)
