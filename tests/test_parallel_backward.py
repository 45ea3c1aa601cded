"""The backward ordering DDP and ZeRO share: launches in one order whatever order gradients
become ready in, every item once per backward, and one callback at the end of each backward
(in process, on autograd's real engine: no ranks)."""

from __future__ import annotations

import itertools

import pytest
import torch

from disttrain.parallel.backward import EndOfBackward, InOrderLauncher


def test_buckets_launch_in_bucket_order_whatever_order_they_become_ready():
    launched: list[int] = []
    launcher = InOrderLauncher(4, launched.append)
    for index in (2, 1, 3):
        launcher.mark_ready(index)
    assert launched == [] and not launcher.launched(0)  # nothing may go before bucket 0
    launcher.mark_ready(0)
    assert launched == [0, 1, 2, 3] and launcher.launched(3) and launcher.all_launched
    launcher.finish()  # end of backward: nothing left, start over
    assert launched == [0, 1, 2, 3] and not launcher.launched(0)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))))
def test_every_readiness_order_gives_one_launch_sequence(order):
    """Two ranks that see readiness in different orders issue the same collectives; the
    launches made before the end of backward are exactly the prefix that was complete."""
    launched: list[int] = []
    launcher = InOrderLauncher(4, launched.append)
    for seen, index in enumerate(order, 1):
        launcher.mark_ready(index)
        complete = set(order[:seen])
        prefix = next(k for k in range(5) if k not in complete)
        assert launched == list(range(prefix))
    launcher.finish()
    assert launched == [0, 1, 2, 3]


def test_end_of_backward_launches_the_rest_in_order_once():
    """A bucket that never completes (a parameter without gradient on this rank) holds
    back its successors; the end of backward launches them all, in order, exactly once,
    and the next backward starts over (gradient accumulation)."""
    launched: list[int] = []
    launcher = InOrderLauncher(4, launched.append)
    for index in (0, 2, 3):  # bucket 1 is incomplete here
        launcher.mark_ready(index)
    assert launched == [0] and not launcher.all_launched
    launcher.finish()
    assert launched == [0, 1, 2, 3]
    launcher.mark_ready(1)  # the next backward: bucket 0 first again
    launcher.finish()
    assert launched == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_launch_that_raises_is_not_retried():
    launched: list[int] = []

    def launch(index: int) -> None:
        launched.append(index)
        if index == 1:
            raise RuntimeError("collective failed")

    launcher = InOrderLauncher(3, launch)
    launcher.mark_ready(1)
    with pytest.raises(RuntimeError, match="collective failed"):
        launcher.mark_ready(0)
    assert launcher.launched(1) and not launcher.launched(2)
    launcher.finish()
    assert launched == [0, 1, 2]


def _model_with_hooks(end: EndOfBackward, events: list[str], arm_from: set[str]):
    layers = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    for name, p in layers.named_parameters():
        def hook(_: torch.Tensor, name: str = name) -> None:
            events.append(name)
            if name in arm_from:
                end.arm()
        p.register_post_accumulate_grad_hook(hook)
    return layers


def test_the_callback_runs_once_after_the_last_gradient_of_each_backward():
    events: list[str] = []
    end = EndOfBackward(lambda: events.append("end"))
    names = {"0.weight", "0.bias", "2.weight", "2.bias"}
    model = _model_with_hooks(end, events, arm_from=names)  # every hook arms: queued once
    for step in range(2):  # the next backward arms again (accumulation)
        model(torch.randn(5, 3)).sum().backward()
        assert events.count("end") == step + 1 and events[-1] == "end"
        assert set(events[-5:-1]) == names and not end.armed


def test_a_backward_whose_hooks_never_arm_runs_no_callback():
    events: list[str] = []
    end = EndOfBackward(lambda: events.append("end"))
    model = _model_with_hooks(end, events, arm_from=set())
    model(torch.randn(5, 3)).sum().backward()
    assert "end" not in events and len(events) == 4


def test_a_callback_that_raises_leaves_the_next_backward_free_to_arm():
    events: list[str] = []

    def callback() -> None:
        events.append("end")
        if events.count("end") == 1:
            raise RuntimeError("reduction failed")

    end = EndOfBackward(callback)
    model = _model_with_hooks(end, events, arm_from={"2.bias"})
    with pytest.raises(RuntimeError, match="reduction failed"):
        model(torch.randn(5, 3)).sum().backward()
    assert not end.armed
    model(torch.randn(5, 3)).sum().backward()
    assert events.count("end") == 2


def test_reset_forgets_a_callback_that_never_ran():
    """A backward that raised after the callback was queued never runs it: without reset the
    next backward would not queue its own (arm sees it armed already)."""
    events: list[str] = []
    end = EndOfBackward(lambda: events.append("end"))
    model = _model_with_hooks(end, events, arm_from={"2.bias"})
    fault = model[0].weight.register_post_accumulate_grad_hook(_raise)
    with pytest.raises(RuntimeError, match="hook failed"):
        model(torch.randn(5, 3)).sum().backward()
    assert end.armed and "end" not in events
    end.reset()
    fault.remove()
    model(torch.randn(5, 3)).sum().backward()
    assert events.count("end") == 1


def _raise(_: torch.Tensor) -> None:
    raise RuntimeError("hook failed")
