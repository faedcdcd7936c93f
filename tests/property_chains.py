"""Random op chains on random layouts vs plain torch: the interpreter behind test_property_chains.py and
scripts/property_long.sh.

A case is plain data (drawn by hypothesis in the test process, sent to every rank): a mesh, an input
shape, a layout (Shard entries over mesh axes, uneven and empty shards included, Replicate, Partial
sum/avg/max, or a plain tensor), a chain of (op, parameter) steps and whether to run backward. Every rank
runs the chain on plain tensors and on DTensors and compares values and the gradients of every leaf that
is not Partial. An error raised by the DTensor run is "loud" (acceptable if every rank raised it); a value
or gradient that differs is "wrong".
"""
from __future__ import annotations

import traceback

import torch

import hyper_parallel as hp
from hyper_parallel import DTensor
from tests.op_check import global_mismatch

MESHES = {"2": ((2,), ("a",)), "4": ((4,), ("a",)), "2x2": ((2, 2), ("a", "b"))}
CASTS = ("half_float", "bf16_float", "double_float", "long_float", "int_float", "bool_float")
OPS = ("add_aux", "mul_scalar", "tanh", "exp", "relu", "neg", "matmul", "reshape_merge", "flatten", "expand_as",
       "view_as", "reshape_as", "sum_dim", "mean_dim", "sum_all", "mean_all", "softmax", "half_float",
       "bf16_float", "double_float", "long_float", "int_float", "bool_float", "transpose", "slice0", "select0",
       "setitem", "unsqueeze", "sub_aux", "amax_dim", "cat_aux", "where_aux", "max_values", "cumsum",
       "layer_norm", "clamp", "pow2", "argmax_float", "masked_fill", "rms_norm", "gather", "index_select",
       "div_aux", "getitem_list",
       # issue 30: the newer rules
       "index_copy", "index_add", "as_strided", "complex_rotary", "roll", "flip", "unfold", "where_nonzero",
       "one_hot", "bincount", "einsum", "softmax_dtype", "setitem_mask", "norm_dim", "linalg_norm", "inf_factor",
       "cross_entropy")
REDUCED = ("sum", "avg", "max")


# ---- layouts ----------------------------------------------------------------------------------
def layout_for(mesh: hp.Layout, ndim: int, code: int, allow_partial: bool = True):
    """A deterministic layout for a rank-`ndim` tensor from an integer: each mesh axis shards some dim,
    stays replicated, or (once) holds a pending reduction. Returns (entries, partial axis, reduce op)."""
    names = mesh.alias_name
    entries = [[] for _ in range(ndim)]
    partial = None
    op = "sum"
    for k, name in enumerate(names):
        choice = (code >> (4 * k)) % 6
        if ndim and choice < 3:
            entries[choice % ndim].append(name)
        elif choice == 5 and allow_partial and partial is None:
            partial = name
            op = REDUCED[(code >> 12) % 3]
    spec = tuple(e[0] if len(e) == 1 else tuple(e) if e else "None" for e in entries)
    return spec, partial, op


def _terms(x: torch.Tensor, parts: int, index: int, op: str, seed: int) -> torch.Tensor:
    """This rank's term of a pending `op` that reduces to x. Terms of a sum are large next to x (as in
    31.1 + -30.0): an op that treats each term as the value (a cast, a nonlinearity) shows. Not larger: a
    product of two pending sums multiplies the terms, and with terms of 300 its fp32 sum of 9e4-sized cross terms
    is only good to their ulp (1/128), past the comparison's 1e-3 (a 50,000-case run found it twice on 4 ranks)."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 if op == "max" else 30.0
    noise = [scale * torch.rand(x.shape, generator=g, dtype=torch.float64).to(x.dtype) for _ in range(parts)]
    if op == "max":  # rank 0 holds x, the others something smaller
        return x.clone() if index == 0 else x - 1 - noise[index]
    if op == "avg":
        mean = sum(noise) / parts
        return x + noise[index] - mean
    others = sum(noise[1:]) if parts > 1 else torch.zeros_like(x)
    return x - others if index == 0 else noise[index]


def make_input(x: torch.Tensor, mesh: hp.Layout, code: int, plain: bool, grad: bool, seed: int,
               allow_partial: bool = True):
    """(the DTensor or plain tensor the chain sees, the leaf whose .grad is checked or None)."""
    if plain:
        leaf = x.clone().requires_grad_(grad)
        return leaf, leaf
    spec, partial, op = layout_for(mesh, x.ndim, code, allow_partial)
    lay = mesh(*spec)
    if partial is None:
        d = hp.distribute_tensor(x, lay, src_data_rank=None)
        if grad:
            d.requires_grad_()
        return d, d
    axis = mesh.alias_name.index(partial)
    term = _terms(x, mesh.mesh_shape[axis], lay.mesh.coordinate[axis], op, seed)
    local = hp.distribute_tensor(term, lay, src_data_rank=None).to_local().clone()
    return DTensor.from_local(local, lay.with_partial(partial, op), shape=tuple(x.shape)), None


# ---- the chain --------------------------------------------------------------------------------
class CastAtAnEdge(ValueError):
    """The reference's value sits within rounding of an integer where a chain truncates it to an integer type."""


def _refuse_cast_at_an_edge(t: torch.Tensor) -> None:
    """A truncation to an integer is discontinuous: a value within float rounding of a whole number truncates
    either way depending on the order a sum was taken in (a pending sum over ranks vs one device's), so no
    order-independent answer exists. Such a case is not well posed single-device code: it is skipped (counted as
    skip), not judged, so the comparison stays exact everywhere else."""
    if not torch.is_floating_point(t) or t.numel() == 0:
        return
    d = t.detach().double()
    if ((d - d.round()).abs() < 1e-4 * d.abs().clamp(min=1.0)).any():
        raise CastAtAnEdge("a value within rounding of a whole number is truncated")


class Run:
    """One side of a case (plain or distributed): applies steps, making aux tensors as it goes."""

    def __init__(self, mesh, dist: bool, seed: int, grad: bool):
        self.mesh, self.dist, self.grad = mesh, dist, grad
        self.gen = torch.Generator().manual_seed(seed)
        self.leaves = []  # (name, leaf) whose .grad to compare

    def aux(self, shape, code: int, name: str, partial_ok: bool = True):
        x = torch.randn(shape, generator=self.gen)
        plain = code % 5 == 4
        if not self.dist:
            leaf = x.clone().requires_grad_(self.grad)
            self.leaves.append((name, leaf))
            return leaf
        t, leaf = make_input(x, self.mesh, code, plain, self.grad, code, partial_ok)
        self.leaves.append((name, leaf))
        return t

    def step(self, t, op: str, p: int, k: int):
        nd = t.ndim
        dim = p % nd if nd else 0
        if op in ("add_aux", "sub_aux"):
            shape = list(t.shape)
            if nd and p % 3 == 0:
                shape[dim] = 1  # broadcast
            other = self.aux(tuple(shape), p, f"aux{k}")
            return t + other if op == "add_aux" else other - t
        if op == "mul_scalar":
            return t * (0.5 + p % 3)
        if op in ("tanh", "exp", "relu", "neg"):
            return {"tanh": torch.tanh, "exp": lambda v: (v * 0.3).exp(), "relu": torch.relu,
                    "neg": torch.neg}[op](t)
        if op == "matmul":
            if nd == 0:
                return t * 2
            w = self.aux((t.shape[-1], 1 + p % 6), p >> 3, f"w{k}")
            return t @ w
        if op == "reshape_merge":
            return t.reshape(-1, *t.shape[2:]) if nd >= 2 else t.reshape(-1)
        if op == "flatten":
            return t.flatten()
        if op == "unsqueeze":
            return t.unsqueeze(p % (nd + 1))
        if op == "expand_as":  # a replicated or split (n, 1) leaf takes t's shape; t only lends it
            if nd == 0:
                return t
            shape = (1,) * (nd - 1) + (t.shape[-1],) if p % 2 else tuple(t.shape[:-1]) + (1,)
            y = self.aux(shape, p >> 1, f"donee{k}", partial_ok=False)
            return y.expand_as(t) * t
        if op in ("view_as", "reshape_as"):
            y = self.aux((t.numel(),), p, f"donee{k}", partial_ok=False)
            return (y.view_as(t) if op == "view_as" else y.reshape_as(t)) + t
        if op in ("sum_dim", "mean_dim", "amax_dim"):
            if nd == 0:
                return t
            keep = bool(p & 8)
            return {"sum_dim": torch.sum, "mean_dim": torch.mean, "amax_dim": torch.amax}[op](t, dim, keepdim=keep)
        if op == "sum_all":
            return t.sum()
        if op == "mean_all":
            return t.mean()
        if op == "softmax":
            return t.softmax(dim) if nd else t
        if op == "half_float":  # casts both as .to(dtype) and as the dtype's method
            return ((t * 7.3).to(torch.float16) if p % 2 else (t * 7.3).half()).float()
        if op == "bf16_float":
            return ((t * 7.3).to(torch.bfloat16) if p % 2 else (t * 7.3).bfloat16()).float()
        if op == "double_float":
            return (t.to(torch.float64) if p % 2 else t.double()).float()
        if op in ("long_float", "int_float") and not self.dist:
            _refuse_cast_at_an_edge(t * 3 + 0.37)
        if op == "long_float":
            # + 0.37: values that normalisation makes whole numbers (rms_norm of one element is +-1) would round
            # either way by reduction order, a truncation of float noise rather than a difference
            return ((t * 3 + 0.37).to(torch.int64) if p % 2 else (t * 3 + 0.37).long()).float()
        if op == "int_float":
            return ((t * 3 + 0.37).to(torch.int32) if p % 2 else (t * 3 + 0.37).int()).to(torch.float32)
        if op == "bool_float":
            return (t.to(torch.bool) if p % 2 else t.bool()).float()
        if op == "transpose":
            return t.transpose(dim, (dim + 1) % nd) if nd >= 2 else t
        if op == "slice0":
            if nd == 0:
                return t
            n = t.shape[0]
            start, stop, stride = (p % (n + 1)) - (n if p & 16 else 0), (p >> 2) % (n + 1), 1 + (p >> 5) % 3
            return t[start:stop:stride] if len(range(n)[start:stop:stride]) else t
        if op == "select0":
            return t[p % t.shape[0]] if nd and t.shape[0] else t
        if op == "setitem":
            if nd == 0 or not t.shape[0]:
                return t
            n = t.shape[0]
            t = t * 1
            sl = slice(p % n, None, 1 + (p >> 3) % 2)
            v = self.aux(tuple(t[sl].shape), p >> 4, f"v{k}", partial_ok=False)
            t[sl] = v
            return t
        if nd == 0:  # the ops below need a dim
            return t
        if op == "cat_aux":
            shape = list(t.shape)
            shape[dim] = 1 + p % 3
            return torch.cat([t, self.aux(tuple(shape), p >> 2, f"cat{k}")], dim)
        if op == "where_aux":
            return torch.where(t > 0, t, self.aux(tuple(t.shape), p, f"where{k}"))
        if op == "max_values":
            return t.max(dim).values
        if op == "cumsum":
            return t.cumsum(dim)
        if op == "layer_norm":  # with a weight: the plain output sums to 0 per row, so a later sum would be noise
            n = t.shape[-1]
            return torch.nn.functional.layer_norm(t, (n,), weight=torch.linspace(0.5, 1.5, n))
        if op == "clamp":
            return t.clamp(-0.5, 0.7)
        if op == "pow2":
            return t.pow(2)
        if op == "argmax_float":
            return t.argmax(dim).float()
        if op == "masked_fill":
            return t.masked_fill(t > 0.3, -1.0)
        if op == "rms_norm":
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
        if op == "gather":
            idx = torch.randint(0, t.shape[dim], t.shape, generator=self.gen) if t.shape[dim] else None
            return t if idx is None else torch.gather(t, dim, idx)
        if op == "index_select":
            if not t.shape[dim]:
                return t
            return t.index_select(dim, torch.randint(0, t.shape[dim], (1 + p % 4,), generator=self.gen))
        if op == "div_aux":
            return t / (self.aux(tuple(t.shape[dim:]), p, f"div{k}").abs() + 1)
        if op == "getitem_list":
            return t[[i % t.shape[0] for i in range(1 + p % 3)]] if t.shape[0] else t
        return self.newer(t, op, p, k, dim)

    def newer(self, t, op: str, p: int, k: int, dim: int):
        """The ops issue 30 added to the chains (index writes, strided views, complex rotary, data-dependent
        shapes, non-finite factors of pending sums, losses with ignored targets)."""
        n = t.shape[dim]
        if op in ("index_copy", "index_add"):
            if not n:
                return t
            idx = torch.randperm(n, generator=self.gen)[:1 + p % n]
            shape = list(t.shape)
            shape[dim] = len(idx)
            src = self.aux(tuple(shape), p >> 2, f"src{k}", partial_ok=False)
            return (t.index_copy(dim, idx, src) if op == "index_copy" else t.index_add(dim, idx, src, alpha=0.5))
        if op == "as_strided":
            # offsets count from the tensor's own storage_offset(), as a program that reads its own elements does
            # (a bare offset into a view reads its base's storage on one device: not a DTensor's, ops/strided.py)
            size, c = (max(t.numel() // 2, 1),), t.contiguous()
            return c.as_strided(size, (1,), c.storage_offset() + p % max(t.numel() - size[0] + 1, 1)) if t.numel() else t
        if op == "complex_rotary":  # the rotary of Llama-style models done in complex numbers
            if t.shape[-1] % 2:
                return t
            angles = torch.linspace(0, 3, t.shape[-1] // 2)
            rot = torch.polar(torch.ones_like(angles), angles)
            c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(c * rot).flatten(-2)
        if op == "roll":
            return t.roll(1 + p % 3, dim)
        if op == "flip":
            return t.flip(dim)
        if op == "unfold":
            size = 1 + p % 2
            return t.unfold(dim, size, 1).sum(-1) if n >= size else t
        if op == "where_nonzero":
            return torch.where(t > 0.3)[0].float()   # not 0: sums (layer_norm, cumsum) that are 0 sit on its edge
        if op == "one_hot":
            return torch.nn.functional.one_hot((t.abs() * 2).long().clamp(max=3), 4).float().sum(-1) * t
        if op == "bincount":
            return torch.bincount((t.abs() * 2).long().flatten().clamp(max=5), minlength=6).float()
        if op == "einsum":
            w = self.aux((t.shape[-1], 2), p, f"ein{k}")
            return torch.einsum("...i,ij->...j", t, w)
        if op == "softmax_dtype":
            return t.softmax(dim, dtype=torch.float64).float()
        if op == "setitem_mask":
            t = t * 1
            t[t > 0.5] = -0.25
            return t
        if op == "norm_dim":
            return (t * (t > 0.8)).norm(dim=dim, keepdim=bool(p & 8))   # rows of zeros are common
        if op == "linalg_norm":
            return torch.linalg.norm(t, dim=dim) if p % 2 else torch.linalg.vector_norm(t * 0, dim=dim)
        if op == "inf_factor":  # a factor holding infinities: one device's +-inf, never nan from a pending sum
            f = torch.where(torch.arange(t.shape[-1]) % 2 == 0, float("-inf"), 1.5)
            # the product's own gradient would be 0 * inf = nan on one device too: values only, plus a finite path
            return (t.detach() * f).clamp(-5, 5).nan_to_num(0.0) + 0.1 * t
        if op == "cross_entropy":  # (mean) with ignored targets, every target ignored when p % 3 == 0
            if t.ndim < 2:
                return t
            x = t.reshape(-1, t.shape[-1])
            target = torch.randint(0, t.shape[-1], (x.shape[0],), generator=self.gen) if t.shape[-1] else None
            if target is None:
                return t
            target[torch.arange(x.shape[0]) % (1 if p % 3 == 0 else 2) == 0] = -100
            return torch.nn.functional.cross_entropy(x, target).nan_to_num(-7.0) * t
        raise ValueError(op)


def _close(a: torch.Tensor, b: torch.Tensor, lowp: bool) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = 2e-2 if lowp else 1e-3
    return torch.allclose(a.double(), b.double(), atol=tol, rtol=tol, equal_nan=True)


def run_case(case) -> str:
    """"ok", "loud: <error>" or "wrong: <what>" for one case on this rank."""
    mesh_key, shape, code, plain, steps, backward, seed = case
    mesh_shape, names = MESHES[mesh_key]
    mesh = hp.Layout(mesh_shape, names)
    lowp = any(op in ("half_float", "bf16_float", "long_float", "int_float", "bool_float") for op, _ in steps)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    ref_run = Run(mesh, False, seed + 1, backward)
    ref_x = x.clone().requires_grad_(backward)
    ref_run.leaves.append(("x", ref_x))
    ref = ref_x
    try:
        for k, (op, p) in enumerate(steps):
            ref = ref_run.step(ref, op, p, k)
    except Exception:  # the chain is not valid single-device code (e.g. a shape that cannot broadcast)
        return "skip"
    dist_run = Run(mesh, True, seed + 1, backward)
    try:
        t, leaf = make_input(x, mesh, code, plain, backward, seed)
        dist_run.leaves.append(("x", leaf))
        for k, (op, p) in enumerate(steps):
            t = dist_run.step(t, op, p, k)
        if not isinstance(t, DTensor) and plain:  # the chain wrote DTensors into the plain input, or never met one
            t = DTensor.from_local(t, mesh(*["None"] * t.ndim))
        bad = global_mismatch(t, ref, lambda a, b: _close(a, b, lowp))
        if bad:
            return f"wrong: result {bad}"
        if backward and ref.requires_grad:
            w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 2))
            (ref * w).sum().backward()
            if not t.requires_grad:  # every leaf was a pending reduction: nothing to compare
                return "ok"
            (t * w).sum().backward()
            for (name, rl), (_, dl) in zip(ref_run.leaves, dist_run.leaves):
                if dl is None or rl.grad is None:
                    continue
                if dl.grad is None:
                    return f"wrong: {name} got no gradient"
                got = dl.grad.full_tensor() if isinstance(dl.grad, DTensor) else dl.grad
                if isinstance(dl, DTensor) and dl.grad.dist_layout is not dl.dist_layout:
                    return f"wrong: {name}.grad layout {dl.grad.dist_layout}, not {dl.dist_layout}"
                if not _close(got, rl.grad, lowp):
                    return f"wrong: {name}.grad {got.flatten()[:4].tolist()} vs {rl.grad.flatten()[:4].tolist()}"
    except Exception as e:
        if isinstance(e, (AssertionError, AttributeError, IndexError, KeyError, TypeError)) \
                and not isinstance(e, hp.MissingOpError):
            return f"wrong: raised {type(e).__name__}: {e} {traceback.format_exc()[-600:]}"
        if isinstance(e, hp.CollectiveError):  # a peer never came: ranks took different paths
            return f"hang: {type(e).__name__}: {str(e)[:200]}"
        return f"loud: {type(e).__name__}: {str(e)[:200]}"
    return "ok"


def run_cases(rank, world, cases) -> list:
    """Every case on this rank (a harness job): one result string per case."""
    return [run_case(c) for c in cases]


def describe(case) -> str:
    mesh_key, shape, code, plain, steps, backward, seed = case
    mesh_shape, names = MESHES[mesh_key]
    lay = "plain" if plain else layout_for(_FakeMesh(names), len(shape), code)
    return f"mesh {mesh_key} x{shape} {lay} steps {steps} backward={backward} seed={seed}"


class _FakeMesh:
    """Enough of a Layout for layout_for() in the test process (no process group there)."""

    def __init__(self, names):
        self.alias_name = names


def judge(cases, per_rank: list) -> list:
    """Failures: a wrong value on some rank, a hang (a collective that timed out: some rank took another path),
    or an error raised on some ranks only or of different types on different ranks."""
    failures = []
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank]
        verdict = classify(results)
        if verdict == "wrong":
            failures.append(f"{describe(case)}: {next(r for r in results if r.startswith('wrong'))}")
        elif verdict == "hang":
            failures.append(f"{describe(case)}: a hang or an error on some ranks only: {results}")
    return failures


def classify(results: list) -> str:
    """One case's verdict from every rank's result: "correct", "clear error" (the same error type on every
    rank), "skip" (not valid single-device code), "wrong" or "hang"."""
    if any(r.startswith("wrong") for r in results):
        return "wrong"
    kinds = {r.split(":")[0] for r in results}
    if "hang" in kinds or len(kinds) > 1:
        return "hang"
    kind = kinds.pop()
    if kind == "loud":
        return "clear error" if len({r.split(":")[1] for r in results}) == 1 else "hang"
    return {"ok": "correct"}.get(kind, kind)


def verdicts(cases, per_rank: list) -> dict:
    """How many cases got each verdict (classify) over every rank's results."""
    counts: dict = {}
    for i in range(len(cases)):
        v = classify([r[i] for r in per_rank])
        counts[v] = counts.get(v, 0) + 1
    return counts


def tally(results: list) -> dict:
    """How many cases ended ok / loud / skip / wrong (one rank's results)."""
    counts: dict = {}
    for r in results:
        kind = r.split(":")[0]
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# ---- random inputs of the parallelism entry points ------------------------------------------------------------
# A feed case: (kind "cp" | "ep" | "pp", rows, seq, mask delta or None, label delta or None, positions
# "none" | "row" | "batch" | "wrong", which rank differs or -1, how it differs "rows" | "seq" | "labels").
FEED_KINDS = ("cp", "ep", "pp")
_MODELS: dict = {}


def _feed_model(kind: str, world: int):
    """(parallel runner, plain reference model) per kind, built once per worker process."""
    if (kind, world) not in _MODELS:
        from tests.test_engine import _four_layers, tiny
        import copy
        base = _four_layers() if kind == "pp" and world > 2 else tiny("qwen3_moe" if kind == "ep" else "llama")
        ref = copy.deepcopy(base)
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(kind,))
        if kind == "cp":
            runner = hp.context_parallel(base, mesh, "cp", "ring")
        elif kind == "ep":
            runner = hp.expert_parallel(base, mesh, "ep")
        else:
            runner = hp.pipeline(base, mesh, n_microbatches=2)
        _MODELS[(kind, world)] = (runner, ref)
    return _MODELS[(kind, world)]


def _feed_inputs(case, rank: int):
    """This rank's inputs (a dict with input_ids and labels) for a feed case; seeded by the rank only where the
    case says the ranks' batches differ (ep's shares always do)."""
    kind, rows, seq, mask_delta, label_delta, positions, odd_rank, odd_how = case
    odd = rank == odd_rank
    if odd and odd_how == "rows":
        rows += 1
    if odd and odd_how == "seq":
        seq += 2
    g = torch.Generator().manual_seed(100 + (rank if kind == "ep" else 0))
    ids = torch.randint(0, 64, (rows, seq), generator=g)
    inputs = {"input_ids": ids, "labels": ids.clone()}
    if label_delta is not None or (odd and odd_how == "labels"):
        inputs["labels"] = torch.randint(0, 64, (rows, max(seq + (label_delta or -1), 1)), generator=g)
        inputs["labels"][:, :1] = -100
    if mask_delta is not None:
        mask = torch.ones(rows, max(seq + mask_delta, 1), dtype=torch.long)
        mask[0, :1] = 0 if rows > 1 else 1
        inputs["attention_mask"] = mask
    if positions != "none":
        n = seq + (3 if positions == "wrong" else 0)
        pos = torch.arange(n).unsqueeze(0)
        inputs["position_ids"] = pos if positions == "row" else pos.expand(rows, -1)
    return inputs


def run_feed_case(case) -> str:
    """"ok" (the loss equals one device's on the global batch), "loud: <error>", "hang: ..." or "wrong: ..."."""
    kind = case[0]
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    runner, ref_model = _feed_model(kind, world)
    mine = _feed_inputs(case, rank)
    shares = [_feed_inputs(case, r) for r in range(world)] if kind == "ep" else [mine]
    try:   # one device on the global batch (ep: the shares concatenated; cp, pp: the batch every rank feeds)
        glob = {k: torch.cat([s[k] for s in shares]) for k in mine}
        if "position_ids" in mine and mine["position_ids"].shape[0] == 1 < mine["input_ids"].shape[0]:
            glob["position_ids"] = mine["position_ids"]   # (1, seq): broadcast over every row, not one per share
        with torch.no_grad():
            want = ref_model(**glob).loss.item()
    except Exception:  # noqa: BLE001 - not valid single-device input
        want = None
    try:
        if kind == "pp":
            got = runner.step(**mine).item()
            for p in runner.parameters():
                p.grad = None
        else:
            with torch.no_grad():
                loss = runner(**mine).loss
            got = (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()
    except Exception as e:  # noqa: BLE001
        if isinstance(e, hp.CollectiveError):
            return f"hang: {str(e)[:200]}"
        return f"loud: {type(e).__name__}: {str(e)[:200]}"
    if want is None:
        return "wrong: ran where one device raises"
    if not (abs(got - want) <= 1e-4 * max(1.0, abs(want)) or (got != got and want != want)):
        return f"wrong: loss {got} vs one device {want}"
    return "ok"


def run_feed_cases(rank, world, cases) -> list:
    return [run_feed_case(c) for c in cases]
