"""Issue 14: each silent-wrong value and each one-rank error, on real gloo ranks against plain torch."""
import pytest
import torch

import hyper_parallel as hp
from hyper_parallel import DTensor


def _mesh(world):
    return hp.Layout((world,), ("tp",))


def _partial_of(x, L, op="sum"):
    """A DTensor on L('None', ...) holding x as a pending `op` over 'tp' (terms differ per rank)."""
    rank, world = L.mesh.coordinate[0], L.mesh_shape[0]
    if op == "sum":
        g = torch.Generator().manual_seed(5)
        others = [torch.randn(x.shape, generator=g).to(x.dtype) for _ in range(world - 1)]
        term = x - sum(others) if rank == 0 else others[rank - 1]
    else:  # max / min: one rank holds x, the others something that does not win
        term = x if rank == 0 else (x - 5 if op == "max" else x + 5)
    return DTensor.from_local(term.clone(), L(*["None"] * x.ndim).with_partial("tp", op), shape=tuple(x.shape))


# ---- 1. shape donors do not split the computation -------------------------------------------
def _shape_donor_grads(rank, world):
    L = _mesh(world)
    torch.manual_seed(0)
    t0 = torch.randn(4, 6)
    donors = {"split": hp.distribute_tensor(t0, L("None", "tp"), src_data_rank=None),
              "split0": hp.distribute_tensor(t0, L("tp", "None"), src_data_rank=None),
              "partial": _partial_of(t0, L)}
    cases = {
        "expand_as": (torch.randn(4, 1), lambda y, t: y.expand_as(t)),
        "view_as": (torch.randn(24), lambda y, t: y.view_as(t)),
        "reshape_as": (torch.randn(6, 4), lambda y, t: y.reshape_as(t)),
        "type_as": (torch.randn(4, 6), lambda y, t: y.type_as(t)),
        "to(other)": (torch.randn(4, 6), lambda y, t: y.to(t)),
    }
    w = torch.randn(4, 6)
    bad = []
    for name, (y0, fn) in cases.items():
        ref = y0.clone().requires_grad_()
        (fn(ref, t0) * w).sum().backward()
        for kind, t in donors.items():
            y = hp.distribute_tensor(y0, L(*["None"] * y0.ndim), src_data_rank=None).requires_grad_()
            out = fn(y, t)
            if not torch.allclose(out.full_tensor(), fn(y0, t0)):
                bad.append(f"{name} {kind}: value")
            (out * w).sum().backward()
            if y.grad.dist_layout is not y.dist_layout or not torch.allclose(y.grad.full_tensor(), ref.grad):
                bad.append(f"{name} {kind}: grad {y.grad.full_tensor().flatten()[:3]} vs {ref.grad.flatten()[:3]}")
    assert not bad, bad
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_shape_donor_does_not_inflate_gradient(world, dist2, dist4):
    (dist2 if world == 2 else dist4).run(_shape_donor_grads)


# ---- 2. casts of pending reductions ---------------------------------------------------------
def _partial_casts(rank, world):
    L = _mesh(world)
    bad = []
    # the cases: terms whose cast differs from the cast of their sum
    cases = [(torch.full((3,), 0.6 * world), torch.int64), (torch.full((3,), 0.3), torch.bool),
             (torch.tensor([1.0996, -2.5, 7.75]), torch.float16), (torch.tensor([1.0996, 3.0]), torch.bfloat16),
             (torch.tensor([1.5, -2.5]), torch.float64), (torch.tensor([3.7, -1.2]), torch.int32)]
    for x, dtype in cases:
        for op in ("sum", "max", "min"):
            d = _partial_of(x, _mesh(world), op)
            if op == "sum" and dtype == torch.bool:  # terms -0.3 / +0.3 ...: every term is nonzero
                d = DTensor.from_local(torch.full((3,), 0.3 if rank % 2 else -0.3), L("None").with_partial("tp"),
                                       shape=(3,))
                x = torch.zeros(3) if world % 2 == 0 else torch.full((3,), -0.3)
            for how, cast in (("to", lambda t: t.to(dtype)), ("method", lambda t: getattr(
                    t, {torch.int64: "long", torch.bool: "bool", torch.float16: "half", torch.bfloat16: "bfloat16",
                        torch.float64: "double", torch.int32: "int"}[dtype])())):
                got = cast(d).full_tensor()
                want = cast(x)
                close = torch.allclose(got.double(), want.double(), rtol=2e-3) if want.is_floating_point() \
                    else torch.equal(got, want)  # float terms: reduction-order tolerance, not more
                if got.dtype != want.dtype or not close:
                    bad.append(f"{op} {how} -> {dtype}: {got} vs {want}")
    # a widening float cast keeps the pending sum (no communication) and a max stays pending through any
    # monotone cast
    d = _partial_of(torch.tensor([1.0, 2.0]).half(), L)
    assert d.float().dist_layout.has_partial
    assert _partial_of(torch.tensor([1.0, 2.0]), L, "max").long().dist_layout.has_partial is False
    assert _partial_of(torch.tensor([1.0, 2.0]), L, "max").half().dist_layout.has_partial
    assert not bad, bad
    return True


def test_cast_of_partial_reduces_unless_exact(dist2, dist4):
    for pool in (dist2, dist4):
        pool.run(_partial_casts)


# ---- 3. x[slice] = v on a split dim -----------------------------------------------------------
def _split_setitem(rank, world):
    L = _mesh(world)
    bad = []
    indexes = [(slice(0, 2),), (slice(5, 8),), (slice(-3, None),), (slice(1, 8, 3),), (slice(None, None, 2),),
               (slice(6, 7),), (slice(3, 3),), (7,), (-8,), (slice(0, 8, 5), 1), (slice(-7, -1, 2), slice(0, 2))]
    for index in indexes:
        for layout in (L("tp", "None"), L("None", "tp")):
            x0 = torch.arange(24.0).reshape(8, 3)
            v0 = torch.randn(x0[index].shape)
            for value in (v0, hp.distribute_tensor(v0, L(*["None"] * v0.ndim), src_data_rank=None), 9.0):
                x = hp.distribute_tensor(x0, layout, src_data_rank=None)
                x[index] = value
                want = _with(x0, index, 9.0 if isinstance(value, float) else v0)
                if not torch.equal(x.full_tensor(), want):
                    bad.append(f"x[{index}] = {type(value).__name__} on {layout}")
    assert not bad, bad
    return True


def _with(x0, index, value):
    out = x0.clone()
    out[index] = value
    return out


def test_setitem_on_split_dim_any_slice(dist2, dist4):
    for pool in (dist2, dist4):
        pool.run(_split_setitem)


# ---- 4. from_local(run_check=True) raises on every rank -------------------------------------
def _from_local_checks(rank, world):
    L = _mesh(world)
    errors = []
    # local shapes that disagree, no shape=: every rank raises
    try:
        DTensor.from_local(torch.zeros(2 + (rank == 1), 3), L("tp", "None"), run_check=True)
    except ValueError as e:
        errors.append(str(e))
    # replicated values that differ: every rank raises (not only the non-root ones)
    try:
        DTensor.from_local(torch.full((2,), float(rank == 1)), L("None"), run_check=True)
    except ValueError as e:
        errors.append(str(e))
    # consistent inputs pass
    d = DTensor.from_local(torch.ones(2, 3), L("tp", "None"), run_check=True)
    assert d.shape == (2 * world, 3)
    return errors


def test_from_local_run_check_raises_on_every_rank(dist2, dist4):
    for pool in (dist2, dist4):
        for errors in pool.run(_from_local_checks):
            assert len(errors) == 2, errors
            assert "local shapes" in errors[0] and "(1,): local (3, 3)" in errors[0], errors[0]
            assert "different values" in errors[1], errors[1]


# ---- smaller --------------------------------------------------------------------------------
def _plain_expand_as_and_distribute_dtensor(rank, world):
    L = _mesh(world)
    t = hp.distribute_tensor(torch.randn(4, 6), L("None", "tp"), src_data_rank=None)
    y0 = torch.randn(4, 1)
    y = y0.clone().requires_grad_()
    out = y.expand_as(t)
    assert isinstance(out, DTensor) and torch.equal(out.full_tensor(), y0.expand(4, 6))
    out.sum().backward()
    assert torch.equal(y.grad, torch.full((4, 1), 6.0)), y.grad
    try:
        hp.distribute_tensor(t, L("tp", "None"))
    except TypeError as e:
        assert "redistribute" in str(e), e
    else:
        raise AssertionError("distribute_tensor(DTensor) did not raise")
    return True


def test_plain_expand_as_dtensor_and_distribute_dtensor(dist2):
    dist2.run(_plain_expand_as_and_distribute_dtensor)


# ---- check mode (API §11) -------------------------------------------------------------------
def _diverging_reductions(rank, world, use_env):
    L = _mesh(world)
    x = hp.distribute_tensor(torch.arange(8.0).reshape(4, 2), L("tp", "None"), src_data_rank=None)
    if not use_env:
        hp.set_check(True)
    try:
        y = x.sum() if rank == 0 else x.mean()
        try:
            y.full_tensor()
        except hp.CheckError as e:
            return str(e)
        return None
    finally:
        hp.set_check(False)


def _same_program_under_check(rank, world):
    """Check mode changes no value: a small forward and backward with collectives, under check mode."""
    L = _mesh(world)
    torch.manual_seed(0)
    x0, w0 = torch.randn(4, 6), torch.randn(6, 8)
    hp.set_check(True)
    try:
        x = hp.distribute_tensor(x0, L("None", "tp"), src_data_rank=None).requires_grad_()
        w = hp.distribute_tensor(w0, L("tp", "None"), src_data_rank=None).requires_grad_()
        out = (x @ w).softmax(-1).sum()
        out.backward()
        ref_x, ref_w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        (ref_x @ ref_w).softmax(-1).sum().backward()
        assert torch.allclose(out.full_tensor(), (x0 @ w0).softmax(-1).sum())
        assert torch.allclose(x.grad.full_tensor(), ref_x.grad, atol=1e-5)
        assert torch.allclose(w.grad.full_tensor(), ref_w.grad, atol=1e-5)
    finally:
        hp.set_check(False)
    return True


def test_check_mode_catches_diverging_ranks(dist2, dist4):
    for pool in (dist2, dist4):
        errors = pool.run(_diverging_reductions, False)
        for e in errors:
            assert e is not None, "check mode did not raise"
            assert "torch.Tensor.sum" in e and "torch.Tensor.mean" in e and "test_correct_or_loud.py:" in e, e
        pool.run(_same_program_under_check)


def _check_env_is_on(rank, world):
    return hp.DTensor.__torch_function__.__name__, _diverging_reductions(rank, world, True)


def test_check_mode_from_environment(monkeypatch):
    """HYPER_PARALLEL_CHECK=1 switches check mode on at import: a dedicated pool started with it."""
    from tests import harness
    monkeypatch.setenv("HYPER_PARALLEL_CHECK", "1")
    pool = harness.Pool(2)
    try:
        for name, error in pool.run(_check_env_is_on):
            assert name == "_noting_torch_function" and error and "torch.Tensor.mean" in error, (name, error)
    finally:
        pool.close(force=True)


def _timeout_names_op(rank, world):
    L = hp.Layout((world,), ("slow",))  # a new mesh: its groups take the short HYPER_PARALLEL_COMM_TIMEOUT
    x = hp.distribute_tensor(torch.ones(4, 2), L("slow", "None"), src_data_rank=None)
    if rank == 1:
        return None  # never joins the collective
    try:
        (x * 2).redistribute(L("None", "None"))
    except hp.CollectiveError as e:
        return str(e)
    return "no error"


def test_collective_timeout_names_op_layouts_and_axis(monkeypatch):
    from tests import harness
    monkeypatch.setenv("HP_COMM_TIMEOUT", "3")
    pool = harness.Pool(2)
    try:
        message = pool.run(_timeout_names_op)[0]
    finally:
        pool.close(force=True)
    assert "all_gather" in message and "mesh axis 'slow'" in message and "redistribution" in message, message
    assert "('slow', 'None')" in message or "slow" in message, message
