"""nn rules (embedding, attention, norms, losses) against plain tensors, with gradients.

Random shapes and random layouts per input as in tests/test_ops_matmul.py (whose helpers this uses),
plus targeted checks that the intended parallel form is chosen (vocab-parallel embedding and loss,
head-split attention) and that unsupported combinations fail loudly.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel import Layout
from tests.test_ops_matmul import Arg, check_case, dims, make, randn, run_cases

TRIALS = 40


def _ids(rnd, high, *shape, ignore=None):
    t = torch.randint(0, high, tuple(shape))
    if ignore is not None and t.numel():
        t = torch.where(torch.rand(t.shape) < 0.25, torch.full_like(t, ignore), t)
    return t


# ---- cases -----------------------------------------------------------------------------------------
def _embedding(rnd):
    v, h = rnd.randint(1, 9), rnd.randint(1, 6)
    ids = _ids(rnd, v, *dims(rnd, rnd.randint(1, 2), 1, 5))
    pad = rnd.choice([None, None, 0, v - 1, -1])
    by_freq = rnd.random() < 0.1
    return ((lambda i, w: F.embedding(i, w, padding_idx=pad, scale_grad_by_freq=by_freq)),
            [Arg(ids), Arg(randn(v, h))])


def _sdpa(rnd):
    b, hkv, L, S, E, Ev = dims(rnd, 6, 1, 5)
    group = rnd.choice([1, 1, 2])
    causal = rnd.random() < 0.3
    three_d = rnd.random() < 0.2
    lead_q, lead_kv = ((b,), (b,)) if three_d else ((b, hkv * group), (b, hkv))
    args = [Arg(randn(*lead_q, L, E)), Arg(randn(*lead_kv, S, E)), Arg(randn(*lead_kv, S, Ev))]
    kw = {"enable_gqa": group > 1, "is_causal": causal}
    if not causal and rnd.random() < 0.6:
        shape = rnd.choice([(L, S), (1, L, S), lead_q + (L, S), (b, 1, L, S) if not three_d else (b, L, S)])
        if rnd.random() < 0.5:
            mask = torch.rand(shape) > 0.4
            mask[..., 0] = True  # no fully masked row (its softmax is NaN)
        else:
            mask = torch.randn(shape, dtype=torch.float64)
        args.append(Arg(mask, grad=False, partial=False))
        return (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)), args
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)), args


def _norm(rnd):
    lead = dims(rnd, rnd.randint(1, 2), 1, 5)
    norm = dims(rnd, rnd.randint(1, 2), 2, 5)
    x = Arg(randn(*lead, *norm))
    affine = [Arg(randn(*norm)) for _ in range(rnd.randint(0, 2))]
    if rnd.random() < 0.5:
        fn = rnd.choice([
            lambda x, *wb: F.layer_norm(x, norm, *wb, eps=1e-5),
            lambda x, *wb: F.layer_norm(x, tuple(norm), *wb),
        ])
    else:
        affine = affine[:1]
        eps = rnd.choice([None, 1e-6])
        fn = lambda x, *w: F.rms_norm(x, norm, *w, eps=eps)
    return fn, [x] + affine


def _loss(rnd, name):
    n, c = rnd.randint(1, 6), rnd.randint(1, 7)
    extra = dims(rnd, rnd.randint(0, 1), 1, 3)
    shape = rnd.choice([(n, c, *extra), (n, c), (c,)])
    ignore = rnd.choice([-100, 0, 1])
    reduction = rnd.choice(["mean", "mean", "sum", "none"])
    x = randn(*shape)
    if name == "nll_loss":
        x = x.log_softmax(1 if x.ndim > 1 else 0)
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    probs = name == "cross_entropy" and rnd.random() < 0.2
    ignore = -100 if probs else ignore  # torch refuses ignore_index with probability targets
    target = randn(*shape).softmax(1 if len(shape) > 1 else 0) if probs else _ids(rnd, c, *tshape, ignore=ignore)
    args = [Arg(x), Arg(target, grad=False, partial=False)]
    kw = {"reduction": reduction, "ignore_index": ignore}
    if name == "cross_entropy":
        kw["label_smoothing"] = rnd.choice([0.0, 0.0, 0.1])
    fn = getattr(F, name)
    if rnd.random() < 0.3:
        args.append(Arg(torch.rand(c, dtype=torch.float64) + 0.5, grad=False, partial=False))
        return (lambda x, t, w: fn(x, t, w, **kw)), args
    return (lambda x, t: fn(x, t, **kw)), args


def _channel_norm(rnd):
    """batch_norm (eval: running statistics; training: batch statistics), group_norm, instance_norm on
    (N, C, ...) inputs: the rules split what the statistics allow and gather the rest."""
    n, c = rnd.randint(1, 4), rnd.choice([2, 4])
    spatial = dims(rnd, rnd.randint(1, 2), 1, 4)
    spatial[0] = max(spatial[0], 2)  # more than one value per channel and sample
    x, w, b = Arg(randn(n, c, *spatial)), Arg(randn(c)), Arg(randn(c))
    kind = rnd.choice(["batch_eval", "batch_train", "group", "instance"])
    if kind == "batch_eval":
        mean = Arg(randn(c), grad=False, partial=False)
        var = Arg(torch.rand(c, dtype=torch.float64) + 0.5, grad=False, partial=False)
        return (lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False, eps=1e-5)), [x, mean, var, w, b]
    if kind == "batch_train":
        return (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)), [x, w, b]
    if kind == "group":
        groups = rnd.choice([1, c // 2, c])
        return (lambda x, w, b: F.group_norm(x, groups, w, b, eps=1e-5)), [x, w, b]
    return (lambda x, w, b: F.instance_norm(x, weight=w, bias=b)), [x, w, b]


def _ctc_loss(rnd):
    """CTC over log-probabilities (T, N, C): gathered (each sample's alignment spans its whole sequence)."""
    t, n, c, s = rnd.randint(4, 6), rnd.randint(1, 3), rnd.randint(3, 5), rnd.randint(1, 2)
    log_probs = Arg(randn(t, n, c).log_softmax(-1))
    targets = Arg(torch.randint(1, c, (n, s)), grad=False, partial=False)
    lengths = [Arg(torch.full((n,), v, dtype=torch.long), grad=False, partial=False) for v in (t, s)]
    reduction = rnd.choice(["mean", "sum", "none"])
    return (lambda lp, tg, il, tl: F.ctc_loss(lp, tg, il, tl, reduction=reduction)), [log_probs, targets] + lengths


def _weight_norm(rnd):
    """torch._weight_norm(v, g, dim): weight-normed convolutions of audio encoders (gathered)."""
    v = randn(rnd.randint(2, 4), rnd.randint(1, 3), rnd.randint(1, 3))
    dim = rnd.choice([0, 2])
    g = randn(*[v.shape[d] if d == dim else 1 for d in range(v.ndim)])
    return (lambda v, g: torch._weight_norm(v, g, dim)), [Arg(v), Arg(g)]


def _pointwise_loss(rnd):
    """Losses per element, then the reduction: elementwise for 'none', pending sums for 'sum', gathered for
    'mean'."""
    shape = dims(rnd, rnd.randint(1, 3), 1, 5)
    x, y = randn(*shape), randn(*shape)
    reduction = rnd.choice(["none", "sum", "mean"])
    name = rnd.choice(["mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy_with_logits",
                       "binary_cross_entropy", "kl_div"])
    target = Arg(y.sigmoid() if "binary" in name else y, grad=False, partial=False)
    if name == "binary_cross_entropy":
        return (lambda x, t: F.binary_cross_entropy(x.sigmoid(), t, reduction=reduction)), [Arg(x), target]
    if name == "kl_div":
        return (lambda x, t: F.kl_div(x.log_softmax(-1), t.softmax(-1), reduction=reduction)), [Arg(x), target]
    fn = getattr(F, name)
    return (lambda x, t: fn(x, t, reduction=reduction)), [Arg(x), target]


def _conv_transpose(rnd):
    """conv_transpose1d/2d (audio decoders, segmentation heads): batch split, weights replicated."""
    nd = rnd.choice([1, 2])
    n, cin, cout, k = rnd.randint(1, 4), rnd.randint(1, 3), rnd.randint(1, 3), rnd.randint(1, 3)
    x = Arg(randn(n, cin, *dims(rnd, nd, 2, 4)))
    w, b = Arg(randn(cin, cout, *[k] * nd)), Arg(randn(cout))
    stride = rnd.choice([1, 2])
    fn = F.conv_transpose1d if nd == 1 else F.conv_transpose2d
    return (lambda x, w, b: fn(x, w, b, stride=stride)), [x, w, b]


def _upsample(rnd):
    """The kernels F.interpolate calls, called directly (HunYuan-VL's vision tower): spatial dims whole."""
    x = randn(rnd.randint(1, 3), rnd.randint(1, 3), *dims(rnd, 2, 2, 4))
    size = [rnd.randint(2, 6), rnd.randint(2, 6)]
    corners = rnd.random() < 0.5
    return (lambda x: torch._C._nn.upsample_bilinear2d(x, size, corners)), [Arg(x)]


def _prelu(rnd):
    """prelu with one slope per channel or one for all."""
    x = randn(*dims(rnd, rnd.randint(2, 4), 1, 4))
    w = randn(x.shape[1] if rnd.random() < 0.5 else 1)
    return (lambda x, w: F.prelu(x, w)), [Arg(x), Arg(w)]


def _glu(rnd):
    shape = dims(rnd, rnd.randint(1, 3), 1, 4)
    dim = rnd.randrange(len(shape))
    shape[dim] *= 2
    return (lambda x: F.glu(x, dim)), [Arg(randn(*shape))]


CASES = {"embedding": _embedding, "sdpa": _sdpa, "norm": _norm, "channel_norm": _channel_norm,
         "pointwise_loss": _pointwise_loss, "upsample": _upsample, "prelu": _prelu, "conv_transpose": _conv_transpose, "glu": _glu,
         "ctc_loss": _ctc_loss, "weight_norm": _weight_norm,
         "cross_entropy": lambda rnd: _loss(rnd, "cross_entropy"), "nll_loss": lambda rnd: _loss(rnd, "nll_loss")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_layouts_2ranks(dist2, case):
    assert dist2.run(run_cases, __name__, case, False, TRIALS) == [TRIALS] * 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_random_layouts_2x2(dist4, case):
    assert dist4.run(run_cases, __name__, case, True, TRIALS) == [TRIALS] * 4


# ---- the intended parallel forms --------------------------------------------------------------------
def _no_gather(c) -> bool:
    return not any(k in c.counts for k in ("all_gather", "all_to_all", "reduce_scatter"))


def _parallel_forms(rank, world, two_d):
    rnd = random.Random(0)
    L = Layout((2, 2), ("dp", "tp")) if two_d else Layout((world,), ("tp",))
    tp = "tp"
    P = lambda lay: lay.with_partial(tp)
    # vocab-parallel embedding: Partial output, no communication
    ids, w = torch.randint(0, 11, (3, 5)), randn(11, 4)
    out, c = check_case(L, F.embedding, [Arg(ids), Arg(w)], rnd, "vocab embedding",
                        layouts=[L("None", "None"), L(tp, "None")])
    assert out.dist_layout is P(L("None", "None", "None")) and not c.counts, (out.dist_layout, c.counts)
    # hidden-split embedding: output split on the hidden dim
    out, c = check_case(L, F.embedding, [Arg(ids), Arg(w)], rnd, "hidden embedding",
                        layouts=[L("None", "None"), L("None", tp)])
    assert out.dist_layout is L("None", "None", tp), out.dist_layout
    # head-split attention (with GQA): no communication, output split on heads
    q, k, v = randn(2, 4, 3, 5), randn(2, 2, 6, 5), randn(2, 2, 6, 5)
    lay = L("None", tp, "None", "None")
    out, c = check_case(L, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                        [Arg(q), Arg(k), Arg(v)], rnd, "gqa heads", layouts=[lay, lay, lay])
    assert out.dist_layout is lay and _no_gather(c), (out.dist_layout, c.counts)
    # causal attention with q split on the sequence: must not stay split locally (correctness is checked)
    qs = L("None", "None", tp, "None")
    out, c = check_case(L, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                        [Arg(q), Arg(randn(2, 4, 6, 5)), Arg(randn(2, 4, 6, 5))], rnd, "causal seq",
                        layouts=[qs, L("None", "None", "None", "None"), L("None", "None", "None", "None")])
    # non-causal attention with q split on the sequence keeps the split
    out, c = check_case(L, F.scaled_dot_product_attention, [Arg(q), Arg(randn(2, 4, 6, 5)), Arg(randn(2, 4, 6, 5))],
                        rnd, "seq", layouts=[qs, L("None", "None", "None", "None"), L("None", "None", "None", "None")])
    assert out.dist_layout is qs, out.dist_layout
    # loss parallel: logits split on classes, replicated targets; no gather of the logits
    logits, target = randn(6, 13), torch.randint(0, 13, (6,))
    target[1] = -100
    cw = torch.rand(13, dtype=torch.float64) + 0.5
    for red in ("mean", "sum", "none"):
        for ls in (0.0, 0.2):
            for weighted in (False, True):
                extra = [Arg(cw, grad=False, partial=False)] if weighted else []
                wl = [L("None")] if weighted else []
                fn = lambda x, t, *w: F.cross_entropy(x, t, *w, reduction=red, label_smoothing=ls)
                out, c = check_case(L, fn, [Arg(logits), Arg(target)] + extra, rnd, f"loss parallel {red} {ls}",
                                    layouts=[L("None", tp), L("None")] + wl)
                assert set(c.counts) <= {"all_reduce"} and out.dist_layout.partial == (None,) * L.mesh.ndim, \
                    (c.counts, out.dist_layout)
                fn = lambda x, t, *w: F.nll_loss(x, t, *w, reduction=red)
                out, c = check_case(L, fn, [Arg(logits.log_softmax(-1)), Arg(target)] + extra, rnd,
                                    f"nll vocab {red}", layouts=[L("None", tp), L("None")] + wl)
                assert out.dist_layout.partial[L.alias_name.index(tp)] == "sum" and not c.counts, (out.dist_layout, c)
    # a single sample (1-D logits, 0-d target)
    out, c = check_case(L, F.cross_entropy, [Arg(randn(13)), Arg(torch.tensor(4))], rnd, "1-d loss parallel",
                        layouts=[L(tp), L.with_map(())])
    assert set(c.counts) <= {"all_reduce"}, c.counts
    # GQA heads split over both axes of a 2x2 mesh: 2 kv heads cannot go 4 ways, so the rule must not
    if two_d:
        both = L("None", ("dp", "tp"), "None", "None")
        check_case(L, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                   [Arg(randn(2, 4, 3, 5)), Arg(randn(2, 2, 6, 5)), Arg(randn(2, 2, 6, 5))], rnd, "gqa 2x2",
                   layouts=[both, both, both])
    # batch-split mean with ignored targets: one all_reduce of the count, Partial output
    out, c = check_case(L, F.cross_entropy, [Arg(logits), Arg(target)], rnd, "batch mean",
                        layouts=[L(tp, "None"), L(tp)])
    assert out.dist_layout is P(L.with_map(())) and c.counts == {"all_reduce": 1}, (out.dist_layout, c.counts)
    return True


def test_parallel_forms_2ranks(dist2):
    assert dist2.run(_parallel_forms, False) == [True] * 2


def test_parallel_forms_2x2(dist4):
    assert dist4.run(_parallel_forms, True) == [True] * 4


def _loud_errors(rank, world):
    L = Layout((world,), ("tp",))
    w = make(L("tp", "None"), randn(8, 3))
    try:
        F.embedding(torch.randint(0, 8, (4,)), w, max_norm=1.0)
    except RuntimeError as e:
        assert "torch.nn.functional.embedding" in str(e) and "max_norm" in str(e), e
    else:
        raise AssertionError("embedding with max_norm on a sharded weight did not raise")
    return True


def test_loud_errors(dist2):
    assert dist2.run(_loud_errors) == [True] * 2
