"""Reductions on DTensors vs plain tensors: Shard / Replicate / Partial inputs, uneven splits, 1-D and 2x2 meshes."""
import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from tests.op_check import meshes, run_cases


def _cases():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 6, 7, generator=g)   # uneven on 2 and 4 ranks for dims 0 and 2
    e = torch.randn(4, 8, generator=g)
    b = torch.randn(5, 6, 7, generator=g) > 0
    return [
        ("sum", lambda t: t.sum(), [x], None, True),
        ("sum dim", lambda t: t.sum(0), [x], None, True),
        ("torch.sum dims keepdim", lambda t: torch.sum(t, (0, 2), keepdim=True), [x], None, True),
        ("sum dim -1", lambda t: t.sum(dim=-1), [e], None, True),
        ("mean axis= keepdim", lambda t: t.mean(axis=2, keepdim=True) + t.sum(axis=(0, 1)).mean(), [x], None, True),
        ("sum bool", lambda t: (t > 0).sum(1), [x], None, False),
        ("mean", lambda t: t.mean(), [x], None, True),
        ("mean dim", lambda t: t.mean(dim=2), [x], None, True),
        ("torch.mean dims keepdim", lambda t: torch.mean(t, (0, 1), keepdim=True), [x], None, True),
        ("amax", lambda t: t.amax(dim=-1), [x], None, True),
        ("torch.amax all", lambda t: torch.amax(t), [x], None, True),
        ("amin keepdim", lambda t: t.amin(0, keepdim=True), [x], None, True),
        ("max", lambda t: t.max(), [x], None, True),
        ("torch.min", lambda t: torch.min(t), [x], None, True),
        ("max dim", lambda t: t.max(dim=1), [x], None, True),
        ("max dim values", lambda t: t.max(2, keepdim=True).values, [x], None, True),
        ("torch.min dim", lambda t: torch.min(t, 0), [x], None, True),
        ("max other", lambda t: torch.max(t, t * 0.5), [x], None, True),
        ("Tensor.min other", lambda t: t.min(t.exp() - 1.5), [x], None, True),
        ("argmax", lambda t: t.argmax(), [x], None, False),
        ("argmax dim", lambda t: torch.argmax(t, dim=1, keepdim=True), [x], None, False),
        ("argmin dim", lambda t: t.argmin(-1), [x], None, False),
        ("softmax", lambda t: torch.softmax(t, -1), [x], None, True),
        ("Tensor.softmax", lambda t: t.softmax(dim=0), [x], None, True),
        ("F.softmax", lambda t: F.softmax(t, dim=1), [x], None, True),
        ("F.softmax legacy", lambda t: F.softmax(t), [e], None, True),
        ("F.log_softmax", lambda t: F.log_softmax(t, dim=-1, dtype=torch.float64), [x], None, True),
        ("log_softmax", lambda t: t.log_softmax(1), [x], None, True),
        ("prod", lambda t: t.prod(1), [x], None, True),
        ("prod all", lambda t: torch.prod(t * 0.1 + 1), [e], None, True),
        ("cumsum", lambda t: torch.cumsum(t, dim=1), [x], None, True),
        ("Tensor.cumsum", lambda t: t.cumsum(-1), [x], None, True),
        ("all", lambda t: t.all(), [b], None, False),
        ("any dim", lambda t: torch.any(t, dim=1), [b], None, False),
        ("all dim keepdim", lambda t: t.all(2, keepdim=True), [b], None, False),
        ("norm", lambda t: t.norm(), [x], None, True),
        ("torch.norm dim", lambda t: torch.norm(t, dim=-1), [x], None, True),
        ("norm p1", lambda t: t.norm(p=1, dim=0), [x], None, True),
        ("norm inf", lambda t: t.norm(p=float("inf"), dim=1), [x], None, True),
        ("vector_norm", lambda t: torch.linalg.vector_norm(t, dim=(0, 2)), [x], None, True),
        ("norm p3.0 then p1.5", lambda t: t.norm(p=3.0, dim=0) + t.norm(p=1.5, dim=0), [x], None, True),
        ("vector_norm 3", lambda t: torch.linalg.vector_norm(t, ord=3, keepdim=True), [x], None, True),
        ("var", lambda t: t.var(), [x], None, True),
        ("var dim", lambda t: torch.var(t, dim=1, correction=0), [x], None, True),
        ("std dim", lambda t: t.std(0, keepdim=True), [x], None, True),
        ("std unbiased", lambda t: torch.std(t, False), [e], None, True),
        ("topk", lambda t: t.topk(3), [x], None, True),
        ("torch.topk dim", lambda t: torch.topk(t, 2, dim=0, largest=False), [x], None, True),
        ("sort", lambda t: t.sort(dim=1, descending=True), [x], None, True),
        ("torch.sort", lambda t: torch.sort(t), [x], None, True),
        ("argsort", lambda t: t.argsort(dim=0), [x], None, False),
        ("torch.argsort", lambda t: torch.argsort(t, descending=True), [x], None, False),
        ("logsumexp", lambda t: torch.logsumexp(t, dim=1), [x], None, True),
        ("Tensor.logsumexp", lambda t: t.logsumexp((0, 2), keepdim=True), [x], None, True),
        ("amax chain", lambda t: t.amax(1).amax(0), [x], None, True),
        ("rmsnorm", lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6), [x], None, True),
    ]


def _run_all(rank, world):
    return run_cases(_cases(), world)


def _no_comm(rank, world):
    """A sum / mean / amax over a split dim must not communicate; the pending reduction shows as Partial."""
    out = []
    for mesh in meshes(world):
        tp = mesh.alias_name[-1]
        x = hp.distribute_tensor(torch.randn(5, 7), mesh("None", tp))
        with hp.comm_counter() as c:
            s = x.sum(-1)
            m = x.mean(dim=1)
            a = x.amax(-1)
            p = s.sum()  # Partial(sum) in, Partial(sum) out
        if sum(c.counts.values()):
            out.append(f"reductions communicated: {c}")
        for t, op in ((s, "sum"), (m, "sum"), (a, "max"), (p, "sum")):
            if t.placements[-1] != hp.Partial(op):
                out.append(f"{t.dist_layout} should be Partial({op}) on {tp}")
        full = x.full_tensor()
        if not torch.allclose(m.full_tensor(), full.mean(1), atol=1e-6):
            out.append("uneven mean is not exact")
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_reduction_ops(world, dist2, dist4):
    pool = dist2 if world == 2 else dist4
    failures = pool.run(_run_all)[0]
    assert not failures, "\n\n".join(failures[:8]) + f"\n... {len(failures)} failures"


def test_reductions_defer_communication(dist2, dist4):
    for pool in (dist2, dist4):
        res = pool.run(_no_comm)[0]
        assert not res, res
