"""Rules of ops/misc.py and the pointwise ops appended to elementwise.yaml, on split and partial inputs
(2 gloo ranks, and a 2x2 mesh on 4), against plain tensors."""
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import hyper_parallel as hp
from tests.op_check import run_cases, specs_for


def _mla_keys(t):
    """DeepSeek-V3's `expand_kv`: an empty tensor of the source's leading sizes, its parts copied in."""
    keys = t.new_empty(*t.shape[:-1], 8)
    keys[..., :5].copy_(t * 2)
    keys[..., 5:].copy_(t[..., :3].exp())
    return keys


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    x = r(4, 6, 5)
    img = r(4, 3, 6, 6)
    w = r(4, 3, 3, 3)
    b = r(4)
    no_partial = lambda nd: (lambda mesh: specs_for(mesh, nd, partial=False))
    return [
        ("compare and logic", lambda t: ((t > 0) & (t < 1)) | ~(t >= -0.5), [x], None, False),
        ("eq ne", lambda t: (t.round() == 0) ^ (t.round() != 1), [x], None, False),
        # the first operand smaller than the broadcast result (a dunder's name ends in "_" like an in-place op's)
        ("broadcast dunders", lambda a, c: (a * c + a - c, (a > 0) & (c > 0), a == c.round()),
         [r(4, 6, 1), r(4, 1, 5)], None, True),
        ("floordiv mod", lambda t: (t * 4).floor() // 3 + (t * 4).floor() % 3, [x], None, False),
        ("cos sin clamp", lambda t: t.cos() * t.sin() + t.clamp(-0.5, 0.5) + t.clamp_min(0), [x], None, True),
        ("asinh acosh atanh", lambda t: torch.asinh(t) + torch.acosh(t.abs() + 1) + torch.atanh(t.tanh() * 0.5),
         [x], None, False),
        ("casts", lambda t: (t * 3).long().float() + (t > 0).int().float(), [x], None, True),
        ("new_zeros / new_full", lambda t: (t.new_zeros(2, 3), t.new_full((3,), 2.0), t.new_ones(2)), [x], None, False),
        # sizes kept from the source keep its split (MLA's keys: new_empty, then the parts copied in), with grads
        ("new_* of the source's sizes, parts copied in",
         lambda t: (_mla_keys(t), t.new_zeros(t.shape) + t, t.new_full((4, 6, 2), 2.0) * t[..., :2],
                    t.new_ones(size=(4, 3, 5)), t.new_empty(4, 6, 5).fill_(1.5)), [x], None, True),
        ("Tensor.new", lambda t: (t.new(2, 3).zero_(), t.new([1.0, 2.0])), [x], None, False),
        ("diff searchsorted broadcast_tensors", lambda t: (torch.diff(t, dim=1), t.diff(dim=-1),
                                                          torch.searchsorted(torch.linspace(-2, 2, 9), t.contiguous()),
                                                          torch.broadcast_tensors(t, t[:1])), [x], None, False),
        ("embedding_bag", lambda table: F.embedding_bag(torch.arange(12).view(4, 3) % 7, table, mode="mean"),
         [r(7, 5)], None, True),
        ("full_like", lambda t: torch.full_like(t, 3.0) + t, [x], None, True),
        ("empty_like shape", lambda t: torch.empty_like(t).zero_() + t, [x], None, True),
        ("pad", lambda t: F.pad(t, (1, 2)), [x], None, True),
        ("pad 2 dims", lambda t: F.pad(t, (1, 1, 0, 2), value=1.0), [x], None, True),
        ("interpolate", lambda t: F.interpolate(t, scale_factor=2.0, mode="nearest"), [x], None, True),
        ("triu", lambda t: torch.triu(t, 1) + t.tril(), [x], None, True),
        ("histc", lambda t: torch.histc(t, bins=4, min=-1, max=1), [x], [no_partial(3)], False),
        ("conv2d", lambda t, wt, bs: F.conv2d(t, wt, bs, padding=1),
         [img, w, b], [no_partial(4), lambda m: [(("None",) * 4, None)], lambda m: [(("None",), None)]], True),
        ("conv2d weight split", lambda t, wt, bs: F.conv2d(t, wt, bs),
         [img, w, b], [lambda m: [(("None",) * 4, None)], no_partial(4), no_partial(1)], True),
        ("masked_scatter", lambda t: t.masked_scatter(t > 0, torch.arange(120.0).view(4, 6, 5)), [x], None, True),
        ("dropout eval", lambda t: F.dropout(t, 0.5, training=False), [x], None, True),
        ("bool index int", lambda t: (bool(t > -1e9), int(t * 0 + 2), [0, 1, 2][(t * 0 + 1).long()], float(t * 0)),
         [r(())], None, False),
    ]


def _run(rank, world):
    return run_cases(_cases(), world)


def _random_and_foreach(rank, world):
    failures = []
    mesh = hp.Layout((world,), ("tp",))
    x = torch.randn(6, 4)
    for entries in (("tp", "None"), ("None", "tp"), ("None", "None")):
        dx = hp.distribute_tensor(x, mesh(*entries))
        if not torch.equal(F.dropout(dx, 0.0, training=True).full_tensor(), x):  # p is part of the decision
            failures.append(f"dropout p=0 {entries}")
        torch.manual_seed(5)
        ref = F.dropout(x, 0.3, training=True)
        torch.manual_seed(5)
        out = F.dropout(dx, 0.3, training=True)
        if not torch.equal(out.full_tensor(), ref):
            failures.append(f"dropout {entries}")
        torch.manual_seed(6)
        ref = torch.rand_like(x)
        torch.manual_seed(6)
        out = torch.rand_like(dx)
        if not torch.equal(out.full_tensor(), ref) or out.dist_layout is not dx.dist_layout:
            failures.append(f"rand_like {entries}")
        y = hp.distribute_tensor(torch.zeros(6, 4), mesh(*entries))
        torch.manual_seed(7)
        ref = torch.zeros(6, 4).uniform_()
        torch.manual_seed(7)
        y.uniform_()
        if not torch.equal(y.full_tensor(), ref):
            failures.append(f"uniform_ {entries}")
    # a transposed x (VITS's `randn_like(prior_means)` after `.transpose(1, 2)`): torch fills memory in order, so
    # its values are arranged unlike a contiguous x's, and the split draws must be arranged alike
    xt = torch.randn(4, 6)
    for entries in (("tp", "None"), ("None", "tp")):
        dxt = hp.distribute_tensor(xt, mesh(*entries)).t()
        for name, draw in (("randn_like", torch.randn_like), ("dropout", lambda t: F.dropout(t, 0.3, training=True)),
                           ("normal_", lambda t: (t * 1).normal_())):
            torch.manual_seed(8)
            ref = draw(xt.t())
            torch.manual_seed(8)
            out = draw(dxt)
            if not torch.equal(out.full_tensor(), ref):
                failures.append(f"{name} of a transposed x {entries}")
    # the multi-tensor AdamW path on parameters split over tp: states keep the parameters' layouts
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 6)
    model = torch.nn.Linear(4, 6)
    model.load_state_dict(ref.state_dict())
    model.weight = torch.nn.Parameter(hp.distribute_tensor(ref.weight.detach(), mesh("tp", "None")))
    model.bias = torch.nn.Parameter(hp.distribute_tensor(ref.bias.detach(), mesh("tp")))
    inp = torch.randn(3, 4)
    for m, i in ((ref, inp), (model, hp.distribute_tensor(inp, mesh("None", "None")))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True)
        for _ in range(2):
            out = m(i)
            (out * out).sum().backward()
            opt.step()
            opt.zero_grad()
    for name in ("weight", "bias"):
        p = getattr(model, name)
        if p.dist_layout is not opt.state[p]["exp_avg"].dist_layout:
            failures.append(f"adamw foreach state layout {name}")
        if not torch.allclose(p.full_tensor(), getattr(ref, name), atol=1e-6):
            failures.append(f"adamw foreach {name}")
    return failures


def test_misc_ops(dist2, dist4):
    for pool in (dist2, dist4):
        failures = [f for per_rank in pool.run(_run) for f in per_rank]
        assert not failures, "\n".join(failures[:10])


def test_random_ops_and_foreach(dist2):
    failures = [f for per_rank in dist2.run(_random_and_foreach) for f in per_rank]
    assert not failures, failures


def _new_factory_cases(rank, world, cases):
    """Worker: each (shape, entries, size, kind) — x laid out by `entries`, then `x.new_<kind>(size)` — has the
    plain op's values, keeps x's split exactly on the dims whose size it keeps, and is whole elsewhere."""
    mesh = hp.Layout((world,), ("tp",))
    failures = []
    for shape, entries, size, kind in cases:
        x = hp.distribute_tensor(torch.arange(float(torch.Size(shape).numel())).view(shape), mesh(*entries))
        make = {"zeros": lambda t: t.new_zeros(size), "ones": lambda t: t.new_ones(*size),
                "full": lambda t: t.new_full(size, 3.5), "empty": lambda t: t.new_empty(size=size).fill_(2.0),
                # the legacy `x.new`: ints or a torch.Size are sizes (Reformer's `idx.new(*idx.size())`), a list data
                "new sizes": lambda t: t.new(*size).fill_(2.0), "new torch.Size": lambda t: t.new(torch.Size(size)).fill_(1.5),
                "new data": lambda t: t.new([float(n) for n in size])}[kind]
        if kind == "new data":   # a tensor of the data, whatever x's layout
            out, ref = make(x), make(x.full_tensor())
            if not torch.equal(out.full_tensor(), ref) or out.dist_layout.alias_entries() != ("None",):
                failures.append(f"{kind} {shape} {entries} -> {size}: {out.dist_layout.alias_entries()}")
            continue
        out, ref = make(x), make(x.full_tensor())
        kept = tuple(e if n == m else "None" for e, n, m in zip(entries, size, shape)) if len(size) == len(shape) \
            else ("None",) * len(size)
        if not torch.equal(out.full_tensor(), ref) or out.dist_layout.alias_entries() != kept:
            failures.append(f"{kind} {shape} {entries} -> {size}: {out.dist_layout.alias_entries()}, want {kept}")
    return failures


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_new_factories_keep_the_split_of_the_sizes_they_keep(dist2, data):
    """Random shapes, layouts and new sizes (each dim kept or changed, sometimes another rank): values as plain
    torch's, the source's split kept exactly where the size is."""
    cases = []
    for _ in range(4):
        shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        split = data.draw(st.integers(-1, len(shape) - 1))
        entries = tuple("tp" if d == split else "None" for d in range(len(shape)))
        if data.draw(st.booleans()):
            size = tuple(n if data.draw(st.booleans()) else data.draw(st.integers(1, 6)) for n in shape)
        else:
            size = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
        cases.append((shape, entries, size, data.draw(st.sampled_from(["zeros", "ones", "full", "empty", "new sizes",
                                                                       "new torch.Size", "new data"]))))
    failures = [f for per_rank in dist2.run(_new_factory_cases, cases) for f in per_rank]
    assert not failures, failures


def _conv_then_dropout_cases(rank, world, cases):
    """Worker: a batch of `world` images split one per rank, made channels-last as a ViT neck makes them (a
    (b, h*w, c) sequence permuted and reshaped), a convolution, then dropout: the same values and the same
    dropped elements as one device (the mask is drawn in the memory order the convolution's output has)."""
    mesh = hp.Layout((world,), ("dp",))
    failures = []
    for channels, side, kernel, channels_last in cases:
        g = torch.Generator().manual_seed(channels * 100 + side)
        seq = torch.randn(world, side * side, channels, generator=g)
        weight = torch.randn(channels + 1, channels, kernel, kernel, generator=g)

        def run(s):
            img = s.permute(0, 2, 1).reshape(world, channels, side, side) if channels_last else \
                s.reshape(world, channels, side, side)
            torch.manual_seed(11)
            return F.dropout(F.conv2d(img, weight, padding=kernel // 2), 0.3, training=True)
        ref = run(seq)
        out = run(hp.distribute_tensor(seq, mesh("dp", "None", "None"))).full_tensor()
        if not torch.equal(out == 0, ref == 0) or not torch.allclose(out, ref, atol=1e-5):
            failures.append(f"conv2d then dropout: {channels} channels, {side}x{side}, kernel {kernel}, "
                            f"channels_last={channels_last}")
    return failures


@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 12), st.integers(2, 6), st.sampled_from([1, 3]), st.booleans()),
                min_size=1, max_size=4))
def test_dropout_after_a_batch_split_convolution_drops_what_one_device_drops(dist2, cases):
    """Random channel counts, image sizes, kernels and memory formats: a rank holding one image of the batch
    runs its convolution in the memory format the whole batch's runs in (a size-1 dim's stride otherwise hides
    channels-last), so dropout's mask lands on the same elements."""
    failures = [f for per_rank in dist2.run(_conv_then_dropout_cases, cases) for f in per_rank]
    assert not failures, failures
