"""Rules added for what the model-type census found missing (ops/complex.py, ops/linalg.py, ops/spatial.py,
ops/host.py and the aliases appended to the YAML files), on 2 and 4 gloo ranks against plain torch."""
import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from tests.op_check import run_cases, specs_for

try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # the property test needs hypothesis (requirements-dev.txt)
    given = None


def _rotary(t, angles):
    """Llama-style complex rotary embedding: pairs of features times unit complex numbers."""
    freqs = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2)


def _upper(n, batch=()):
    g = torch.Generator().manual_seed(1)
    return torch.randn(*batch, n, n, generator=g).triu() + 4 * torch.eye(n)


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    x = r(4, 6, 4)
    pairs = r(4, 6, 2)
    img = r(4, 2, 6, 6)
    ids = torch.randint(0, 5, (4, 6), generator=g)
    repl = lambda nd: (lambda mesh: [(("None",) * nd, None)])
    no_partial = lambda nd: (lambda mesh: specs_for(mesh, nd, partial=False))
    return [
        ("view_as_complex / view_as_real", lambda t: torch.view_as_real(torch.view_as_complex(t) * 2), [pairs], None,
         True),
        ("complex multiply", lambda t: torch.view_as_real(torch.view_as_complex(t) * torch.view_as_complex(t)),
         [pairs], [no_partial(3)], True),
        ("complex rotary (polar)", _rotary, [x, r(6, 2)], [no_partial(3), repl(2)], True),
        ("solve_triangular left", lambda a, b: torch.linalg.solve_triangular(a, b, upper=True),
         [_upper(4, (4,)), r(4, 4, 6)], [lambda m: [(("None",) * 3, None), ((m.alias_name[-1], "None", "None"), None)],
                                          lambda m: specs_for(m, 3)], True),
        ("solve_triangular right", lambda a, b: torch.linalg.solve_triangular(a, b, upper=True, left=False),
         [_upper(4), r(4, 6, 4)], [repl(2), lambda m: specs_for(m, 3)], True),
        ("roll", lambda t: torch.roll(t, 1, 1) + t.roll((1, 2), (0, 2)), [x], None, True),
        ("flip", lambda t: t.flip(1) + torch.flip(t, (0, 2)), [x], None, True),
        ("Tensor.unfold", lambda t: t.unfold(1, 2, 2), [x], None, True),
        ("roll flat", lambda t: torch.roll(t, 3), [x], None, True),
        ("one_hot", lambda t: F.one_hot(t, 5), [ids], [no_partial(2)], False),
        ("unfold", lambda t: F.unfold(t, 2, stride=2), [img], None, True),
        ("max_pool2d", lambda t: F.max_pool2d(t, 2), [img], [no_partial(4)], True),
        ("avg_pool2d", lambda t: F.avg_pool2d(t, 2) + F.adaptive_avg_pool2d(t, 1), [img], None, True),
        ("grid_sample", lambda t, gr: F.grid_sample(t, gr, align_corners=False), [img, r(4, 3, 3, 2).tanh()],
         [no_partial(4), lambda m: [(("None",) * 4, None), ((m.alias_name[-1],) + ("None",) * 3, None)]], True),
        ("normalize", lambda t: F.normalize(t, dim=-1) + F.normalize(t, dim=1), [x], [no_partial(3)], True),
        ("greater / less", lambda t: torch.greater(t, 0) & torch.less_equal(t, 1), [x], [no_partial(3)], False),
        ("bincount", lambda t: torch.bincount(t.flatten(), minlength=6), [ids], [no_partial(2)], False),
        ("contains", lambda t: (3 in t, 99 in t), [ids], [no_partial(2)], False),
    ]


def _run(rank, world, first=None):
    return run_cases(_cases()[:first], world)


def test_found_ops(dist2):
    failures = [f for per_rank in dist2.run(_run) for f in per_rank]
    assert not failures, "\n".join(failures[:10])


def test_found_ops_2d_mesh(dist4):
    """The complex and triangular-solve families on a 2 x 2 mesh (nested splits, a split plus a pending sum)."""
    failures = [f for per_rank in dist4.run(_run, 5) for f in per_rank]
    assert not failures, "\n".join(failures[:10])


def _numpy(rank, world):
    """numpy(): the value on replicated input; a split or pending input fails on every rank, naming the op."""
    mesh = hp.Layout((world,), ("tp",))
    x = torch.arange(8.0).view(4, 2)
    out = hp.distribute_tensor(x, mesh("None", "None")).numpy()
    assert (out == x.numpy()).all()
    errors = []
    for lay in (mesh("tp", "None"), mesh("None", "None").with_partial("tp", "sum")):
        d = hp.DTensor.from_local(x / world, lay) if lay.has_partial else hp.distribute_tensor(x, lay)
        try:
            d.numpy()
        except RuntimeError as e:
            errors.append(str(e))
    return errors


def test_numpy_replicated_or_loud(dist2):
    for errors in dist2.run(_numpy):
        assert len(errors) == 2, errors
        assert all("torch.Tensor.numpy" in e and ".full_tensor()" in e for e in errors), errors


# ---- property: random shapes and layouts for the new families, against plain torch -------------------------
def _property_case(rank, world, op, shape, entries, partial, seed):
    mesh = hp.Layout((world,), ("tp",))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    lay = mesh(*entries)
    if partial:
        lay = lay.with_partial("tp", "sum")
        d = hp.DTensor.from_local(x / world, lay)
    else:
        d = hp.distribute_tensor(x, lay)
    if op == "solve_triangular":
        a = _upper(shape[-2], shape[:-2])
        fn = lambda t, aa: torch.linalg.solve_triangular(aa, t, upper=True)
        ref, out = fn(x, a), fn(d, hp.distribute_tensor(a, mesh(*(["None"] * a.ndim))))
    elif op == "roll":
        dims = tuple(range(0, len(shape), 2))
        ref, out = torch.roll(x, (1,) * len(dims), dims), torch.roll(d, (1,) * len(dims), dims)
    elif op == "view_as_real":
        ref = torch.view_as_real(torch.view_as_complex(x.reshape(*shape[:-1], -1, 2)) * 1j)
        out = torch.view_as_real(torch.view_as_complex(d.reshape(*shape[:-1], -1, 2)) * 1j)
    else:  # avg_pool2d
        ref, out = F.avg_pool2d(x, 2), F.avg_pool2d(d, 2)
    full = out.full_tensor()
    if full.shape != ref.shape or not torch.allclose(full, ref, atol=1e-5):
        return f"{op} {shape} {entries} partial={partial}: max diff {(full - ref).abs().max()}"
    return None


if given is not None:
    @st.composite
    def _property_inputs(draw):
        op = draw(st.sampled_from(["solve_triangular", "roll", "view_as_real", "avg_pool2d"]))
        nd = 4 if op == "avg_pool2d" else draw(st.integers(2, 4))
        shape = [draw(st.sampled_from([1, 2, 3, 4, 6])) for _ in range(nd)]
        if op == "solve_triangular":
            shape[-2] = draw(st.sampled_from([2, 3, 5]))
        if op == "view_as_real":
            shape[-1] = 2 * draw(st.integers(1, 3))
        if op == "avg_pool2d":
            shape[-1] = shape[-2] = 4
        split = draw(st.integers(-1, nd - 1))
        entries = tuple("tp" if d == split else "None" for d in range(nd))
        partial = split < 0 and draw(st.booleans())
        return op, tuple(shape), entries, partial, draw(st.integers(0, 1000))

    @settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_property_inputs())
    def test_found_ops_property(dist2, case):
        res = dist2.run(_property_case, *case)
        assert res[0] is None, res[0]
else:
    def test_found_ops_property():
        pytest.skip("hypothesis is not installed")
