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
