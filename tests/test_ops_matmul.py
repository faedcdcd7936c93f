"""Contraction rules (linear, matmul family, einsum) against plain tensors, with gradients.

Every case draws random shapes (dims the mesh does not divide included) and random layouts per input
(Shard on any dim and mesh axis, nested splits in either order, Replicate, Partial with unequal terms,
and plain tensors for inputs without gradients), on 2 ranks (1-D mesh) and 4 ranks (2x2 mesh).
The helpers at the top are shared with tests/test_ops_nn.py.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel import DTensor, Layout

TRIALS = 40


# ---- shared helpers ------------------------------------------------------------------------------
class Arg:
    """One tensor input of a case: its full value and what it may be."""

    def __init__(self, full: torch.Tensor, grad: bool | None = None, partial: bool | None = None,
                 shard: bool = True, plain: bool | None = None):
        self.full = full
        floating = full.is_floating_point()
        self.grad = floating if grad is None else grad
        self.partial = floating if partial is None else partial
        self.shard = shard
        self.plain = (not self.grad) if plain is None else plain


def make(layout: Layout, full: torch.Tensor, seed: int = 7) -> DTensor:
    """A DTensor holding `full` under `layout`; a Partial axis gets unequal terms summing to the value."""
    local = full
    off, size = layout.local_offset(full.shape), layout.local_shape(full.shape)
    for d in range(full.ndim):
        local = local.narrow(d, off[d], size[d])
    g = torch.Generator().manual_seed(seed)
    for a, op in enumerate(layout.partial):
        if op is None:
            continue
        n, c = layout.mesh.shape[a], layout.mesh.coordinate[a]
        noise = torch.randn(local.shape, generator=g, dtype=local.dtype)
        local = local / n + noise * (c - (n - 1) / 2)
    return DTensor.from_local(local.clone(), layout, shape=tuple(full.shape))


def mesh_layout(two_d: bool, world: int) -> Layout:
    return Layout((2, 2), ("dp", "tp")) if two_d else Layout((world,), ("tp",))


def random_layout(L: Layout, arg: Arg, rnd: random.Random) -> Layout:
    """Per mesh axis: Replicate, Partial (if allowed) or Shard of a random dim; nested splits in random order."""
    ndim = arg.full.ndim
    dims = [[] for _ in range(ndim)]
    partial = []
    for name in L.alias_name:
        options = ["R", "R"] + (list(range(ndim)) * 2 if arg.shard else []) + (["P"] if arg.partial else [])
        c = rnd.choice(options)
        if c == "P":
            partial.append(name)
        elif c != "R":
            dims[c].append(name)
    for axes in dims:
        rnd.shuffle(axes)
    entries = [("None" if not axes else axes[0] if len(axes) == 1 else tuple(axes)) for axes in dims]
    lay = L(*entries) if ndim else L.with_map(())
    for name in partial:
        lay = lay.with_partial(name)
    return lay


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-9, rtol=1e-7, equal_nan=True)


def check_case(L: Layout, fn, args: list[Arg], rnd: random.Random, what: str, layouts=None):
    """Run `fn` on plain tensors and on DTensors laid out at random (or as given); compare values and
    gradients. Returns the DTensor output and the collectives the forward call ran."""
    ref_in = [a.full.clone().requires_grad_(a.grad) for a in args]
    ref_out = fn(*ref_in)
    g = torch.randn(ref_out.shape, dtype=ref_out.dtype, generator=torch.Generator().manual_seed(3))
    if ref_out.requires_grad:
        ref_out.backward(g)
    if layouts is None:
        layouts = [random_layout(L, a, rnd) for a in args]
    dts = []
    for a, lay in zip(args, layouts):
        if a.plain and lay.is_replicate and rnd.random() < 0.5:
            dts.append(a.full.clone())
            continue
        dts.append(make(lay, a.full).requires_grad_(a.grad))
    if all(type(t) is not DTensor for t in dts):  # at least one DTensor
        dts[0] = make(layouts[0], args[0].full).requires_grad_(args[0].grad)
    desc = f"{what}: shapes {[tuple(a.full.shape) for a in args]}, layouts {layouts}"
    with hp.comm_counter() as counts:
        out = fn(*dts)
    assert type(out) is DTensor, desc
    assert tuple(out.shape) == tuple(ref_out.shape), f"{desc}: shape {tuple(out.shape)} vs {tuple(ref_out.shape)}"
    got = out.full_tensor()
    assert close(got, ref_out.detach()), f"{desc}: out layout {out.dist_layout}\n{got}\nvs\n{ref_out}"
    if ref_out.requires_grad:
        out.backward(DTensor.from_local(g.clone(), out.dist_layout.replicated()))
        for i, (a, t, r) in enumerate(zip(args, dts, ref_in)):
            if not a.grad or type(t) is not DTensor:
                continue
            assert t.grad is not None, f"{desc}: input {i} got no gradient"
            assert type(t.grad) is DTensor and t.grad.dist_layout is t.dist_layout.without_partial(), \
                f"{desc}: input {i} grad layout {getattr(t.grad, 'dist_layout', None)}"
            assert close(t.grad.full_tensor(), r.grad), f"{desc}: input {i} grad\n{t.grad.full_tensor()}\nvs\n{r.grad}"
    return out, counts


def run_cases(rank: int, world: int, module: str, case: str, two_d: bool, trials: int) -> int:
    """Worker entry: `trials` random draws of one case from `module`'s CASES."""
    import importlib
    cases = importlib.import_module(module).CASES
    L = mesh_layout(two_d, world)
    rnd = random.Random(f"{case}-{two_d}")
    torch.manual_seed(0)
    for t in range(trials):
        fn, args = cases[case](rnd)
        check_case(L, fn, args, rnd, f"{case} trial {t}")
    return trials


def dims(rnd: random.Random, n: int, lo: int = 1, hi: int = 6) -> list[int]:
    return [rnd.randint(lo, hi) for _ in range(n)]


def randn(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64)


# ---- cases -----------------------------------------------------------------------------------------
def _linear(rnd):
    lead = dims(rnd, rnd.randint(0, 2))
    k, n = dims(rnd, 2, 2, 7)
    args = [Arg(randn(*lead, k)), Arg(randn(n, k) if rnd.random() < 0.9 else randn(k))]
    if rnd.random() < 0.7 and args[1].full.ndim == 2:
        args.append(Arg(randn(n)))
        if rnd.random() < 0.5:
            return (lambda x, w, b: F.linear(x, w, bias=b)), args
    return F.linear, args


def _broadcast_batch(rnd, n):
    full = dims(rnd, n, 2, 4)
    a = [s if rnd.random() < 0.7 else 1 for s in full]
    b = [s if rnd.random() < 0.7 else 1 for s in full]
    return a[rnd.randint(0, n):], b[rnd.randint(0, n):]


def _matmul(rnd):
    m, k, n = dims(rnd, 3, 1, 6)
    ba, bb = _broadcast_batch(rnd, rnd.randint(0, 2))
    a = randn(*ba, m, k) if rnd.random() < 0.85 else randn(k)
    b = randn(*bb, k, n) if rnd.random() < 0.85 else randn(k)
    fn = rnd.choice([torch.matmul, lambda x, y: x @ y, lambda x, y: x.matmul(y),
                     lambda x, y: torch.Tensor.__rmatmul__(y, x)])
    return fn, [Arg(a), Arg(b)]


def _mm(rnd):
    m, k, n = dims(rnd, 3, 1, 7)
    return rnd.choice([torch.mm, lambda x, y: x.mm(y)]), [Arg(randn(m, k)), Arg(randn(k, n))]


def _bmm(rnd):
    b, m, k, n = dims(rnd, 4, 1, 5)
    return rnd.choice([torch.bmm, lambda x, y: x.bmm(y)]), [Arg(randn(b, m, k)), Arg(randn(b, k, n))]


def _addmm(rnd):
    m, k, n = dims(rnd, 3, 1, 6)
    inp = rnd.choice([randn(m, n), randn(n), randn(1, n), randn(m, 1)])
    beta, alpha = rnd.choice([1.0, 0.5]), rnd.choice([1.0, -2.0])
    fns = [lambda i, x, y: torch.addmm(i, x, y, beta=beta, alpha=alpha), lambda i, x, y: i.addmm(x, y, alpha=alpha)]
    if inp.shape == (m, n):
        fns.append(lambda i, x, y: (i * 1).addmm_(x, y, beta=beta))
    fn = rnd.choice(fns)
    return fn, [Arg(inp), Arg(randn(m, k)), Arg(randn(k, n))]


def _baddbmm(rnd):
    b, m, k, n = dims(rnd, 4, 1, 5)
    inp = rnd.choice([randn(b, m, n), randn(m, n), randn(1, 1, n)])
    beta = rnd.choice([1.0, 0.25])
    fns = [lambda i, x, y: torch.baddbmm(i, x, y, beta=beta), lambda i, x, y: i.baddbmm(x, y)]
    if inp.shape == (b, m, n):
        fns.append(lambda i, x, y: (i * 1).baddbmm_(x, y, alpha=0.5))
    fn = rnd.choice(fns)
    return fn, [Arg(inp), Arg(randn(b, m, k)), Arg(randn(b, k, n))]


def _vector_products(rnd):
    m, k = dims(rnd, 2, 1, 7)
    return rnd.choice([
        (torch.mv, [Arg(randn(m, k)), Arg(randn(k))]),
        (lambda x, y: x.mv(y), [Arg(randn(m, k)), Arg(randn(k))]),
        (torch.dot, [Arg(randn(k)), Arg(randn(k))]),
        (lambda x, y: x.dot(y), [Arg(randn(k)), Arg(randn(k))]),
        (torch.outer, [Arg(randn(m)), Arg(randn(k))]),
    ])


_EINSUMS = [
    ("bij,bjk->bik", [("b", "i", "j"), ("b", "j", "k")]),
    ("ij,kj->ik", [("i", "j"), ("k", "j")]),
    ("ij,jk", [("i", "j"), ("j", "k")]),
    ("bhqd,bhkd->bhqk", [("b", "h", "q", "d"), ("b", "h", "k", "d")]),
    ("...ij,...jk->...ik", [(".", "i", "j"), (".", "j", "k")]),
    ("i,i->", [("i",), ("i",)]),
    ("ij->ji", [("i", "j")]),
    ("ij->", [("i", "j")]),
    ("ii->i", [("i", "i")]),
    ("bi,bj->bij", [("b", "i"), ("b", "j")]),
    ("b i j , b j -> b i", [("b", "i", "j"), ("b", "j")]),
    ("ij,jk,kq->iq", [("i", "j"), ("j", "k"), ("k", "q")]),
    ("sublist", [("i", "j"), ("j", "k")]),
]


def _einsum(rnd):
    eq, terms = rnd.choice(_EINSUMS)
    size = {lab: rnd.randint(1, 5) for lab in "bhijkqd"}
    ell = dims(rnd, rnd.randint(0, 2), 2, 3)
    args = []
    for term in terms:
        shape = []
        for lab in term:
            shape += ([s if rnd.random() < 0.8 else 1 for s in ell][rnd.randint(0, len(ell)):] if lab == "."
                      else [size[lab]])
        args.append(Arg(randn(*shape)))
    if eq == "sublist":  # torch turns the sublist form into an equation before dispatch
        return (lambda a, b: torch.einsum(a, [0, 1], b, [1, 2], [0, 2])), args
    if rnd.random() < 0.5 or len(args) == 1:
        return (lambda *ops: torch.einsum(eq, *ops)), args
    return (lambda *ops: torch.einsum(eq, list(ops))), args


CASES = {"linear": _linear, "matmul": _matmul, "mm": _mm, "bmm": _bmm, "addmm": _addmm, "baddbmm": _baddbmm,
         "vector": _vector_products, "einsum": _einsum}


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_layouts_2ranks(dist2, case):
    assert dist2.run(run_cases, __name__, case, False, TRIALS) == [TRIALS] * 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_layouts_2x2(dist4, case):
    assert dist4.run(run_cases, __name__, case, True, TRIALS) == [TRIALS] * 4


# ---- the classic tensor-parallel plans: right layouts, no needless communication -------------------
def _tp_plans(rank, world):
    L = Layout((world,), ("tp",))
    torch.manual_seed(0)
    x, w1, b1, w2, b2 = randn(5, 8), randn(6 * world, 8), randn(6 * world), randn(7, 6 * world), randn(7)
    dx = make(L("None", "None"), x).requires_grad_()
    dw1, db1 = make(L("tp", "None"), w1).requires_grad_(), make(L("tp"), b1).requires_grad_()
    dw2, db2 = make(L("None", "tp"), w2).requires_grad_(), make(L("None"), b2).requires_grad_()
    with hp.comm_counter() as c:
        h = F.linear(dx, dw1, db1)             # column parallel: no communication
        assert h.dist_layout is L("None", "tp"), h.dist_layout
        y = F.linear(h, dw2, db2)              # row parallel: the all-reduce is deferred
        assert y.dist_layout is L("None", "None").with_partial("tp"), y.dist_layout
    assert sum(c.counts.values()) == 0, c.counts
    ref = F.linear(F.linear(x, w1, b1), w2, b2)
    assert close(y.full_tensor(), ref)
    # batch split of x with replicated weights: no communication, output split the same way
    ds = make(L("tp", "None"), x)
    with hp.comm_counter() as c:
        z = F.linear(ds, make(L("None", "None"), w1))
    assert z.dist_layout is L("tp", "None") and sum(c.counts.values()) == 0
    # a Partial input through a replicated weight stays Partial
    with hp.comm_counter() as c:
        p = torch.matmul(y, make(L("None", "None"), randn(7, 3)))
    assert p.dist_layout is L("None", "None").with_partial("tp") and sum(c.counts.values()) == 0
    return True


def test_tensor_parallel_plans(dist2):
    assert dist2.run(_tp_plans) == [True, True]


def _nested_order(rank, world):
    """Contracted dims split over both axes in different orders must still line up."""
    L = Layout((2, 2), ("dp", "tp"))
    a, b = randn(3, 7), randn(7, 5)
    for ea, eb in [(("dp", "tp"), ("tp", "dp")), (("tp", "dp"), "None"), ("None", ("tp", "dp"))]:
        da = make(L("None", ea), a).requires_grad_()
        db = make(L(eb, "None"), b).requires_grad_()
        out = da @ db
        assert close(out.full_tensor(), a @ b), (ea, eb, out.dist_layout)
    return True


def test_nested_split_order(dist4):
    assert dist4.run(_nested_order) == [True] * 4


def test_einsum_parse():
    from hyper_parallel.ops.matmul import matmul_labels, parse_einsum
    assert parse_einsum("ij,jk", [2, 2]) == ([("i", "j"), ("j", "k")], ("i", "k"))
    assert parse_einsum("...ij,jk->...ik", [4, 2]) == ([("...0", "...1", "i", "j"), ("j", "k")],
                                                       ("...0", "...1", "i", "k"))
    assert parse_einsum("ba,Ab", [2, 2]) == ([("b", "a"), ("A", "b")], ("A", "a"))
    assert parse_einsum("ij,jk->ik", [3, 2]) is None
    assert matmul_labels(1, 3) == (("k",), ("b0", "k", "n"), ("b0", "n"))
    assert matmul_labels(4, 2) == (("b0", "b1", "m", "k"), ("k", "n"), ("b0", "b1", "m", "n"))
    assert matmul_labels(3, 1) == (("b0", "m", "k"), ("k",), ("b0", "m"))
