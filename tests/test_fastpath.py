"""The replicated fast path (Python and its C twin) and the autograd shortcut, each against plain torch.

Every test that runs ops takes the `path` fixture, so it runs once with the C accelerator installed as
DTensor.__torch_function__ and once with the pure-Python dispatcher.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.dispatch import count_calls, dispatcher
from hyper_parallel.dtensor import autograd as autograd_bridge
from hyper_parallel.dtensor.dtensor import DTensor
import hyper_parallel.dispatch as dispatch_pkg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L = hp.Layout((1,), ("tp",))


def rep(t: torch.Tensor) -> DTensor:
    return hp.DTensor.from_local(t, L(*["None"] * t.ndim))


def test_the_c_accelerator_is_built_and_installed():
    """scripts/setup.sh builds it; without it every call would take the slower Python twin, silently."""
    from hyper_parallel.dispatch import _fastpath
    assert dispatch_pkg._fastpath is _fastpath
    assert DTensor.__torch_function__ is _fastpath.torch_function


@pytest.fixture(params=["c", "python"])
def path(request):
    if request.param == "c":
        assert dispatch_pkg._fastpath is not None, "the C accelerator was not built (run scripts/setup.sh)"
        impl = dispatch_pkg._fastpath.torch_function
    else:
        impl = dispatcher.torch_function
    saved = DTensor.__dict__["__torch_function__"]
    DTensor.__torch_function__ = staticmethod(impl)
    autograd_bridge.use_c_nodes(dispatch_pkg._fastpath if request.param == "c" else None)  # the nodes' twins too
    dispatcher.clear_caches()
    yield request.param
    DTensor.__torch_function__ = saved
    autograd_bridge.use_c_nodes(dispatch_pkg._fastpath)
    dispatcher.clear_caches()


def _both(fn, *plain):
    """fn on plain tensors and on replicated DTensors; the DTensor results' full values and shapes."""
    want = fn(*plain)
    got = fn(*[rep(t) for t in plain])
    return want, got


@pytest.mark.parametrize("grad_mode", [False, True])
def test_replicated_ops_match_plain(path, grad_mode):
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    cases = {
        "add": lambda a, b: a + b,
        "method with scalar": lambda a, b: a.mul(2.5).sub(b),
        "view": lambda a, b: a.view(6, 4),
        "getitem with tuple": lambda a, b: a[:, 1:, None, ::2],
        "cat of a list": lambda a, b: torch.cat([a, b], dim=-1),
        "stack of a tuple": lambda a, b: torch.stack((a, b)),
        "tuple output": lambda a, b: a.max(dim=-1),
        "kwargs without tensors": lambda a, b: a.mean(-1, keepdim=True),
        "tensor in kwargs": lambda a, b: torch.where(a > 0, a, other=b),
        "functional": lambda a, b: F.silu(a) * F.softmax(b, dim=-1),
        "plain tensor mixed in": lambda a, b: a * y,
    }
    with torch.set_grad_enabled(grad_mode):
        for name, fn in cases.items():
            want, got = _both(fn, x, y)
            if isinstance(want, torch.Tensor):
                want, got = (want,), (got,)
            else:
                assert type(got) is type(want), name
            for w, g in zip(want, got):
                assert type(g) is DTensor and g.shape == w.shape, name
                assert g.dist_layout.is_replicate, name
                assert torch.equal(g.full_tensor(), w), name


def test_an_op_returning_its_input_returns_the_same_dtensor(path):
    x = rep(torch.randn(3, 4))
    for grad_mode in (False, True):
        with torch.set_grad_enabled(grad_mode):
            assert x.to(x.dtype) is x and x.contiguous() is x


def test_in_place_ops_without_grad(path):
    """The optimizer's case: in-place updates of parameters that require grad, in no_grad."""
    p0, g0 = torch.randn(5), torch.randn(5)
    p = torch.nn.Parameter(rep(p0.clone()))
    ref = p0.clone()
    with torch.no_grad():
        assert p.mul_(0.9) is p
        p.add_(rep(g0), alpha=-0.1)
        p.addcmul_(rep(g0), rep(g0), value=0.5)
        ref.mul_(0.9).add_(g0, alpha=-0.1).addcmul_(g0, g0, value=0.5)
    assert torch.equal(p.full_tensor(), ref) and p.requires_grad and p.is_leaf


def test_mixed_meshes_are_refused(path):
    other = hp.Layout((1,), ("dp",))
    a = rep(torch.randn(3))
    b = hp.DTensor.from_local(torch.randn(3), other("None"))
    with torch.no_grad(), pytest.raises(ValueError, match="different meshes"):
        a + b


def test_count_calls(path):
    a, b = rep(torch.randn(3)), rep(torch.randn(3))
    with torch.no_grad(), count_calls() as counts:
        (a + b).mul(2).sum()
    assert counts["replicated"] == 3 and counts["hits"] == 0 and counts["misses"] == 0
    with torch.no_grad():  # and the fast path is back afterwards
        a + b
    assert torch.Tensor.add in dispatcher._FAST or torch.Tensor.__add__ in dispatcher._FAST


def test_view_made_without_grad_then_written_with_grad_is_refused_as_in_torch(path):
    x = rep(torch.zeros(4))
    with torch.no_grad():
        v = x[:2]
    y = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad mode"):
        v.copy_(rep(y) * 1)


def test_write_through_a_view_gives_the_base_history(path):
    y0 = torch.randn(2, 3)
    yp = y0.clone().requires_grad_()
    base = torch.zeros(2, 5)
    base[:, 1:4].copy_(yp * 2)
    (base * base).sum().backward()

    y = rep(y0.clone()).requires_grad_()
    k = rep(torch.zeros(2, 5))
    k[:, 1:4].copy_(y * 2)
    (k * k).sum().backward()
    assert torch.allclose(k.full_tensor(), base.detach())
    assert torch.allclose(y.grad.full_tensor(), yp.grad)


# ---- autograd on activations: hooks, retain_grad, autograd.grad, backward(inputs=) ---------------
def _net(x, w1, w2):
    h = torch.tanh(x @ w1)
    return h, (h @ w2).pow(2).sum()


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g), torch.randn(5, 2, generator=g)


def _leaves(dist: bool):
    x, w1, w2 = _params()
    if dist:
        return rep(x), torch.nn.Parameter(rep(w1)), torch.nn.Parameter(rep(w2))
    return x, torch.nn.Parameter(w1), torch.nn.Parameter(w2)


def test_a_hook_on_an_activation_sees_and_changes_the_whole_gradient(path):
    results = []
    for dist in (False, True):
        x, w1, w2 = _leaves(dist)
        h = torch.tanh(x @ w1)
        seen = []
        h.register_hook(lambda g: (seen.append(g), g * 3)[1])
        ((h @ w2).pow(2).sum() + h.sum()).backward()  # two consumers of h, both after the hook
        results.append((seen, w1.grad, w2.grad))
    (ref_seen, ref_g1, ref_g2), (seen, g1, g2) = results
    assert len(seen) == 1 and type(seen[0]) is DTensor
    assert torch.allclose(seen[0].full_tensor(), ref_seen[0])
    assert torch.allclose(g1.full_tensor(), ref_g1) and torch.allclose(g2.full_tensor(), ref_g2)


def test_retain_grad_on_an_activation(path):
    grads = []
    for dist in (False, True):
        x, w1, w2 = _leaves(dist)
        h, loss = _net(x, w1, w2)
        h.retain_grad()
        loss.backward(retain_graph=True)
        loss.backward()  # accumulates, as torch does
        grads.append(h.grad)
    assert type(grads[1]) is DTensor and torch.allclose(grads[1].full_tensor(), grads[0])


def test_autograd_grad_of_activations_and_parameters(path):
    res = []
    for dist in (False, True):
        x, w1, w2 = _leaves(dist)
        h, loss = _net(x, w1, w2)
        res.append(torch.autograd.grad(loss, [h, w1]))
    for want, got in zip(*res):
        assert type(got) is DTensor and torch.allclose(got.full_tensor(), want)


def test_backward_with_inputs_an_activation(path):
    res = []
    for dist in (False, True):
        x, w1, w2 = _leaves(dist)
        h, loss = _net(x, w1, w2)
        loss.backward(inputs=[h, w2])
        res.append((h.grad, w2.grad, w1.grad))
    (rh, r2, r1), (gh, g2, g1) = res
    assert r1 is None and g1 is None
    assert torch.allclose(gh.full_tensor(), rh) and torch.allclose(g2.full_tensor(), r2)


def test_a_plain_tensor_that_requires_grad_mixed_into_replicated_ops(path):
    x0, w0 = torch.randn(3, 4), torch.randn(4)
    w_ref = w0.clone().requires_grad_()
    (torch.tanh(x0 * w_ref)).sum().backward()
    w = w0.clone().requires_grad_()
    (torch.tanh(rep(x0) * w)).sum().backward()
    assert type(w.grad) is torch.Tensor and torch.allclose(w.grad, w_ref.grad)


def test_dtensors_in_kwargs_with_grad(path):
    """F.layer_norm(x, shape, weight=w, bias=b): parameters that require grad passed by keyword."""
    x0, w0, b0 = torch.randn(3, 4), torch.randn(4), torch.randn(4)
    res = []
    for dist in (False, True):
        wrap = rep if dist else (lambda t: t)
        w, b = torch.nn.Parameter(wrap(w0.clone())), torch.nn.Parameter(wrap(b0.clone()))
        out = F.layer_norm(wrap(x0), (4,), weight=w, bias=b)
        out.pow(2).sum().backward()
        res.append((out, w.grad, b.grad))
        with torch.no_grad():
            res.append((F.layer_norm(wrap(x0), (4,), weight=w, bias=b),))
    for want, got in zip(res[:2], res[2:]):
        for w, g in zip(want, got):
            assert type(g) is DTensor and torch.allclose(g.full_tensor(), w.detach(), atol=1e-6)


def test_to_local_without_grad_has_no_history(path):
    x, w1, _ = _leaves(True)
    h = x @ w1
    with torch.no_grad():
        assert not h.to_local().requires_grad
    assert h.to_local().requires_grad


# ---- whole models ----------------------------------------------------------------------------------
def test_every_model_replicated_unrecorded_equals_plain():
    """The requirement's single-card scenario as a user runs it (no census recording): C path, fast paths."""
    from hyper_parallel.tools.census import run_census
    report = run_census("all", "all", max_new_tokens=3, record=False)
    bad = [f"{r.model}/{r.mode}: {r.error.splitlines()[-1] if r.error else r.detail}" for r in report.runs
           if not r.ok]
    assert len(report.runs) == 24 and not bad, bad


def test_pure_python_dispatcher_equals_plain_on_models():
    """HYPER_PARALLEL_PURE_PYTHON=1 (no C accelerator): the same models, the same results."""
    code = (
        "import hyper_parallel.dispatch as d; assert d._fastpath is None\n"
        "from hyper_parallel.tools.census import run_census\n"
        "r = run_census(['llama', 'qwen3_moe', 'qwen3_vl', 't5'], 'all', max_new_tokens=3, record=False)\n"
        "bad = [(x.model, x.mode, x.error or x.detail) for x in r.runs if not x.ok]\n"
        "assert len(r.runs) == 8 and not bad, bad\n"
        "print('ok')\n")
    env = dict(os.environ, HYPER_PARALLEL_PURE_PYTHON="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


# ---- the grad-mode twin, the wrapper-metadata passthrough and the decision path's cache hit (issue 19) -----------
def split(t: torch.Tensor) -> DTensor:
    """Split over dim 0 on the 1-rank axis: not replicated, so every call takes the decision path."""
    return hp.DTensor.from_local(t, L("tp", *["None"] * (t.ndim - 1)))


@pytest.fixture
def python_fallbacks(monkeypatch):
    """The calls that reached the Python dispatcher (through the C twin's hand-offs) while the test ran."""
    seen = []
    for name in ("_after_no_grad_path", "_dispatch"):
        orig = getattr(dispatcher, name)

        def spy(func, *rest, _orig=orig, _name=name):
            seen.append((_name, getattr(func, "__name__", func)))
            return _orig(func, *rest)
        monkeypatch.setattr(dispatcher, name, spy)
    return seen


def test_the_c_twins_cover_grad_mode_metadata_and_decision_hits(python_fallbacks):
    """Replicated ops in grad mode with parameters, the optimizer's metadata reads, and split-layout cache hits
    (grad mode and no_grad) never reach the Python dispatcher once warm: the C twins answer them."""
    w = torch.nn.Parameter(rep(torch.randn(4, 4)))
    x, s = rep(torch.randn(3, 4)), split(torch.randn(4, 4))
    ops = [lambda: (x @ w).relu().sum(), lambda: (s + s).view(16), lambda: w.grad, lambda: torch.is_complex(w)]
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            for op in ops:
                op()  # warm: resolves the rule, fills the decision cache
    python_fallbacks.clear()
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            for op in ops:
                op()
    assert python_fallbacks == []


@pytest.mark.parametrize("foreach", [False, True])
def test_adamw_over_dtensor_parameters_equals_plain(path, foreach):
    """AdamW's per-tensor loop and its foreach path (what CUDA picks for DTensor parameters, as for plain ones)."""
    from torch.optim.optimizer import _foreach_supported_types
    assert DTensor in _foreach_supported_types
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(4, 6, generator=g), torch.randn(6, generator=g)]
    grads = [torch.randn(4, 6, generator=g), torch.randn(6, generator=g)]
    results = []
    for make in (lambda t: t, rep, split):
        params = [torch.nn.Parameter(make(v.clone())) for v in values]
        opt = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, foreach=foreach)
        for _ in range(3):
            for p, gr in zip(params, grads):
                p.grad = make(gr.clone())
            opt.step()
        results.append([p.full_tensor() if type(p) is DTensor else p.detach() for p in params])
    for got in results[1:]:
        for w, v in zip(results[0], got):
            assert torch.allclose(v, w, atol=1e-6)


def _split_cases():
    return {
        "add": lambda a, b: a + b,
        "view": lambda a, b: a.view(-1),
        "mul by a scalar": lambda a, b: a * 0.5,
        "transpose then matmul": lambda a, b: a @ b.transpose(0, 1),
        "sum of dim 1": lambda a, b: (a * b).sum(1),
        "reshape": lambda a, b: a.reshape(2, 2, 6),
        "max with indices": lambda a, b: a.max(dim=1),
    }


@pytest.mark.parametrize("grad_mode", [False, True])
def test_split_ops_match_plain(path, grad_mode):
    """The decision path (C twin and Python) on split inputs: values, layouts and, in grad mode, gradients."""
    torch.manual_seed(1)
    x0, y0 = torch.randn(4, 6), torch.randn(4, 6)
    for name, fn in _split_cases().items():
        for _ in range(2):  # the second call is a cache hit
            xp, yp = x0.clone().requires_grad_(grad_mode), y0.clone().requires_grad_(grad_mode)
            x, y = torch.nn.Parameter(split(x0.clone()), grad_mode), torch.nn.Parameter(split(y0.clone()), grad_mode)
            with torch.set_grad_enabled(grad_mode):
                want, got = fn(xp, yp), fn(x, y)
            want, got = (want, got) if not isinstance(want, torch.Tensor) else ((want,), (got,))
            for w, g in zip(want, got):
                assert type(g) is DTensor and g.shape == w.shape, name
                assert torch.equal(g.full_tensor(), w), name
            if grad_mode and want[0].is_floating_point():
                want[0].sum().backward()
                got[0].sum().backward()
                for p, q in ((xp, x), (yp, y)):
                    assert (p.grad is None) == (q.grad is None), name
                    if p.grad is not None:
                        assert type(q.grad) is DTensor and q.grad.dist_layout is q.dist_layout, name
                        assert torch.equal(q.grad.full_tensor(), p.grad), name


def _chain(seed: int, ops: list, layouts: list, backend):
    """A chain of ops on two parameters laid out as `layouts`, its loss backpropagated: values and gradients."""
    g = torch.Generator().manual_seed(seed)
    a0, b0 = torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)
    make = {"plain": lambda t: t, "rep": rep, "split": split}
    a = torch.nn.Parameter(make[backend if backend == "plain" else layouts[0]](a0))
    b = torch.nn.Parameter(make[backend if backend == "plain" else layouts[1]](b0))
    h = a
    for op in ops:
        h = {"add": lambda h: h + b, "mul": lambda h: h * b, "tanh": torch.tanh, "scale": lambda h: h * 0.5,
             "matmul": lambda h: h @ b, "t": lambda h: h.t().contiguous(), "view": lambda h: h.view(16).view(4, 4),
             "sub_const": lambda h: h - 1.0, "silu": F.silu,
             # a layout change: Unwrap redistributes, and the gradient comes back through Wrap in another layout
             "resplit": lambda h: h.redistribute(L("tp", "None")) if type(h) is DTensor else h,
             "regather": lambda h: h.redistribute(L("None", "None")) if type(h) is DTensor else h}[op](h)
    loss = h.pow(2).sum() + (b * b).sum()
    loss.backward()
    full = (lambda t: t.full_tensor()) if backend != "plain" else (lambda t: t.detach())
    return [full(h), full(a.grad), full(b.grad)]


try:
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover - hypothesis is in requirements-dev.txt
    given = None

if given is not None:
    _OPS = st.lists(st.sampled_from(["add", "mul", "tanh", "scale", "matmul", "t", "view", "sub_const", "silu",
                                     "resplit", "regather"]),
                    min_size=1, max_size=6)
    _LAYOUTS = st.lists(st.sampled_from(["rep", "split"]), min_size=2, max_size=2)

    @settings(max_examples=20, deadline=None)
    @given(ops=_OPS, layouts=_LAYOUTS, seed=st.integers(0, 1000))
    def test_random_chains_equal_through_the_c_twins_and_python(ops, layouts, seed):
        """Property: any chain of ops on replicated and split parameters, with layout changes and backward, gives
        the same values and gradients through the C twins (dispatch and the autograd nodes Wrap / Unwrap) as through
        the Python dispatcher and nodes (exactly), and as plain torch."""
        want = _chain(seed, ops, layouts, "plain")
        got = {}
        saved = DTensor.__dict__["__torch_function__"]
        try:
            for name, impl, nodes in (("c", dispatch_pkg._fastpath.torch_function, dispatch_pkg._fastpath),
                                      ("python", dispatcher.torch_function, None)):
                DTensor.__torch_function__ = staticmethod(impl)
                autograd_bridge.use_c_nodes(nodes)
                got[name] = _chain(seed, ops, layouts, name)
        finally:
            DTensor.__torch_function__ = saved
            autograd_bridge.use_c_nodes(dispatch_pkg._fastpath)
        for c, p, w in zip(got["c"], got["python"], want):
            assert torch.equal(c, p)
            assert torch.allclose(c, w, atol=1e-5)


def test_the_autograd_nodes_run_in_c():
    """A warm training step on replicated parameters (Unwrap per parameter use, Wrap per op output, their backward)
    runs no Python function of the autograd bridge: the C nodes answer every common case."""
    assert autograd_bridge.Wrap.forward is dispatch_pkg._fastpath.wrap_forward
    w1, w2 = torch.nn.Parameter(rep(torch.randn(4, 4))), torch.nn.Parameter(rep(torch.randn(4, 2)))
    x = rep(torch.randn(3, 4))

    def step():
        w1.grad = w2.grad = None
        (torch.tanh(x @ w1) @ w2).pow(2).sum().backward()
    step()
    seen = []
    bridge_file = autograd_bridge.__file__

    def spy(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == bridge_file and \
                frame.f_code.co_name not in ("backward", "_run_engine"):  # the loss's own Tensor.backward routing
            seen.append(frame.f_code.co_name)
    sys.setprofile(spy)
    try:
        step()
    finally:
        sys.setprofile(None)
    assert seen == [] and type(w1.grad) is DTensor and type(w2.grad) is DTensor


def test_the_engines_detach_and_alias_of_a_dtensor(path):
    """What AccumulateGrad runs on every gradient it stores (below __torch_function__): the same wrapper around the
    detached local, through __torch_dispatch__'s C twin and through engine_ops; other engine ops still answered."""
    w = torch.nn.Parameter(split(torch.randn(4, 3)))
    with torch._C.DisableTorchFunctionSubclass():
        for op in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            d = op(w)
            assert type(d) is DTensor and d._layout is w._layout and d.shape == w.shape
            assert d._local.data_ptr() == w._local.data_ptr() and not d._local.requires_grad
            assert d.requires_grad == (op is torch.ops.aten.alias.default)  # alias is differentiable, as in torch
        z = torch.ops.aten.zeros_like.default(w)
        assert type(z) is DTensor and z._layout is w._layout and not z._local.any()


def test_metadata_passthrough_with_kwargs_none(path):
    """__torch_function__(func, types, args, None), as check mode's wrapper calls it: the wrapper's own value."""
    w = torch.nn.Parameter(rep(torch.randn(3)))
    w.grad = rep(torch.ones(3))
    got = DTensor.__torch_function__(torch.Tensor.grad.__get__, (DTensor,), (w,), None)
    assert got is w.grad and DTensor.__torch_function__(torch.is_complex, (DTensor,), (w,), None) is False
