"""`AdaptiveDataLoader`: loops left anywhere, set_epoch with steps planned ahead, drop_last tails with and
without workers, refused datasets and settings, and augmentation that depends on the position only."""

from __future__ import annotations

import numpy as np
import pytest
import torch


# ------------------------------------------------------------------------------------------- loops and epochs
@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_last_loader_loops_are_whole_epochs(num_workers):
    """A loop ends at an epoch's last full step (as Lightning's does, without asking for one more batch);
    the next loop must be the next epoch. In process it used to be empty every other time."""
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(50)), 7, drop_last=True, num_workers=num_workers)
    epochs = []
    for _ in range(4):
        steps = []
        for micro in loader:
            steps.append(micro.epoch)
            if len(steps) == 7:
                break
        epochs.append(steps)
    assert epochs == [[e] * 7 for e in range(4)]
    # Epochs 0-2 dropped one sample each; epoch 3's tail is left (workers' planning ahead stops at a tail
    # without dropping it, as in process: a smaller size set before the next step could still take it).
    assert loader.sampler.dropped_samples == 3
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_loops_left_anywhere_keep_data_with_indices_and_epochs_exact(num_workers):
    """AdaptiveDataLoader on its own, looped over again and again: loops left at random points (inside a
    step too), sizes changed between steps. Every micro-batch's data is its indices' rows, and the steps whose
    last micro-batch was yielded cover each epoch exactly once (a step left unfinished is planned again).
    With workers this used to fail: a new loop started the worker iterator twice and mispaired the data."""
    import random

    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    n = 97
    ds = TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    rng = random.Random(num_workers)
    loader = AdaptiveDataLoader(ds, 7, max_micro_batch_size=3, num_workers=num_workers, seed=1)
    consumed: dict[int, list[int]] = {}
    try:
        while len(consumed) <= 4:
            step: list[int] = []
            for micro in loader:
                assert torch.equal(micro.data[1], torch.as_tensor(micro.indices.tolist()))
                step.extend(micro.indices.tolist())
                if micro.micro_index == micro.accumulation_steps - 1:
                    consumed.setdefault(micro.epoch, []).extend(step)
                    step = []
                    if rng.random() < 0.3:
                        loader.set_batch_size(rng.randint(1, 20))
                if rng.random() < 0.15:
                    break
    finally:
        loader.close()
    finished = sorted(consumed)[:-1]
    assert len(finished) == 4
    assert all(sorted(consumed[e]) == list(range(n)) for e in finished)


@pytest.mark.parametrize("num_workers, micro", [(0, 2), (2, None)])
def test_set_epoch_after_a_loop_left_early_starts_that_epoch(num_workers, micro):
    """The DistributedSampler pattern with a break: planned (prefetched, or the rest of a step) micro-batches
    must not undo the user's set_epoch."""
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(40)), 4, max_micro_batch_size=micro,
                                num_workers=num_workers, seed=3)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        first = None
        for i, m in enumerate(loader):
            first = first or (m.epoch, m.offset)
            if i == 2:
                break
        assert first == (epoch, 0)
    loader.sampler.set_epoch(2)  # the epoch of the next step already: resume-safe no-op
    assert next(iter(loader)).epoch == 2 and loader.position()[1] > 0
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_after_a_loop_left_early_holds_for_the_position_a_checkpoint_and_a_size_change(num_workers):
    """With workers, steps after the break are already planned: a set_epoch made then must show in
    position(), next_step_size() and state_dict(), and survive a size change and close()."""
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(100)), 10, num_workers=num_workers, seed=3)
    try:
        for i, _ in enumerate(loader):
            if i == 2:
                break
        loader.sampler.set_epoch(1)
        assert loader.position() == (1, 0, 30) and loader.epochs_done() == 1
        state = loader.state_dict()
        assert (state["epoch"], state["offset"], state["samples_seen"]) == (1, 0, 30)
        loader.set_batch_size(20)
        assert loader.next_step_size() == 20
        loader.close()
        first = next(iter(loader))
        assert (first.epoch, first.offset, first.global_size) == (1, 0, 20)
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropped_samples_count_every_tail_in_the_set_epoch_loop(num_workers):
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(10)), 4, num_workers=num_workers, drop_last=True)
    try:
        for epoch in range(4):
            loader.sampler.set_epoch(epoch)
            assert [(m.epoch, m.global_size) for m in loader] == [(epoch, 4), (epoch, 4)]
            # Without workers the loop drops the tail as it ends; with them, the next loop does.
            pending = 2 if loader.sampler.at_tail_to_drop() else 0
            assert loader.sampler.dropped_samples + pending == 2 * (epoch + 1)
    finally:
        loader.close()


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_smaller_size_set_at_an_epochs_tail_takes_it_with_or_without_workers(num_workers):
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(100)), 30, drop_last=True, num_workers=num_workers, seed=0)
    sizes: list[tuple[int, int]] = []
    while len(sizes) < 6:  # loops over the loader (with workers the tail step may come in the next one)
        for m in loader:
            sizes.append((m.epoch, m.global_size))
            if len(sizes) == 3:
                loader.set_batch_size(10)  # 10 samples are left: the tail is trained, not dropped
            if len(sizes) == 6:
                break
    assert sizes == [(0, 30), (0, 30), (0, 30), (0, 10), (1, 10), (1, 10)]
    assert loader.sampler.dropped_samples == 0
    loader.close()


# ------------------------------------------------------------------------------------------- refused input
def test_in_order_false_is_refused():
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    with pytest.raises(ValueError, match="in_order"):
        AdaptiveDataLoader(TensorDataset(torch.arange(10)), 2, num_workers=2, dataloader_kwargs={"in_order": False})


def test_an_iterable_dataset_is_refused_even_with_a_length():
    from batchpilot import AdaptiveDataLoader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

        def __len__(self):
            return 10

    with pytest.raises(TypeError, match="IterableDataset.*map-style"):
        AdaptiveDataLoader(Stream(), 4)


def test_a_dataset_whose_len_is_no_int_is_told_so_and_a_bad_saved_loader_state_is_refused():
    from batchpilot import AdaptiveDataLoader

    class FloatLength(torch.utils.data.Dataset):
        def __len__(self):
            return 10.0

        def __getitem__(self, i):
            return i

    with pytest.raises(TypeError, match="len\\(\\) of the dataset of type FloatLength failed .*must return the number"):
        AdaptiveDataLoader(FloatLength(), 4)
    loader = AdaptiveDataLoader(torch.utils.data.TensorDataset(torch.arange(20)), 4, max_micro_batch_size=2)
    state = loader.state_dict()
    for key, value, error, says in [("max_micro_batch_size", 0, ValueError, "saved max_micro_batch_size must be >= 1"),
                                    ("max_micro_batch_size", "2", TypeError, "saved max_micro_batch_size must be"),
                                    ("step", -1, ValueError, "the saved step must be >= 0")]:
        with pytest.raises(error, match=says):
            loader.load_state_dict({**state, key: value})
    assert loader.max_micro_batch_size == 2


# ------------------------------------------------------------------------------------------- workers
class Augmented(torch.utils.data.Dataset):
    """Random augmentation in __getitem__, from torch, numpy and random."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        import random as pyrandom

        return torch.tensor([i + torch.rand(()).item(), np.random.rand(), pyrandom.random()])


def test_worker_augmentation_depends_on_the_position_not_on_workers_or_a_resume():
    from batchpilot import AdaptiveDataLoader

    def epoch_data(num_workers, resume_after=None):
        loader = AdaptiveDataLoader(Augmented(), 4, num_workers=num_workers, seed=2)
        out = []
        for m in loader:
            out.append(m.data)
            if resume_after is not None and len(out) == resume_after:
                state = loader.state_dict()
                loader.close()
                loader = AdaptiveDataLoader(Augmented(), 4, num_workers=num_workers, seed=2)  # a new process
                loader.load_state_dict(state)
                out += [m.data for m in loader]
                break
        loader.close()
        return torch.cat(out)

    one, two = epoch_data(1), epoch_data(2)
    assert torch.equal(one, two)  # whichever worker fetched a micro-batch, it drew the same numbers
    assert torch.equal(epoch_data(2, resume_after=3), two)
    assert len(set(one[:, 1].tolist())) == 24  # numpy is seeded per micro-batch, not cloned into each worker


# ------------------------------------------------------------------------------------------- what the engine reads
def test_split_every_plans_two_micro_batches_on_the_steps_it_divides():
    from torch.utils.data import TensorDataset

    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(TensorDataset(torch.arange(40)), 4, shuffle=False)
    loader.split_every = 3
    plan = [(m.step, m.accumulation_steps, m.indices.tolist()) for m in loader if m.micro_index == 0]
    assert plan[:4] == [(0, 2, [0, 1]), (1, 1, [4, 5, 6, 7]), (2, 1, [8, 9, 10, 11]), (3, 2, [12, 13])]
    # Never an empty half on a rank (3 samples over 2 ranks), and a fixed accumulation wins.
    ranks = AdaptiveDataLoader(TensorDataset(torch.arange(3)), 3, rank=1, world_size=2)
    ranks.split_every = 1
    assert [m.accumulation_steps for m in ranks] == [1]
    fixed = AdaptiveDataLoader(TensorDataset(torch.arange(8)), 4, accumulation_steps=3)
    fixed.split_every = 1
    assert {m.accumulation_steps for m in fixed} == {3}


class Noisy(torch.utils.data.Dataset):
    """Draws from torch's RNG when fetched (augmentation)."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.rand(())


def test_step_start_rng_is_torchs_state_right_before_a_steps_first_fetch():
    from batchpilot import AdaptiveDataLoader

    loader = AdaptiveDataLoader(Noisy(), 4, max_micro_batch_size=2, rng_device="cpu", seed=0)
    assert loader.step_start_rng is None
    torch.manual_seed(5)
    it = iter(loader)
    for step in range(3):
        first = next(it)
        cpu, cuda = loader.step_start_rng
        assert cuda is None and first.step == step
        second = next(it)
        assert loader.step_start_rng[0] is cpu  # kept until the next step starts
        torch.set_rng_state(cpu)  # what a replay of the step does: it draws what it drew
        again = torch.stack([torch.rand(()) for _ in range(4)])
        assert torch.equal(torch.cat([first.data, second.data]), again)
    assert AdaptiveDataLoader(Noisy(), 4).step_start_rng is None  # not kept without rng_device
