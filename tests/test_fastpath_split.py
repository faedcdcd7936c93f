"""Views of split tensors on 2 real ranks (issue 19): the C twin of the decision path (`_fastpath.c`, which runs
`LocalReshape` and notes views without a Python frame) against the Python path, and both against plain torch."""
import math

import torch

import hyper_parallel as hp
import hyper_parallel.dispatch as dispatch_pkg
from hyper_parallel.dispatch import dispatcher
from hyper_parallel.dtensor.dtensor import DTensor

try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
    given = None

# ---- views of split tensors on 2 real ranks: the C twin of the decision path against the Python path ---------------
_VIEW_OPS = {
    "view flat": lambda t: t.view(-1),
    "reshape merge": lambda t: t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]),
    "flatten": lambda t: t.flatten(),
    "unflatten": lambda t: t.unflatten(0, (1, t.shape[0])),
    "transpose": lambda t: t.transpose(0, 1),
    "t then view": lambda t: t.transpose(0, 1).contiguous().view(-1),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "view as": lambda t: t.view_as(t.reshape(t.shape)),
    "reshape keeping dim 0": lambda t: t.reshape(t.shape[0], 1, -1),
}


def _views_on_two_ranks(rank, world, shape, split_dim, op_names, grad_mode):
    """Each view op on a tensor split over dim `split_dim` (2 ranks): values, layouts, gradients and a refused write
    through the view are the same through the C twin and the Python path (warm calls: cache hits), and equal plain."""
    mesh = hp.Layout((2,), ("tp",))
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) / 7
    placements = ["tp" if d == split_dim else "None" for d in range(len(shape))]
    impls = {"c": dispatch_pkg._fastpath.torch_function, "python": dispatcher.torch_function}
    saved = DTensor.__dict__["__torch_function__"]
    try:
        for name in op_names:
            fn = _VIEW_OPS[name]
            want = fn(full)
            got = {}
            for impl_name, impl in impls.items():
                DTensor.__torch_function__ = staticmethod(impl)
                for _ in range(2):  # the second call is a cache hit
                    x = hp.distribute_tensor(full.clone(), mesh(*placements))
                    if grad_mode:
                        x.requires_grad_()
                    with torch.set_grad_enabled(grad_mode):
                        y = fn(x)
                    refused = False
                    if grad_mode:
                        (y * y).sum().backward()
                    else:  # a write through the view: reaches the original, or is refused loudly, the same on both
                        try:
                            y.add_(1)
                        except RuntimeError:
                            refused = True
                got[impl_name] = (y.full_tensor() - (0 if refused or grad_mode else 1), y.dist_layout, refused,
                                  x.grad.full_tensor() if grad_mode else None, x.full_tensor())
            c, p = got["c"], got["python"]
            assert torch.equal(c[0], p[0]) and c[1] is p[1] and c[2] == p[2], (name, shape, split_dim)
            if not grad_mode and not c[2]:  # a write let through reaches x where it does on one device
                plain = full.clone()
                fn(plain).add_(1)
                assert torch.allclose(c[4], plain), (name, shape, split_dim)
            assert torch.equal(c[4], p[4]), (name, shape, split_dim)
            assert torch.allclose(c[0], want), (name, shape, split_dim)
            if grad_mode:
                assert torch.equal(c[3], p[3]) and torch.allclose(c[3], 2 * full), (name, shape, split_dim)
    finally:
        DTensor.__torch_function__ = saved
    return True


def test_views_of_split_tensors_c_twin_equals_python_on_two_ranks(dist2):
    for grad_mode in (False, True):
        assert dist2.run(_views_on_two_ranks, (4, 6), 0, sorted(_VIEW_OPS), grad_mode) == [True, True]


if given is not None:
    @settings(max_examples=8, deadline=None)
    @given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=3), split_dim=st.integers(0, 2),
           ops=st.lists(st.sampled_from(sorted(_VIEW_OPS)), min_size=1, max_size=3), grad_mode=st.booleans())
    def test_random_split_layouts_and_views_c_twin_equals_python(shape, split_dim, ops, grad_mode):
        """Property: random shapes (uneven splits included), a random split dim, random view ops, on 2 ranks: the C
        twin of the decision path and the Python path agree exactly, and equal plain torch."""
        from tests import harness
        split_dim = min(split_dim, len(shape) - 1)
        assert harness.pool(2).run(_views_on_two_ranks, tuple(shape), split_dim, ops, grad_mode) == [True, True]


def _border_writes_through_a_reshape(rank, world, grad_mode):
    """EfficientLoFTR's `mask_border`: a batch-split (b, n0, n1) score mask reshaped (locally) to (b, h0, w0, h1,
    w1), its borders written through that view, reshaped back: the writes reach the mask as on one device, through
    the C twin and the Python path alike, with and without grad, and so do writes into views of those views."""
    mesh = hp.Layout((2,), ("dp",))
    full = torch.arange(2 * 12 * 6, dtype=torch.float32).reshape(2, 12, 6) / 50

    def run(x):
        y = x * 1
        m = y.reshape(2, 3, 4, 2, 3)
        m[:, :1] = 0
        m[:, :, :, -1:] = -1
        m[..., :1].mul_(3)          # a view of the view: the write reaches m and y
        s = m.sum()                 # m read after its writes
        y.transpose(1, 2)[:, 1:2].add_(s / 100)
        return y.reshape(2, 12, 6)
    want_x = full.clone().requires_grad_(grad_mode)
    with torch.set_grad_enabled(grad_mode):
        want = run(want_x)
        if grad_mode:
            (want * want).sum().backward()
    impls = {"c": dispatch_pkg._fastpath.torch_function, "python": dispatcher.torch_function}
    saved = DTensor.__dict__["__torch_function__"]
    try:
        for impl in impls.values():
            DTensor.__torch_function__ = staticmethod(impl)
            for _ in range(2):  # the second call is a cache hit
                x = hp.distribute_tensor(full.clone(), mesh("dp", "None", "None")).requires_grad_(grad_mode)
                with torch.set_grad_enabled(grad_mode):
                    got = run(x)
                    assert got.dist_layout is x.dist_layout
                    assert torch.allclose(got.full_tensor(), want.detach(), rtol=1e-5)
                    if grad_mode:
                        (got * got).sum().backward()
                        assert torch.allclose(x.grad.full_tensor(), want_x.grad, rtol=1e-5)
    finally:
        DTensor.__torch_function__ = saved
    return True


def test_writes_through_a_local_reshape_of_a_split_tensor_reach_it(dist2):
    for grad_mode in (False, True):
        assert dist2.run(_border_writes_through_a_reshape, grad_mode) == [True, True]


_CHAIN_VIEWS = {
    "reshape keeping dim 0": lambda t: t.reshape(t.shape[0], -1),
    "transpose inner": lambda t: t.transpose(-1, -2),
    "slice inner": lambda t: t[..., 1:],
    "unsqueeze": lambda t: t.unsqueeze(1),
    "select inner": lambda t: t[..., 0],
}
_CHAIN_WRITES = {"mul_": lambda v: v.mul_(-2.0), "add_": lambda v: v.add_(1.5), "zero a slice": lambda v: v[..., :1].zero_(),
                 "setitem": lambda v: v.__setitem__((Ellipsis, slice(0, 1)), -1.0)}


def _chained_writes_on_two_ranks(rank, world, chains):
    """Worker: for each chain (a view op of a batch-split non-leaf y, an in-place write into it, a view op of
    that view, a write into that), y's values and x's gradient equal plain torch's through the C twin and the Python path, or both
    twins refuse the write loudly."""
    mesh = hp.Layout((2,), ("dp",))
    full = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) / 9
    impls = {"c": dispatch_pkg._fastpath.torch_function, "python": dispatcher.torch_function}
    saved = DTensor.__dict__["__torch_function__"]

    def run(x, chain):
        y = x * 1
        m = _CHAIN_VIEWS[chain[0]](y)
        _CHAIN_WRITES[chain[1]](m)                        # a write into the view ...
        _CHAIN_WRITES[chain[3]](_CHAIN_VIEWS[chain[2]](m))  # ... then into a view of it
        return y * y
    try:
        for chain in chains:
            px = full.clone().requires_grad_()
            want = run(px, chain)
            want.sum().backward()
            outcome = {}
            for name, impl in impls.items():
                DTensor.__torch_function__ = staticmethod(impl)
                x = hp.distribute_tensor(full.clone(), mesh("dp", "None", "None")).requires_grad_()
                try:
                    got = run(x, chain)
                except RuntimeError:
                    outcome[name] = "refused"
                    continue
                got.sum().backward()
                assert torch.allclose(got.full_tensor(), want.detach(), rtol=1e-6), (name, chain)
                assert torch.allclose(x.grad.full_tensor(), px.grad, rtol=1e-6), (name, chain)
                outcome[name] = "equal"
            assert outcome["c"] == outcome["python"], (chain, outcome)
    finally:
        DTensor.__torch_function__ = saved
    return True


if given is not None:
    @settings(max_examples=10, deadline=None)
    @given(chains=st.lists(st.tuples(st.sampled_from(sorted(_CHAIN_VIEWS)), st.sampled_from(sorted(_CHAIN_WRITES)),
                                     st.sampled_from(sorted(_CHAIN_VIEWS)), st.sampled_from(sorted(_CHAIN_WRITES))),
                           min_size=1, max_size=4))
    def test_random_writes_into_views_of_views_of_a_split_tensor_equal_plain(chains):
        """Property: a random view of a batch-split tensor, a random in-place write into it, a random view of
        that view and a write into that, with grad: the write reaches the tensor at the bottom of the chain, values and gradients as plain
        torch's, the C twin and the Python path alike (or both refuse it loudly)."""
        from tests import harness
        assert harness.pool(2).run(_chained_writes_on_two_ranks, chains) == [True, True]
