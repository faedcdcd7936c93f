"""Shape ops on DTensors vs plain tensors: Shard / Replicate / Partial inputs, uneven splits, 1-D and 2x2 meshes."""
import pytest
import torch

import hyper_parallel as hp
from tests.op_check import check, meshes, run_cases, specs_for

try:
    from hypothesis import given, settings, strategies as st, HealthCheck
except ImportError:  # pragma: no cover
    given = None


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    x3 = r(4, 6, 8)       # even
    u3 = r(5, 3, 6)       # uneven on every split count
    one = r(1, 6, 8)      # batch 1: (1, S, H) -> (S, H) keeps S split
    cases = [
        ("view merge", lambda t: t.view(24, 8), [x3], None, True),
        ("view merge uneven", lambda t: t.view(15, 6), [u3], None, True),
        ("reshape split heads", lambda t: t.reshape(4, 6, 2, 4), [x3], None, True),
        ("torch.reshape -1", lambda t: torch.reshape(t, (4, -1)), [x3], None, True),
        ("view tuple", lambda t: t.view((4, 48)), [x3], None, True),
        ("view 0-d tensor size", lambda t: t.view(4, torch.tensor(12) // 2, 8), [x3], None, True),
        ("reshape Size", lambda t: t.reshape(torch.Size([2, 2, 6, 8])), [x3], None, True),
        # bits of a float sum are not exact: only split / replicated inputs here
        ("view dtype", lambda t: (t * 1).view(torch.int32), [u3],
         [lambda m: [s for s in specs_for(m, 3) if s[1] is None]], False),
        ("select", lambda t: t.select(1, 2), [u3], None, True),
        ("torch.select", lambda t: torch.select(t, -1, 0), [x3], None, True),
        ("repeat tuple", lambda t: t.repeat((1, 1, 2)), [u3], None, True),
        ("view batch1", lambda t: t.view(6, 8), [one], None, True),
        ("view_as", lambda t: t.view(2, 2, 6, 8).view_as(torch.empty(4, 6, 8)), [x3], None, True),
        ("reshape uneven heads", lambda t: t.reshape(5, 3, 3, 2), [u3], None, True),
        ("flatten", lambda t: t.flatten(1), [x3], None, True),
        ("torch.flatten", lambda t: torch.flatten(t), [u3], None, True),
        ("unflatten", lambda t: t.unflatten(2, (2, 4)), [x3], None, True),
        ("transpose", lambda t: t.transpose(0, 2), [u3], None, True),
        ("torch.transpose", lambda t: torch.transpose(t, 1, -1), [x3], None, True),
        ("t", lambda t: t.t(), [r(5, 3)], None, True),
        ("permute", lambda t: t.permute(2, 0, 1), [u3], None, True),
        ("torch.permute", lambda t: torch.permute(t, (1, 2, 0)), [x3], None, True),
        ("swapaxes", lambda t: t.swapaxes(0, 1), [u3], None, True),
        ("movedim", lambda t: torch.movedim(t, 0, -1), [x3], None, True),
        ("unsqueeze", lambda t: t.unsqueeze(1), [u3], None, True),
        ("torch.unsqueeze", lambda t: torch.unsqueeze(t, -1), [x3], None, True),
        ("squeeze", lambda t: t.squeeze(), [one], None, True),
        ("squeeze dim", lambda t: t.squeeze(0), [one], None, True),
        ("squeeze dims", lambda t: torch.squeeze(t, (0, 1)), [one], None, True),
        ("squeeze local size1", lambda t: t.squeeze(), [r(2, 4)], None, True),
        ("expand", lambda t: t.unsqueeze(1).expand(5, 4, 3, 6), [u3], None, True),
        ("expand -1", lambda t: t.expand(3, -1, -1, -1), [x3], None, True),
        ("expand_as", lambda t: t.expand_as(torch.empty(2, 4, 6, 8)), [x3], None, True),
        ("repeat", lambda t: t.repeat(1, 2, 1), [u3], None, True),
        ("repeat lead", lambda t: t.repeat(2, 1, 1, 1), [x3], None, True),
        ("tile fewer", lambda t: t.tile((2, 1)), [u3], None, True),
        ("torch.tile lead", lambda t: torch.tile(t, (2, 1, 1, 2)), [x3], None, True),
        ("repeat_interleave dim", lambda t: t.repeat_interleave(2, dim=1), [u3], None, True),
        ("torch.repeat_interleave flat", lambda t: torch.repeat_interleave(t, 2), [r(3, 4)], None, True),
        ("repeat_interleave tensor", lambda t: t.repeat_interleave(torch.tensor([1, 2, 0, 1]), dim=0),
         [x3], None, True),
        ("split", lambda t: t.split(2, dim=-1), [u3], None, True),
        ("torch.split sizes", lambda t: torch.split(t, [1, 4], dim=0), [u3], None, True),
        ("chunk", lambda t: t.chunk(2, dim=1), [x3], None, True),
        ("torch.chunk", lambda t: torch.chunk(t, 3, 2), [u3], None, True),
        ("unbind", lambda t: t.unbind(1), [u3], None, True),
        ("torch.unbind", lambda t: torch.unbind(t), [x3], None, True),
        ("narrow", lambda t: t.narrow(2, 1, 3), [u3], None, True),
        ("torch.narrow", lambda t: torch.narrow(t, 0, 0, 2), [x3], None, True),
        ("contiguous", lambda t: t.transpose(0, 1).contiguous(), [u3], None, True),
    ]
    both = lambda m: specs_for(m, 3)
    cases += [
        ("cat dim0", lambda a, b: torch.cat([a, b], dim=0), [u3, r(2, 3, 6)], [both, both], True),
        ("cat dim -1", lambda a, b: torch.cat((a, b), -1), [u3, r(5, 3, 2)], [both, both], True),
        ("concat plain", lambda a, b: torch.concat([a, b], 1), [x3, r(4, 2, 8)], [both, [None]], True),
        ("stack", lambda a, b: torch.stack([a, b], dim=1), [u3, r(5, 3, 6)], [both, both], True),
        ("stack last", lambda a, b: torch.stack([a, b], -1), [x3, r(4, 6, 8)], [both, both], True),
    ]
    return cases


def _run_all(rank, world):
    return run_cases(_cases(), world)


def _layouts(rank, world):
    """Splits that must survive (no communication) and their placements."""
    out = []
    for mesh in meshes(world):
        tp = mesh.alias_name[-1]
        n = mesh.mesh_shape[-1]
        x = hp.distribute_tensor(torch.randn(4, 6, 8 * n), mesh("None", "None", tp))
        b = hp.distribute_tensor(torch.randn(2 * n, 6, 8), mesh(tp, "None", "None"))
        with hp.comm_counter() as c:
            y = x.view(4, 6, 2 * n, 4)  # heads divisible: stays split on dim 2
            z = x.view(24, 8 * n)       # dim 0 merged, dim 1 replicated: no change
            w = b.reshape(12 * n, 8)     # outermost of a merged group
            p = x.transpose(0, 2).unsqueeze(0).permute(0, 3, 1, 2)
        if sum(c.counts.values()):
            out.append(f"views communicated: {c}")
        for t, want in ((y, mesh("None", "None", tp, "None")), (z, mesh("None", tp)), (w, mesh(tp, "None")),
                        (p, mesh("None", "None", tp, "None"))):
            if t.dist_layout is not want:
                out.append(f"layout {t.dist_layout}, expected {want}")
        # an indivisible head split must gather, not corrupt
        u = hp.distribute_tensor(torch.randn(2, 3 * 4), mesh("None", tp))
        v = u.view(2, 3, 4)
        if not torch.equal(v.full_tensor(), u.full_tensor().view(2, 3, 4)):
            out.append("indivisible head split is wrong")
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_shape_ops(world, dist2, dist4):
    pool = dist2 if world == 2 else dist4
    failures = pool.run(_run_all)[0]
    assert not failures, "\n\n".join(failures[:8]) + f"\n... {len(failures)} failures"


def test_views_keep_splits(dist2, dist4):
    for pool in (dist2, dist4):
        res = pool.run(_layouts)
        assert not res[0], res[0]


def _view_case(rank, world, shape, new_shape, entries, partial, seed):
    torch.manual_seed(seed)
    x = torch.randn(shape)
    mesh = meshes(world)[-1]
    return check(lambda t: t.reshape(new_shape), [x], [(entries, partial)], mesh, grad=True, label="prop reshape")


def _factorings(draw, shape):
    """A random regrouping of `shape`'s elements: merge neighbours or split factors, with singleton dims."""
    dims = []
    for n in shape:
        fs = [f for f in (2, 3) if n % f == 0 and n > f]
        if fs and draw(st.booleans()):
            f = draw(st.sampled_from(fs))
            dims += [f, n // f]
        else:
            dims.append(n)
    out = []
    i = 0
    while i < len(dims):
        if i + 1 < len(dims) and draw(st.booleans()):
            out.append(dims[i] * dims[i + 1])
            i += 2
        else:
            out.append(dims[i])
            i += 1
    if draw(st.booleans()):
        out.insert(draw(st.integers(0, len(out))), 1)
    return tuple(out)


if given is not None:
    @st.composite
    def _view_inputs(draw):
        nd = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 8]), min_size=nd, max_size=nd)))
        new_shape = _factorings(draw, shape)
        names = ("dp", "tp")
        entries = []
        used = set()
        for _ in range(nd):
            e = draw(st.sampled_from(["None", "dp", "tp", ("dp", "tp"), ("tp", "dp")]))
            axes = set(e) if isinstance(e, tuple) else ({e} if e != "None" else set())
            if axes & used:
                e, axes = "None", set()
            used |= axes
            entries.append(e)
        free = [n for n in names if n not in used]
        partial = draw(st.sampled_from([None] + free)) if free else None
        return shape, new_shape, tuple(entries), partial, draw(st.integers(0, 1000))

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_view_inputs())
    def test_reshape_property(dist4, case):
        shape, new_shape, entries, partial, seed = case
        res = dist4.run(_view_case, shape, new_shape, entries, partial, seed)
        assert res[0] is None, res[0]
