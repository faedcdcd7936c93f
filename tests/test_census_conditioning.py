"""The census's equality tolerance scaled by a type's own conditioning: a comparison that fails the fixed
tolerance is measured again against the plain run in float64, and passes only within CONDITIONING_FACTOR times
the plain float32 run's own gap; a perturbation far above float32 rounding is never reported equal."""
import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from hyper_parallel.tools.census import CONDITIONING_FACTOR, TOLERANCE, _run_one, replicated, within_conditioning
from hyper_parallel.tools.models import ModelCase


@given(gap=st.floats(0, 1e-2), over=st.floats(1.0001, 1e6), tol=st.floats(1e-7, 1e-3))
def test_a_difference_beyond_the_conditioning_and_the_tolerance_is_never_explained(gap, over, tol):
    diff = max(tol, CONDITIONING_FACTOR * gap) * over
    assert not within_conditioning(diff, gap, tol)
    assert within_conditioning(min(tol, CONDITIONING_FACTOR * gap), gap, tol)
    assert not within_conditioning(float("nan"), gap, tol) and not within_conditioning(float("inf"), 1.0, tol)
    assert not within_conditioning(2 * tol, None, tol)  # nothing measured: the fixed tolerance stands


class _IllConditioned(nn.Module):
    """BatchNorm over two nearly equal samples with no eps: it divides by their tiny spread, so float32 rounding
    of the first layer alone moves the loss and gradients far past the fixed tolerances."""

    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16, eps=1e-12), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(self.bn(self.a(x)))


def _case(seed: int) -> ModelCase:
    torch.manual_seed(seed)
    x = torch.randn(1, 8).repeat(2, 1)
    x[1] += 1e-3 * torch.randn(8)
    return ModelCase("ill", _IllConditioned(), {"x": x}, labels={}, can_generate=False, head="base")


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 50), delta=st.floats(1e-4, 1e-1))
def test_a_perturbation_far_above_float32_rounding_is_never_equal_on_an_ill_conditioned_model(seed, delta):
    case = _case(seed)
    gen = torch.Generator().manual_seed(seed)

    def perturbed(t):  # the "DTensor run" sees inputs moved by delta, ~1000x float32's relative rounding or more
        return replicated(t * (1 + delta * torch.randn(t.shape, generator=gen)) if t.is_floating_point() else t)

    r = _run_one("ill", "train", lambda: copy.deepcopy(case), 3, wrap_input=perturbed)
    assert r.error is None and r.equal is False, r.detail


def test_rounding_within_the_model_s_own_conditioning_is_equal_and_says_so():
    """Inputs moved by one float32 ulp (what a sum in another order does) on the ill-conditioned model: beyond
    the fixed tolerance, within its fp32-vs-float64 gap: equal, with the gap recorded."""
    case = _case(1)
    gen = torch.Generator().manual_seed(1)
    ulp = lambda t: replicated(t * (1 + 1e-7 * torch.randn(t.shape, generator=gen)))  # noqa: E731
    r = _run_one("ill", "train", lambda: copy.deepcopy(case), 3, wrap_input=ulp)
    assert r.equal is True and r.conditioning is not None and r.conditioning > TOLERANCE, r.detail
    assert "ill-conditioned" in r.detail and "within" in r.detail
    plain = _run_one("ill", "train", lambda: copy.deepcopy(case), 3)  # an exact run never pays for float64
    assert plain.equal is True and plain.conditioning is None
