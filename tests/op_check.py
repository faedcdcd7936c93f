"""Compare an op on DTensors with the same op on plain tensors (values and input gradients).

Used from inside harness workers: every rank builds the same full tensors (same seed), lays them out,
runs `fn` on DTensors and on the plain tensors, and compares `full_tensor()` of every output and the
gradients of every floating input after a backward through a fixed random weighting of the outputs.
"""
from __future__ import annotations

import contextlib
import os

import torch

import hyper_parallel as hp
from hyper_parallel import DTensor
from hyper_parallel.dispatch import registry


@contextlib.contextmanager
def without_rule(name: str):
    """The op `name` with its rule taken away inside (to test what users meet for an op without one)."""
    saved, source = registry.RULES.get(name), registry._SOURCES.get(name)
    registry.unregister(name)
    try:
        yield
    finally:
        registry.unregister(name)
        if saved is not None:
            registry.RULES[name], registry._SOURCES[name] = saved, source


def meshes(world: int) -> list:
    """The mesh a test runs on: 1-D over 2 ranks, 2x2 over 4."""
    if world == 4:
        return [hp.Layout((2, 2), ("dp", "tp"))]
    return [hp.Layout((world,), ("tp",))]


def specs_for(mesh: hp.Layout, ndim: int, partial: bool = True) -> list:
    """Layout specs for a rank-`ndim` input: replicated, each dim split, nested splits, and Partial."""
    names = mesh.alias_name
    out = [(("None",) * ndim, None)]
    for d in range(ndim):
        out.append((tuple(names[-1] if i == d else "None" for i in range(ndim)), None))
    if len(names) == 2 and ndim:
        out.append((tuple(names if i == 0 else "None" for i in range(ndim)), None))
        if ndim > 1:
            out.append((tuple(names[0] if i == 0 else names[1] if i == ndim - 1 else "None"
                              for i in range(ndim)), None))
    if partial:
        out.append((("None",) * ndim, names[-1]))
        if len(names) == 2 and ndim:
            out.append(((names[0],) + ("None",) * (ndim - 1), names[1]))
    return out


def _terms(x: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Term `index` of `parts` random terms summing to x (the same on every rank)."""
    g = torch.Generator().manual_seed(99)
    others = [torch.randn(x.shape, generator=g, dtype=x.dtype) if x.is_floating_point()
              else torch.randint(-3, 4, x.shape, generator=g).to(x.dtype) for _ in range(parts - 1)]
    if index == 0:
        return x - sum(others) if others else x.clone()
    return others[index - 1]


def make(x: torch.Tensor, mesh: hp.Layout, spec, grad: bool):
    """(DTensor, leaf whose .grad to check, layout the leaf's grad follows)."""
    entries, partial = spec
    lay = mesh(*entries)
    if partial is None:
        dt = hp.distribute_tensor(x.detach(), lay, src_data_rank=None)  # every rank holds x already
        if grad:
            dt.requires_grad_()
        return dt, dt, lay
    axis = mesh.alias_name.index(partial)
    term = _terms(x.detach(), mesh.mesh_shape[axis], lay.mesh.coordinate[axis])
    local = hp.distribute_tensor(term, lay, src_data_rank=None).to_local().clone()
    if grad:
        local.requires_grad_()
    return DTensor.from_local(local, lay.with_partial(partial), shape=tuple(x.shape)), local, lay


def _flat(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return []


def _close(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.allclose(a, b, atol=atol, rtol=1e-4, equal_nan=True)
    return torch.equal(a, b)



def global_mismatch(out, ref: torch.Tensor, close) -> str | None:
    """What is wrong with a DTensor output against the plain reference (not a DTensor, global shape, value under
    `close(full, ref)`), or None: the check every op test and property chain ends with."""
    if not isinstance(out, DTensor):
        return f"is {type(out).__name__}, not a DTensor"
    if tuple(out.shape) != tuple(ref.shape):
        return f"global shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    full = out.full_tensor()
    if not close(full, ref.detach()):
        return f"differs ({out.dist_layout}): {full.flatten()[:4].tolist()} vs {ref.flatten()[:4].tolist()}"
    return None

def _same_value(ref, out, atol: float) -> bool:
    """Python results (item, tolist, bool): same type, equal up to float reduction order."""
    if type(ref) is not type(out):
        return False
    if isinstance(ref, float) or isinstance(ref, list):
        return torch.allclose(torch.tensor(out, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                              atol=atol, rtol=1e-4)
    return ref == out


def check(fn, xs: list, specs: list, mesh: hp.Layout, grad: bool = True, atol: float = 1e-4,
          label: str = "") -> str | None:
    """Run fn on plain tensors and on DTensors laid out by `specs`; return a failure message or None."""
    what = f"{label} on {mesh.mesh_shape} with {specs}"
    try:
        leaves_ref = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) for x in xs]
        ref = fn(*leaves_ref)
        made = [make(x, mesh, s, grad and x.is_floating_point()) if s is not None else (x, None, None)
                for x, s in zip(xs, specs)]
        out = fn(*[m[0] for m in made])
        ref_t, out_t = _flat(ref), _flat(out)
        if len(ref_t) != len(out_t):
            return f"{what}: {len(out_t)} tensor outputs, expected {len(ref_t)}"
        if not ref_t and not _same_value(ref, out, atol):
            return f"{what}: got {out!r}, expected {ref!r}"
        for i, (r, o) in enumerate(zip(ref_t, out_t)):
            bad = global_mismatch(o, r, lambda a, b: _close(a, b, atol))
            if bad:
                return f"{what}: output {i} {bad}"
        diff = [(r, o) for r, o in zip(ref_t, out_t) if r.requires_grad]
        if grad and diff:
            g = torch.Generator().manual_seed(7)
            weights = [torch.randn(r.shape, generator=g, dtype=r.dtype) for r, _ in diff]
            sum(((r * w).sum() for (r, _), w in zip(diff, weights)), torch.zeros(())).backward()
            sum(((o.full_tensor() * w).sum() for (_, o), w in zip(diff, weights)), torch.zeros(())).backward()
            for i, (lr, (_, leaf, lay)) in enumerate(zip(leaves_ref, made)):
                if leaf is None or lr.grad is None:
                    continue
                if leaf.grad is None:
                    return f"{what}: input {i} got no gradient"
                want = lr.grad
                if isinstance(leaf, DTensor):
                    if leaf.grad.dist_layout is not leaf.dist_layout:
                        return f"{what}: input {i} grad layout {leaf.grad.dist_layout}, not {leaf.dist_layout}"
                    got = leaf.grad.full_tensor()
                else:
                    got = leaf.grad
                    want = hp.distribute_tensor(want, lay, src_data_rank=None).to_local()
                if not _close(got, want, atol):
                    return f"{what}: input {i} grad differs:\n{got}\nexpected\n{want}"
    except Exception as e:  # report, with the case, every failure
        import traceback
        return f"{what}: raised {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    return None


def _combos(spec_lists: list, limit: int = 40) -> list:
    """Every combination of input layouts, or, when there are too many, rotations that pair each option
    of every input with several options of the others."""
    total = 1
    for options in spec_lists:
        total *= len(options)
    if total <= limit:
        combos = [[]]
        for options in spec_lists:
            combos = [c + [o] for c in combos for o in options]
        return combos
    n = max(len(o) for o in spec_lists)
    seen, combos = set(), []
    for shift in range(3):
        for k in range(n):
            combo = [opts[(k + i * shift) % len(opts)] for i, opts in enumerate(spec_lists)]
            if repr(combo) not in seen:
                seen.add(repr(combo))
                combos.append(combo)
    return combos


def run_cases(cases: list, world: int) -> list:
    """cases: (label, fn, inputs, per-input spec lists or None for 'all specs', grad). Returns failures."""
    failures = []
    for mesh in meshes(world):
        for label, fn, xs, spec_lists, grad in cases:
            if spec_lists is None:
                spec_lists = [specs_for(mesh, xs[0].ndim)] + [[None]] * (len(xs) - 1)
            else:
                spec_lists = [s(mesh) if callable(s) else s for s in spec_lists]
            # a pending sum of booleans means nothing: bool inputs are only split or replicated
            spec_lists = [[o for o in opts if o is None or o[1] is None or x.dtype != torch.bool]
                          for x, opts in zip(xs, spec_lists)]
            combos = _combos(spec_lists)
            for specs in combos:
                if os.environ.get("HP_OPCHECK_VERBOSE"):
                    print(f"[{torch.distributed.get_rank()}] {label} {mesh.mesh_shape} {specs}", flush=True)
                msg = check(fn, xs, specs, mesh, grad, label=label)
                if msg:
                    failures.append(msg)
    return failures
