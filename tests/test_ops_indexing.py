"""Indexing ops on DTensors vs plain tensors: Shard / Replicate / Partial inputs, uneven splits, 1-D and 2x2 meshes."""
import pytest
import torch

import hyper_parallel as hp
from tests.op_check import meshes, run_cases, specs_for


def _set(index, with_value=True, scalar=None):
    """x[index] = value on a copy (in place on a non-leaf, so gradients reach x and the value)."""
    def fn(t, *rest):
        y = t * 1.0
        y[index(*rest[1:]) if callable(index) else index] = rest[0] if with_value else scalar
        return y
    return fn


def _cases():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 6, 7, generator=g)
    ix = torch.tensor([4, 0, 2, 2])
    ixd = torch.tensor([4, 0, 2])                                       # distinct: writes through it are exact
    mask2 = torch.randn(5, 6, generator=g) > 0
    mask1 = torch.randn(6, generator=g) > 0
    perm = torch.argsort(torch.randn(5, 3, 7, generator=g), dim=1)     # distinct positions per row: scatter is exact
    gidx = torch.randint(0, 6, (5, 3, 7), generator=g)
    ints = torch.randint(0, 4, (5, 6), generator=g)
    tok = torch.randint(0, 5, (4, 6), generator=g)                      # token ids, split like a batch
    X = lambda m: specs_for(m, 3)
    I = lambda nd: (lambda m: specs_for(m, nd, partial=False))
    R = [None]
    # in place into a dim split along the written dim cannot keep the layout (a loud error, tested below)
    Xk = lambda d: (lambda m: [s for s in specs_for(m, 3) if s[0][d] == "None"])
    Xk12 = lambda m: [s for s in specs_for(m, 3) if s[0][1] == s[0][2] == "None"]
    cases = [
        ("x[int]", lambda t: t[1], [x], None, True),
        ("x[:, int]", lambda t: t[:, -1], [x], None, True),
        ("x[..., slice]", lambda t: t[..., 2:5], [x], None, True),
        ("x[:, None]", lambda t: t[:, None], [x], None, True),
        ("x[1:3, :, None, ...]", lambda t: t[1:3, :, None, ...], [x], None, True),
        ("x[:, :100] full", lambda t: t[:, :100], [x], None, True),
        ("x[-5:] full", lambda t: t[-5:], [x], None, True),
        ("x[..., ::2]", lambda t: t[..., ::2], [x], None, True),
        ("x[:, -1:, :]", lambda t: t[:, -1:, :], [x], None, True),
        ("x[long]", lambda t: t[ix], [x], None, True),
        ("x[:, long]", lambda t: t[:, ix], [x], None, True),
        ("x[long, :, long]", lambda t: t[ix, :, ix], [x], None, True),
        ("x[0, :, long]", lambda t: t[0, :, ix], [x], None, True),
        ("x[list]", lambda t: t[[0, 3]], [x], None, True),
        ("x[mask2d]", lambda t: t[mask2], [x], None, True),
        ("x[:, mask]", lambda t: t[:, mask1], [x], None, True),
        ("x[DTensor long]", lambda t, i: t[i], [x, ix], [X, I(1)], True),
        ("emb[token ids]", lambda t, i: t[i], [x, tok], [[(("None",) * 3, None)], I(2)], True),
        ("x[DTensor mask]", lambda t, m: t[m], [x, mask2], [X, I(2)], True),
        # __setitem__
        ("x[:, 1:3] = v", _set((slice(None), slice(1, 3))), [x, torch.randn(5, 2, 7)], [X, X], True),
        ("x[0] = v", _set(0), [x, torch.randn(6, 7)], [X, lambda m: specs_for(m, 2)], True),
        ("x[:, 4] = v", _set((slice(None), 4)), [x, torch.randn(5, 7)], [X, lambda m: specs_for(m, 2)], True),
        ("x[..., 2] = 0.5", _set((Ellipsis, 2), False, 0.5), [x], None, True),
        ("x[1:4] = 3.0", _set(slice(1, 4), False, 3.0), [x], None, True),
        ("x[:] = v bcast", _set(slice(None)), [x, torch.randn(7)], [X, lambda m: specs_for(m, 1)], True),
        ("x[:, :, 5:] = v", _set((Ellipsis, slice(5, None))), [x, torch.randn(6, 2)],
         [X, lambda m: specs_for(m, 2)], True),
        ("x[mask] = 0", _set(mask2, False, 0.0),
         [x], [lambda m: [s for s in specs_for(m, 3) if all(e == "None" for e in s[0][:2])]], True),
        # ints and slices on split dims together with tensor indices (a logits row: scores[i, banned] = -inf)
        ("x[int, list] = v", _set((1, [0, 3, 5])), [x, torch.randn(3, 7)], [Xk(1), lambda m: specs_for(m, 2)],
         True),
        ("x[int, list] = -1.5", _set((3, [1, 4]), False, -1.5), [x], [Xk(1)], True),
        ("x[:, long, int] = v", _set((slice(None), ixd, 2)), [x, torch.randn(5, 3)], [Xk(1), lambda m: specs_for(m, 2)],
         True),
        ("x[long, 1:3] = v", _set((ixd, slice(1, 3))), [x, torch.randn(3, 2, 7)], [Xk(0), X], True),
        ("x[:, long] = v", _set((slice(None), ix)), [x, torch.randn(5, 4, 7)],
         [lambda m: [s for s in specs_for(m, 3) if s[0][1] == "None"], lambda m: specs_for(m, 3)], True),
        # tensor indices into the split dims (a detection head's per-sample query writes): each rank writes its own
        ("x[long] = v into split rows", _set(ixd), [x, torch.randn(3, 6, 7)], [Xk12, X], True),
        ("x[long, :, long] = v", _set((ixd, slice(None), torch.tensor([6, 1, 3]))), [x, torch.randn(3, 6)],
         [Xk(1), lambda m: specs_for(m, 2)], True),
        ("x[rows[:, None], cols] = v", _set((torch.arange(5)[:, None], perm[:, :, 0] % 6)),
         [x, torch.randn(5, 3, 7)], [Xk(2), X], True),
        ("x[long, long] = 2.0", _set((ixd, torch.tensor([1, 5, 0])), False, 2.0), [x], [Xk(2)], True),
        ("x[-long, 1:4, long] = v bcast", _set((-1 - ixd, slice(1, 4), torch.tensor([0, 6, 2]))),
         [x, torch.randn(1)], [Xk(1), lambda m: specs_for(m, 1)], True),
        # gather / scatter families
        ("torch.gather", lambda t, i: torch.gather(t, 1, i), [x, gidx], [X, I(3)], True),
        ("Tensor.gather", lambda t, i: t.gather(2, i[..., :7] % 7), [x, gidx], [X, R], True),
        ("index_select", lambda t, i: torch.index_select(t, 0, i), [x, ix], [X, I(1)], True),
        ("Tensor.index_select", lambda t: t.index_select(2, ix), [x], None, True),
        ("take_along_dim", lambda t, i: torch.take_along_dim(t, i, dim=1), [x, gidx], [X, I(3)], True),
        ("take_along_dim flat", lambda t: torch.take_along_dim(t, torch.tensor([3, 0, 7])), [x], None, True),
        ("scatter", lambda t, i, s: torch.scatter(t, 1, i, s), [x, perm, torch.randn(5, 3, 7)], [X, I(3), X], True),
        ("Tensor.scatter value", lambda t, i: t.scatter(1, i, 2.0), [x, perm], [X, I(3)], True),
        ("scatter_add", lambda t, s: torch.scatter_add(t, 1, gidx, s), [x, torch.randn(5, 3, 7)], [X, X], True),
        ("scatter_add_", lambda t, s: (t * 1).scatter_add_(1, gidx, s), [x, torch.randn(5, 3, 7)], [Xk(1), X], True),
        ("scatter_reduce amax", lambda t, s: torch.scatter_reduce(t, 1, gidx, s, "amax"), [x, torch.randn(5, 3, 7)],
         [X, X], True),
        ("Tensor.scatter_reduce sum", lambda t, s: t.scatter_reduce(1, gidx, s, reduce="sum", include_self=False),
         [x, torch.randn(5, 3, 7)], [X, X], True),
        ("scatter_", lambda t, s: (t * 1).scatter_(1, perm, s), [x, torch.randn(5, 3, 7)], [Xk(1), X], True),
        ("index_add", lambda t, s: torch.index_add(t, 1, ix, s, alpha=2), [x, torch.randn(5, 4, 7)], [X, X], True),
        ("index_add_", lambda t, s: (t * 1).index_add_(0, ix, s), [x, torch.randn(4, 6, 7)], [Xk(0), X], True),
        ("index_copy", lambda t, s: t.index_copy(1, torch.tensor([5, 1]), s), [x, torch.randn(5, 2, 7)],
         [X, X], True),
        ("index_copy_", lambda t, s: (t * 1).index_copy_(2, torch.tensor([6, 0, 3]), s),
         [x, torch.randn(5, 6, 3)], [Xk(2), X], True),
        # data-dependent results and Python values
        ("masked_select", lambda t: torch.masked_select(t, t > 0), [x], None, True),
        ("Tensor.masked_select", lambda t, m: t.masked_select(m), [x, mask2[..., None]], [X, I(3)], True),
        ("nonzero", lambda t: torch.nonzero(t > 0.5), [x], None, False),
        ("Tensor.nonzero tuple", lambda t: (t > 0.5).nonzero(as_tuple=True), [x], None, False),
        ("unique", lambda t: torch.unique(t), [ints], None, False),
        ("unique inverse counts", lambda t: torch.unique(t, return_inverse=True, return_counts=True), [ints],
         None, False),
        ("Tensor.unique dim", lambda t: t.unique(dim=0), [ints], None, False),
        ("item", lambda t: t.sum().item(), [x], None, False),
        ("item int", lambda t: (t > 0).sum().item(), [x], None, False),
        ("tolist", lambda t: t.tolist(), [x], None, False),
        ("bool", lambda t: bool((t > 3).any()), [x], None, False),
        ("int", lambda t: int(t.sum()), [ints], None, False),
        ("float", lambda t: float(t.amax()), [x], None, False),
        ("index", lambda t: list(range(10))[t.amax()], [ints], None, False),
    ]
    return cases


def _run_all(rank, world):
    return run_cases(_cases(), world)


def _loud(rank, world):
    """Writes the split layout cannot take in place are a clear error: a tensor index into a split dim mixed
    with an int (tensor indices and slices alone write each rank's own positions)."""
    mesh = meshes(world)[0]
    x = hp.distribute_tensor(torch.zeros(4, 6), mesh(mesh.alias_name[-1], "None"))
    try:
        x[torch.tensor([0, 3]), 1] = 1.0
    except RuntimeError as e:
        msg = str(e)
        if "__setitem__" not in msg or "laid out" not in msg:
            return False
    else:
        return False
    z = hp.distribute_tensor(torch.zeros(4, 6, 5), mesh("None", mesh.alias_name[-1], "None"))
    try:  # the int between the tensors: made a one-wide slice, it would move the indexed dims to the front
        z[[0, 2], 1, [3, 4]] = 1.0
    except RuntimeError as e:
        if "__setitem__" not in str(e) or "between tensor indices" not in str(e):
            return False
    else:
        return False
    # index_add_ into the split dim writes each rank's own rows (was refused; tests/test_split_batch.py has more)
    y = hp.distribute_tensor(torch.zeros(4, 6), mesh(mesh.alias_name[-1], "None"))
    y.index_add_(0, torch.tensor([0, 3]), torch.ones(2, 6))
    return torch.equal(y.full_tensor(), torch.zeros(4, 6).index_add_(0, torch.tensor([0, 3]), torch.ones(2, 6)))


def _embedding_split(rank, world):
    """Token ids split over a mesh axis index a replicated table without gathering the ids."""
    mesh = meshes(world)[0]
    ax = mesh.alias_name[-1]
    table = hp.distribute_tensor(torch.randn(10, 4), mesh("None", "None"))
    ids = hp.distribute_tensor(torch.randint(0, 10, (4, 3)), mesh(ax, "None"))
    with hp.comm_counter() as c:
        out = table[ids]
    return out.dist_layout is mesh(ax, "None", "None") and not sum(c.counts.values())


@pytest.mark.parametrize("world", [2, 4])
def test_indexing_ops(world, dist2, dist4):
    pool = dist2 if world == 2 else dist4
    failures = pool.run(_run_all)[0]
    assert not failures, "\n\n".join(failures[:8]) + f"\n... {len(failures)} failures"


def test_indexing_layouts(dist2, dist4):
    for pool in (dist2, dist4):
        assert all(pool.run(_loud)), "setitem through a tensor index and an int on a split dim must fail loudly"
        assert all(pool.run(_embedding_split))


def _view_writes():
    """In-place ops on a view `v` of x (`v = x[...]`, `x.select`, `x.narrow`), applied to a non-leaf copy of x; each
    returns (x, v) so both are compared. With x split on dim 0 a view selecting along it is taken of a gathered copy,
    which the write must reach x through."""
    def on(view, op):
        def fn(t, y):
            t = t * 1.0
            v = view(t)
            op(v, y)
            return t, v
        return fn
    def two_rows(t, y):  # the first write-back writes x while b is held: b's copy is still x[3], so it writes too
        t = t * 1.0
        a, b = t[0], t[3]
        a += y
        b *= y
        return t, torch.stack([a, b])
    row = lambda t: t[2]
    return [
        ("a, b = x[0], x[3]; a += y; b *= y", two_rows),
        ("x[i] += y", on(row, lambda v, y: v.__iadd__(y))),
        ("x[-1].mul_(y)", on(lambda t: t[-1], lambda v, y: v.mul_(y))),
        ("x[1:3] -= y", on(lambda t: t[1:3], lambda v, y: v.__isub__(y))),
        ("x[::2, 1:] *= 2", on(lambda t: t[::2, 1:], lambda v, y: v.__imul__(2.0))),
        ("x[None, 3, ..., 1:]", on(lambda t: t[None, 3, ..., 1:], lambda v, y: v.add_(y[1:]))),
        ("select(0, 1).addcmul_", on(lambda t: t.select(0, 1), lambda v, y: v.addcmul_(y, y))),
        ("select(-2, 0).add_", on(lambda t: t.select(-2, 0), lambda v, y: v.add_(y))),
        ("narrow(0, 1, 2).div_", on(lambda t: t.narrow(0, 1, 2), lambda v, y: v.div_(y.abs() + 1))),
        ("x[i] twice, then v[j] = y", on(row, lambda v, y: (v.add_(y), v.mul_(y), v.__setitem__(1, y[0])))),
        ("x[i].fill_", on(row, lambda v, y: v.fill_(0.25))),
    ]


def _view_writes_through(rank, world):
    """Each case against plain torch on the same values, x split on dim 0 or 1 or replicated: both x and the view,
    their values and the gradients of x and y."""
    mesh = hp.Layout((world,), ("dp",))
    g = torch.Generator().manual_seed(7)
    x0, y0 = torch.randn(5, 3, generator=g), torch.randn(3, generator=g)
    failures = []
    for name, fn in _view_writes():
        rx, ry = x0.clone().requires_grad_(), y0.clone().requires_grad_()
        ref = fn(rx, ry)
        (ref[0] * ref[0]).sum().backward()
        for lay in [mesh("dp", "None"), mesh("None", "dp"), mesh("None", "None")]:
            dx = hp.distribute_tensor(x0.clone(), lay, src_data_rank=None).requires_grad_()
            dy = hp.distribute_tensor(y0.clone(), mesh("None"), src_data_rank=None).requires_grad_()
            try:
                out = fn(dx, dy)
                (out[0] * out[0]).sum().backward()
                same = all(torch.allclose(o.full_tensor(), r, atol=1e-6) for o, r in zip(out, ref)) and \
                    all((d.grad is None) == (r.grad is None) and (r.grad is None or torch.allclose(
                        d.grad.full_tensor(), r.grad, atol=1e-5)) for d, r in ((dx, rx), (dy, ry)))
                if not same:
                    failures.append(f"{name} {lay}: differs")
            except Exception as e:  # noqa: BLE001 - reported per case
                failures.append(f"{name} {lay}: {type(e).__name__}: {e}")
        with torch.no_grad():  # no grad: the replicated fast path (the C twin where built) runs the op
            ref = fn(x0.clone(), y0)
            dx = hp.distribute_tensor(x0.clone(), mesh("dp", "None"), src_data_rank=None)
            out = fn(dx, hp.distribute_tensor(y0, mesh("None"), src_data_rank=None))
            if not all(torch.allclose(o.full_tensor(), r, atol=1e-6) for o, r in zip(out, ref)):
                failures.append(f"{name} no grad: differs")
    # the line in SmolVLM / ModernVBERT: an in-place `|=` into one row of a batch-split mask
    m0 = torch.tensor([False, False, True, False, False])
    for m_ in (m0, torch.zeros(5, dtype=torch.bool)):
        ref = m_.clone()
        ref[0] |= ~torch.any(ref)
        m = hp.distribute_tensor(m_.clone(), mesh("dp"), src_data_rank=None)
        m[0] |= ~torch.any(m)
        if not torch.equal(m.full_tensor(), ref):
            failures.append(f"mask[0] |= ~any(mask) from {m_.tolist()}: {m.full_tensor().tolist()}")
    return failures


def _view_writes_loud(rank, world):
    """What cannot be written back raises, alike on every rank, rather than writing into a copy: a view of such a
    view (which has no note of its own), and a view whose original was written after the view was taken."""
    mesh = hp.Layout((world,), ("dp",))
    msgs = []
    for make, write in [(lambda x: x[0][1:], lambda w: w.add_(1)),
                        (lambda x: x[0].view(3), lambda w: w.__iadd__(1)),
                        (lambda x: x[1], lambda w: w.mul_(2))]:
        x = hp.distribute_tensor(torch.ones(4, 3), mesh("dp", "None"), src_data_rank=None)
        w = make(x)
        if len(msgs) == 2:
            x.add_(1)  # the original written after its view was taken: the view's copy is stale
        try:
            write(w)
            msgs.append(None)
        except RuntimeError as e:
            msgs.append("redistributed copy" in str(e) and ("stale" in str(e)) == (len(msgs) == 2))
    return msgs


def _zip_rows_index(rank, world):
    """`rows, cols = zip(*ind)` (UDOP) iterates a DTensor into 0-d DTensors; indexing with those tuples writes and
    reads as torch does with the same values."""
    mesh = hp.Layout((world,), ("dp",))
    ind = torch.tensor([[0, 1], [1, 3], [3, 0], [2, 2]])
    ref = torch.ones(4, 5, dtype=torch.bool)
    rows, cols = zip(*ind)
    ref[rows, cols] = False
    p = hp.distribute_tensor(torch.ones(4, 5, dtype=torch.bool), mesh("dp", "None"), src_data_rank=None)
    rows, cols = zip(*hp.distribute_tensor(ind, mesh("dp", "None"), src_data_rank=None))
    p[rows, cols] = False
    return torch.equal(p.full_tensor(), ref) and torch.equal(p[rows, cols].full_tensor(), ref[rows, cols])


def test_inplace_ops_on_views_of_split_tensors(dist2):
    failures = dist2.run(_view_writes_through)
    assert not failures[0] and not failures[1], "\n".join(failures[0] + failures[1])
    assert dist2.run(_view_writes_loud) == [[True, True, True]] * 2
    assert all(dist2.run(_zip_rows_index))
