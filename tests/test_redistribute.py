"""Every layout transition on 1-D and 2x2 meshes, against the plain tensor, with gradients."""
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hyper_parallel as hp
from hyper_parallel import DTensor, Layout


def make(layout, full, seed=7):
    """A DTensor holding `full` under `layout`; a Partial axis gets unequal terms summing to the value."""
    local = full
    for d, axes in enumerate(layout.tensor_map):
        off, size = layout.local_offset(full.shape)[d], layout.local_shape(full.shape)[d]
        local = local.narrow(d, off, size)
    g = torch.Generator().manual_seed(seed)
    for a, op in enumerate(layout.partial):
        if op is None:
            continue
        n, c = layout.mesh.shape[a], layout.mesh.coordinate[a]
        noise = torch.randn(local.shape, generator=g)
        local = local / n + noise * (c - (n - 1) / 2)
    return DTensor.from_local(local.clone(), layout, shape=tuple(full.shape))


def layouts_1d(L):
    return [L("None", "None"), L("tp", "None"), L("None", "tp"), L("None", "None").with_partial("tp")]


def layouts_2d(L):
    out = []
    for a, b in itertools.product(["None", "dp", "tp", ("dp", "tp"), ("tp", "dp")], repeat=2):
        used = [x for e in (a, b) for x in (e if isinstance(e, tuple) else (e,)) if x != "None"]
        if len(used) == len(set(used)):
            out.append(L(a, b))
    out.append(L("dp", "None").with_partial("tp"))
    out.append(L("None", "None").with_partial("dp").with_partial("tp"))
    out.append(L("None", "tp").with_partial("dp", "max"))
    return out


def _all_transitions(rank, world, two_d, shape):
    L = Layout((2, 2), ("dp", "tp")) if two_d else Layout((world,), ("tp",))
    cands = layouts_2d(L) if two_d else layouts_1d(L)
    torch.manual_seed(0)
    full = torch.randn(*shape)
    checked = 0
    for src, dst in itertools.product(cands, cands):
        if any(op == "max" for op in src.partial):
            continue  # a Partial(max) source needs max-terms; covered in _partial_max
        x = make(src, full)
        y = x.redistribute(dst)
        assert y.dist_layout is dst, (src, dst, y.dist_layout)
        assert tuple(y.to_local().shape) == dst.local_shape(full.shape), (src, dst)
        assert torch.allclose(y.full_tensor(), full, atol=1e-5), (src, dst)
        checked += 1
    return checked


@pytest.mark.parametrize("shape", [(4, 6), (5, 3)])
def test_transitions_1d_2ranks(dist2, shape):
    assert dist2.run(_all_transitions, False, shape)[0] == 16


def test_transitions_1d_4ranks(dist4):
    dist4.run(_all_transitions, False, (8, 6))
    dist4.run(_all_transitions, False, (7, 3))  # uneven: torch.chunk pieces


@pytest.mark.parametrize("shape", [(8, 4), (5, 6)])
def test_transitions_2x2(dist4, shape):
    dist4.run(_all_transitions, True, shape)


def _cheapest_collectives(rank, world):
    L = Layout((world,), ("tp",))
    full = torch.arange(24.0).reshape(4, 6)
    cases = [
        (L("tp", "None"), L("None", "None"), {"all_gather"}),
        (L("None", "None").with_partial("tp"), L("None", "None"), {"all_reduce"}),
        (L("None", "None").with_partial("tp"), L("tp", "None"), {"reduce_scatter"}),
        (L("tp", "None"), L("None", "tp"), {"all_to_all"}),
        (L("None", "None"), L("tp", "None"), set()),
        (L("None", "None"), L("None", "None").with_partial("tp"), set()),
    ]
    for src, dst, kinds in cases:
        x = make(src, full)
        with hp.comm_counter() as c:
            x.redistribute(dst)
        assert set(c.counts) == kinds, (src, dst, dict(c.counts))
        assert all(v == 1 for v in c.counts.values())
    x = make(L("tp", "None"), full)
    with hp.comm_counter() as c:
        x.full_tensor()
    assert c.bytes["all_gather"] == full.numel() // world * 4
    return True


def test_planner_picks_single_collectives(dist2):
    dist2.run(_cheapest_collectives)


def _partial_max(rank, world):
    L = Layout((world,), ("tp",))
    full = torch.randn(4, 4)
    local = full.clone() if rank == 1 else full - 1.0
    x = DTensor.from_local(local, L("None", "None").with_partial("tp", "max"))
    assert torch.equal(x.full_tensor(), full)
    avg = DTensor.from_local(full * (rank + 1), L("None", "None").with_partial("tp", "avg"))
    assert torch.allclose(avg.full_tensor(), full * sum(range(1, world + 1)) / world)
    return True


def test_partial_reduce_ops(dist2):
    dist2.run(_partial_max)


def _grad_through_redistribute(rank, world, two_d):
    L = Layout((2, 2), ("dp", "tp")) if two_d else Layout((world,), ("tp",))
    cands = layouts_2d(L) if two_d else layouts_1d(L)
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    gfull = torch.randn(4, 6)
    for src, dst in itertools.product(cands, cands):
        if src.has_partial:
            continue  # leaf parameters are not Partial
        x = make(src, full).requires_grad_()
        y = x.redistribute(dst)
        y.backward(make(dst.without_partial(), gfull))
        assert type(x.grad) is DTensor and x.grad.dist_layout is src, (src, dst, x.grad.dist_layout)
        assert torch.allclose(x.grad.full_tensor(), gfull, atol=1e-5), (src, dst)
    return True


def test_redistribute_backward_1d(dist2):
    dist2.run(_grad_through_redistribute, False)


def test_redistribute_backward_2x2(dist4):
    dist4.run(_grad_through_redistribute, True)


def _distribute_and_errors(rank, world):
    L = Layout((world,), ("tp",))
    full = torch.randn(6, 4) if rank == 0 else torch.zeros(6, 4)  # rank 0's copy is broadcast
    d = hp.distribute_tensor(full, L("tp", "None"))
    ref = torch.empty(6, 4)
    torch.distributed.broadcast(ref.copy_(full), 0)
    assert torch.equal(d.full_tensor(), ref)
    try:
        Layout((world + 1,), ("tp",))
    except ValueError as e:
        assert "processes run" in str(e)
    else:
        raise AssertionError("a mesh larger than the world must be refused")
    other = Layout((world,), ("dp",))
    a = hp.distribute_tensor(torch.ones(4), L("None"))
    b = hp.distribute_tensor(torch.ones(4), other("None"))
    try:
        a + b
    except ValueError as e:
        assert "different meshes" in str(e)
    else:
        raise AssertionError("mixing meshes must be refused")
    return True


def test_distribute_tensor_and_bad_input(dist2):
    dist2.run(_distribute_and_errors)


# ---- memory format: a gathered channels-last piece stays channels-last ------------------------------
def _channels_last_batch_norm(rank, world):
    """The clap audio encoder's pattern: (B, 1, T, mel) split on the batch, transposed to (B, mel, T, 1)
    (channels-last strides), batch_norm in training (its input gathered), transposed back. torch's
    batch_norm backward on a contiguous input with a channels-last gradient gives wrong weight / bias
    gradients, so the gathered input must keep the plain input's format for the plain grads."""
    import torch.nn.functional as F
    L = Layout((world,), ("dp",))

    def f(x, w, b):
        return F.batch_norm(x.transpose(1, 3), None, None, w, b, training=True).transpose(1, 3)

    torch.manual_seed(0)
    x, r = torch.randn(2 * world, 1, 6, 4), torch.randn(2 * world, 1, 6, 4)
    w, b = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    (f(x, w, b) * r).sum().backward()
    xd = hp.distribute_tensor(x, L("dp", "None", "None", "None"), src_data_rank=None)
    wd, bd = (hp.distribute_tensor(t.detach(), L("None"), src_data_rank=None).requires_grad_() for t in (w, b))
    (f(xd, wd, bd) * hp.distribute_tensor(r, L("dp", "None", "None", "None"), src_data_rank=None)).sum().backward()
    torch.testing.assert_close(wd.grad.full_tensor(), w.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bd.grad.full_tensor(), b.grad, atol=1e-5, rtol=1e-5)
    for shape, fmt in (((2 * world, 3, 5, 2), torch.channels_last), ((2 * world, 3, 2, 5, 2), torch.channels_last_3d)):
        full = torch.randn(shape).contiguous(memory_format=fmt)
        g = make(L("dp", *["None"] * (len(shape) - 1)), full).redistribute(L(*["None"] * len(shape)))
        assert g.to_local().is_contiguous(memory_format=fmt) and torch.equal(g.to_local(), full)
    return True


def test_batch_norm_on_channels_last_split_batch_gives_one_process_grads(dist2):
    dist2.run(_channels_last_batch_norm)


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=3, max_size=5), perm_seed=st.integers(0, 1000))
def test_in_format_of_keeps_values_and_takes_channels_last_only_from_a_channels_last_input(shape, perm_seed):
    from hyper_parallel.redistribute.planner import _FORMATS, _in_format_of
    perm = torch.randperm(len(shape), generator=torch.Generator().manual_seed(perm_seed)).tolist()
    like = torch.randn([shape[p] for p in perm]).permute([perm.index(i) for i in range(len(shape))])
    out = torch.randn(shape)
    kept = _in_format_of(out, like)
    assert torch.equal(kept, out)
    fmt = _FORMATS.get(len(shape))
    if fmt is not None and like.is_contiguous(memory_format=fmt):
        assert kept.is_contiguous(memory_format=fmt)
    elif like.is_contiguous() or fmt is None:
        assert kept is out
