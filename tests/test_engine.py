"""One engine (API §12): every parallelism on one mesh, each rank fed per the data convention, against one plain
process training on the global batch; wrong feeds raise the same error on every rank; hsdp and pipeline traffic
is counted and checked like every collective; hsdp leaves unused parameters without a gradient."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hyper_parallel as hp
from tests import harness

VOCAB, SEQ, ROWS_PER_SHARE, STEPS = 64, 8, 2, 2
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(kind: str):
    """Tiny Llama or Qwen3-MoE, identical in every process; untied (pipeline stages hold the ends apart)."""
    import transformers as T
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=0.0)
    if kind == "llama":
        config, cls = T.LlamaConfig(**common), T.LlamaForCausalLM
    else:
        config = T.Qwen3MoeConfig(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  norm_topk_prob=True, **common)
        cls = T.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return cls._from_config(config, attn_implementation="sdpa").float().train()


def global_batch(shares: int):
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (ROWS_PER_SHARE * shares, SEQ), generator=g)


def _full(t):
    return t.full_tensor() if isinstance(t, hp.DTensor) else t


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def reference(kind: str, ids: torch.Tensor):
    """One plain process on the global batch: losses, first-step gradients, parameters after STEPS steps."""
    model = tiny(kind)
    opt = _optimizer(model.parameters())
    losses, grads = [], None
    for step in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_on_mesh(rank, world, kind, names, shape, level):
    """Worker: the same training on a mesh with `names` (any subset and order of dp, tp, ep, cp, pp), each rank
    fed its share (API §12); every mismatch against the reference, as text."""
    mesh = hp.init_device_mesh("cpu", shape, mesh_dim_names=names)
    shares = hp.data_world(mesh)
    ids = global_batch(shares)
    mine = ids.chunk(shares)[hp.data_rank(mesh)]
    want_losses, want_grads, want_params = reference(kind, ids)
    kwargs = {}
    if "cp" in names:
        kwargs["cp"] = "ring"
    if "dp" in names:
        kwargs["hsdp"] = {"optimizer_level": level, "threshold": 0}
    model = tiny(kind)
    if "pp" in names:
        runner = hp.pipeline(model, mesh, schedule="1f1b", n_microbatches=2, **kwargs)
        params = dict(runner.named_parameters())

        def step():
            return runner.step(mine, labels=mine)
    else:
        runner = hp.parallelize(model, mesh, **kwargs)
        params = dict(runner.named_parameters())

        def step():
            loss = runner(input_ids=mine, labels=mine).loss
            loss.backward()
            # each data-parallel replica's loss is the mean over its share: the global loss is their mean
            loss = _full(loss).detach().clone()
            if "dp" in names and mesh.size("dp") > 1:
                torch.distributed.all_reduce(loss, group=mesh.get_group("dp"))
                loss /= mesh.size("dp")
            return loss
    opt = _optimizer(params.values())
    problems = []
    for i in range(STEPS):
        loss = float(_full(step()).detach())
        if not math.isclose(loss, want_losses[i], rel_tol=1e-5, abs_tol=1e-5):
            problems.append(f"step {i}: loss {loss} vs {want_losses[i]}")
        if i == 0:
            for n, p in params.items():
                want = want_grads.get(n)
                got = None if p.grad is None else _full(p.grad)
                if want is None or got is None:
                    if (want is None) != (got is None):
                        problems.append(f"grad {n}: {'missing' if got is None else 'unexpected'}")
                elif not torch.allclose(got, want, **TOL):
                    problems.append(f"grad {n}: differs by {(got - want).abs().max():.2e}")
        opt.step()
        opt.zero_grad()
    for n, p in params.items():
        got = _full(p.detach())
        if not torch.allclose(got, want_params[n], **TOL):
            problems.append(f"param {n}: differs by {(got - want_params[n]).abs().max():.2e}")
    return problems


def _check(pool, kind, names, shape, level="level3"):
    problems = [f"rank {r}: {p}" for r, found in enumerate(pool.run(train_on_mesh, kind, names, shape, level))
                for p in found]
    assert not problems, f"{kind} on {dict(zip(names, shape))}:\n" + "\n".join(problems[:20])


# ---- examples the issue names, then random meshes -------------------------------------------------------
@pytest.mark.parametrize("names", [("dp", "ep"), ("ep", "dp")])
def test_dp_ep_hsdp_trains_as_one_device_each_rank_its_share(dist4, names):
    """The finding of issue 24: on a (dp, ep) mesh with each rank feeding its own micro-batch, expert parallel
    sliced every rank's batch again and trained silently wrong."""
    _check(dist4, "qwen3_moe", names, (2, 2))


@pytest.mark.parametrize("kind,names", [("qwen3_moe", ("pp", "ep")), ("llama", ("pp", "cp")),
                                        ("qwen3_moe", ("cp", "pp")), ("llama", ("pp", "tp"))])
def test_pipeline_composes_with_every_axis(dist4, kind, names):
    _check(dist4, kind, names, (2, 2))


def test_eight_ranks_pipeline_experts_tensor_parallel():
    """("pp", "ep", "tp") on 8 processes: every model parallelism of a stage at once."""
    _check(harness.pool(8), "qwen3_moe", ("pp", "ep", "tp"), (2, 2, 2))


AXES = ("dp", "tp", "ep", "cp", "pp")


@st.composite
def meshes(draw):
    """A random subset and order of the axes, sizes 1-2, at most 8 ranks, at least 2."""
    kind = draw(st.sampled_from(["llama", "qwen3_moe"]))
    names = tuple(draw(st.permutations(AXES))[:draw(st.integers(1, 4))])
    shape = tuple(draw(st.sampled_from([1, 2])) for _ in names)
    if math.prod(shape) < 2:
        shape = (2,) + shape[1:]
    while math.prod(shape) > 8:
        shape = tuple(1 if i == shape.index(2) else s for i, s in enumerate(shape))
    level = draw(st.sampled_from(["level1", "level2", "level3"]))
    return kind, names, shape, level


@settings(max_examples=int(os.environ.get("HP_ENGINE_EXAMPLES", "10")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(meshes())
def test_random_meshes_train_as_one_device(case):
    """A random subset and order of dp, tp, ep, cp, pp (sizes 1-2, up to 8 ranks), tiny Llama or Qwen3-MoE, each
    rank fed its share: loss, gradients and parameters after two AdamW steps equal one plain process.
    HP_ENGINE_EXAMPLES=N runs more cases (scripts/property_long.sh)."""
    kind, names, shape, level = case
    if os.environ.get("HP_ENGINE_VERBOSE"):
        print("case", case, flush=True)
    _check(harness.pool(math.prod(shape)), kind, names, shape, level)


# ---- wrong feeds: the same clear error on every rank, before anything else communicates ---------------------
def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return f"{type(e).__name__}: {e}"
    return None


def feed_wrongly(rank, world, case):
    """Worker: a model fed against the data convention; returns what this rank raised (None: nothing)."""
    if case == "tp ranks differ":
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = hp.parallelize(tiny("llama"), mesh, tp="auto", hsdp={"threshold": 0})
        ids = global_batch(4)[rank * 2:rank * 2 + 2]       # every rank its own rows: tp ranks differ
        return _error_of(lambda: model(input_ids=ids, labels=ids))
    if case == "cp ranks differ":
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        model = hp.parallelize(tiny("llama"), mesh, cp="ring", hsdp={"threshold": 0})
        ids = global_batch(4)[rank * 2:rank * 2 + 2]
        return _error_of(lambda: model(input_ids=ids, labels=ids))
    if case == "one dp rank's sequence does not split":
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        model = hp.parallelize(tiny("llama"), mesh, cp="ring", hsdp={"threshold": 0})
        dp_rank = mesh.get_local_rank("dp")
        ids = global_batch(2)[dp_rank * 2:dp_rank * 2 + 2, :SEQ - 2 * dp_rank]   # dp rank 1: 6 tokens, not 4k
        return _error_of(lambda: model(input_ids=ids, labels=ids))
    if case == "cp mask longer than the sequence":
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        model = hp.context_parallel(tiny("llama"), mesh, "cp", "ring")
        ids = global_batch(1)
        mask = torch.ones(ids.shape[0], SEQ + 4, dtype=torch.long)
        return _error_of(lambda: model(input_ids=ids, attention_mask=mask, labels=ids))
    if case == "cp mask shorter than the sequence":
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        model = hp.context_parallel(tiny("llama"), mesh, "cp", "ring")
        ids = global_batch(1)
        mask = torch.ones(ids.shape[0], SEQ - 2, dtype=torch.long)
        return _error_of(lambda: model(input_ids=ids, attention_mask=mask, labels=ids))
    if case == "ep labels of another length":
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        model = hp.expert_parallel(tiny("qwen3_moe"), mesh, "ep")
        ids = global_batch(4)[:2]
        return _error_of(lambda: model(input_ids=ids, labels=ids[:, :-1]))
    if case in ("pipeline attention_mask of another length", "pipeline position_ids of another length"):
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pipe = hp.pipeline(tiny("llama"), mesh, n_microbatches=2)
        share = global_batch(2).chunk(2)[hp.data_rank(mesh)]
        extra = ({"attention_mask": torch.ones(share.shape[0], SEQ + 3, dtype=torch.long)} if "mask" in case
                 else {"position_ids": torch.arange(SEQ + 2).expand(share.shape[0], -1)})
        return _error_of(lambda: pipe.step(share, labels=share, **extra))
    if case == "pipeline ranks feed different batch shapes in check mode":
        hp.set_check(True)
        try:
            mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
            pipe = hp.pipeline(_four_layers(), mesh, n_microbatches=2)
            ids = global_batch(2 if rank == 3 else 1)
            return _error_of(lambda: pipe.step(ids, labels=ids))
        finally:
            hp.set_check(False)
    if case == "ep shares of different lengths":
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        model = hp.expert_parallel(tiny("qwen3_moe"), mesh, "ep")
        ids = global_batch(4)[:2 + (rank == 3)]
        return _error_of(lambda: model(input_ids=ids, labels=ids))
    if case == "pipeline labels of another length on one rank":
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pipe = hp.pipeline(tiny("llama"), mesh, n_microbatches=2)
        share = global_batch(2).chunk(2)[hp.data_rank(mesh)]
        labels = share if rank != 3 else share[:, :-1]
        return _error_of(lambda: pipe.step(share, labels=labels))
    if case == "pipeline ranks run different calls":
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
        pipe = hp.pipeline(_four_layers(), mesh, n_microbatches=2)
        ids = global_batch(1)
        return _error_of(lambda: pipe.step(ids, labels=ids) if rank else pipe.eval_forward(ids))
    raise ValueError(case)


def _four_layers():
    model = tiny("llama")
    import transformers as T
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = 4
    torch.manual_seed(0)
    return T.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").float()


WRONG_FEEDS = {
    "tp ranks differ": "fed different micro-batches",
    "cp ranks differ": "fed different micro-batches",
    "one dp rank's sequence does not split": r"sequence length 6 must be a multiple of 2 x 'cp' size = 4",
    "cp mask longer than the sequence": r"attention_mask of shape \(2, 12\) does not match",
    "cp mask shorter than the sequence": r"attention_mask of shape \(2, 6\) does not match",
    "ep shares of different lengths": "shares of different shapes over 'ep'",
    "ep labels of another length": r"expert_parallel: labels of shape \(2, 7\) does not match",
    "pipeline attention_mask of another length": r"attention_mask of shape \(2, 11\) does not match",
    "pipeline position_ids of another length": r"position_ids of shape \(2, 10\) do not match",
    "pipeline ranks feed different batch shapes in check mode": "fed different micro-batches",
    "pipeline labels of another length on one rank": r"labels of shape \(2, 7\) do not match input_ids",
    "pipeline ranks run different calls": "different calls",
}


@pytest.mark.parametrize("case", list(WRONG_FEEDS))
def test_wrong_feed_raises_the_same_error_on_every_rank(dist4, case):
    import re
    errors = dist4.run(feed_wrongly, case, timeout=180)
    assert all(e is not None for e in errors), errors
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("FeedError") and re.search(WRONG_FEEDS[case], errors[0]), errors[0]


# ---- hsdp and pipeline traffic: counted, and checked ---------------------------------------------------------
def count_hsdp_step(rank, world, level):
    """Worker: comm_counter around an hsdp step sees exactly the gathers and reductions hsdp issues."""
    model = hp.hsdp(tiny("llama"), optimizer_level=level, threshold=0)
    state = model._hsdp_state
    ids = global_batch(world).chunk(world)[rank]
    with hp.comm_counter() as c:
        model(input_ids=ids, labels=ids).loss.backward()
    sharded = [p for p in state.params if p.sharded]
    padded = {p: p.parts * p.step * p.row * p.buffer.element_size() for p in sharded}
    root = [p for u in state.units if u.is_root for p in u.params if p.sharded]
    want = {}
    if level == "level3":  # a gather before each unit's forward, again before its backward (the root: once)
        want["all_gather"] = (2 * len(sharded) - len(root), sum(2 * b // world for b in padded.values())
                              - sum(padded[p] // world for p in root))
        want["reduce_scatter"] = (len(sharded), sum(padded.values()))
    else:
        want["all_reduce" if level == "level1" else "reduce_scatter"] = (
            len(sharded), sum(p.rows * p.row * p.buffer.element_size() for p in sharded) if level == "level1"
            else sum(padded.values()))
    got = {k: (c.counts[k], c.bytes[k]) for k in c.counts}
    return got == want or f"{level}: counted {got}, hsdp issued {want}"


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_comm_counter_sees_every_hsdp_collective(dist2, level):
    results = dist2.run(count_hsdp_step, level)
    assert results == [True, True], results


def count_pipeline_step(rank, world):
    """Worker: the stage sends of a pp=2 1f1b step, the loss broadcast and the feed check, exactly."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipe = hp.pipeline(tiny("llama"), mesh, n_microbatches=2)
    ids = global_batch(1)
    with hp.comm_counter() as c:
        pipe.step(ids, labels=ids)
    micro_batch = ids.shape[0] // 2
    activation = micro_batch * SEQ * pipe.model.config.hidden_size * 4
    want = {"send": (2, 2 * activation), "broadcast": (1, 4), "feed_check": (1, 5 * 8)}
    got = {k: (c.counts[k], c.bytes[k]) for k in c.counts}
    return got == want or f"rank {rank}: counted {got}, expected {want}"


def test_comm_counter_sees_pipeline_sends(dist2):
    """Rank 0 sends two micro-batches' activations forward, rank 1 their gradients back."""
    assert dist2.run(count_pipeline_step) == [True, True]


def diverging_micro_batches(rank, world):
    """Worker: check mode on; ranks accumulate different numbers of micro-batches under hsdp level3."""
    hp.set_check(True)
    try:
        model = hp.hsdp(tiny("llama"), optimizer_level="level3", threshold=0, enable_grad_accumulation=True)
        ids = global_batch(world).chunk(world)[rank]
        n = 2 + rank          # rank 0: two micro-batches, rank 1: three
        for i in range(n):
            model.set_requires_grad_sync(i == n - 1)
            model(input_ids=ids, labels=ids).loss.backward()
        return None
    except hp.CheckError as e:
        return "CheckError"
    finally:
        hp.set_check(False)


def test_check_mode_catches_ranks_running_different_numbers_of_micro_batches(dist2):
    assert dist2.run(diverging_micro_batches, timeout=120) == ["CheckError", "CheckError"]


# ---- hsdp: a parameter no rank used keeps grad None -------------------------------------------------------------
def unused_parameters(rank, world, level):
    """Worker: a module that never runs and a parameter of a decoder layer that the loss never reaches keep
    `grad is None` under hsdp, as on one device; every other gradient equals one device's."""
    def build():
        model = tiny("llama")
        model.side = torch.nn.Linear(32, 32)                          # a whole unit never called
        model.model.layers[0].unused = torch.nn.Parameter(torch.ones(4, 32))  # in a unit that does run
        return model
    ref = build()
    ids = global_batch(world)
    ref(input_ids=ids, labels=ids).loss.backward()
    model = hp.hsdp(build(), optimizer_level=level, threshold=0)
    mine = ids.chunk(world)[rank]
    model(input_ids=mine, labels=mine).loss.backward()
    problems = []
    for (n, p), r in zip(model.named_parameters(), ref.parameters()):
        if r.grad is None:
            if p.grad is not None:
                problems.append(f"{n}: has a gradient, one device has none")
        elif p.grad is None or not torch.allclose(_full(p.grad), r.grad, **TOL):
            problems.append(f"{n}: gradient differs from one device's")
    return problems


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_hsdp_leaves_unused_parameters_without_gradient(dist2, level):
    problems = [p for found in dist2.run(unused_parameters, level) for p in found]
    assert not problems, problems


# ---- a peer dies: the survivors' hsdp and pipeline collectives raise CollectiveError naming what they ran ------
def survive_a_dead_peer(rank, world, what):
    import os
    if what == "hsdp":
        model = hp.hsdp(tiny("llama"), optimizer_level="level3", threshold=0)
        run = lambda: model(input_ids=global_batch(1), labels=global_batch(1)).loss.backward()  # noqa: E731
    else:
        pipe = hp.pipeline(tiny("llama"), hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)), n_microbatches=2)
        # one good step first: the stage probe (a broadcast, once per input shape) is behind both ranks, so the
        # next step goes straight into torch's schedule and rank 0 waits in its send/recv when rank 1 dies
        pipe.step(global_batch(1), labels=global_batch(1))
        if rank == 1:  # dies in its stage's forward: rank 0 is inside the schedule
            pipe.stages[0].forward = lambda *a, **k: os._exit(1)
        run = lambda: pipe.step(global_batch(1), labels=global_batch(1))  # noqa: E731
    if rank == 1 and what == "hsdp":
        os._exit(1)   # as kill -9: no goodbye to the peers
    try:
        run()
        return "no error"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("what,names", [("hsdp", "all_gather"), ("pipeline", "pipeline send/recv")])
def test_survivors_of_a_dead_peer_raise_collective_error(monkeypatch, what, names):
    monkeypatch.setenv("HP_COMM_TIMEOUT", "5")
    pool = harness.Pool(2)
    try:
        for inbox in pool.inboxes:   # rank 1 dies without an answer: read rank 0's alone
            inbox.put((survive_a_dead_peer.__module__, survive_a_dead_peer.__name__, (what,)))
        rank, ok, message = pool.outbox.get(timeout=60)
    finally:
        pool.close(force=True)
    assert rank == 0 and ok and message.startswith("CollectiveError") and names in message, message


# ---- from_pretrained on a mesh with "pp": the Pipeline, each rank reading only its stages ---------------------
def pipeline_from_folder(rank, world, path):
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pipe = hp.from_pretrained(path, mesh, tp="auto", n_microbatches=2)
    assert isinstance(pipe, hp.Pipeline), type(pipe)
    ids = global_batch(1)
    losses = [pipe.step(ids, labels=ids).item()]
    names = sorted(n for n, _ in pipe.named_parameters())
    return losses, names


def test_from_pretrained_on_a_pp_mesh_returns_the_pipeline(dist4, tmp_path):
    model = tiny("llama")
    model.save_pretrained(tmp_path / "tiny")
    ids = global_batch(1)
    want = model(input_ids=ids, labels=ids).loss.item()
    results = dist4.run(pipeline_from_folder, str(tmp_path / "tiny"))
    every = {n for n, _ in model.named_parameters()}
    held = [set(names) for _, names in results]
    for (losses, _), names in zip(results, held):
        assert losses[0] == pytest.approx(want, abs=1e-5)
        assert names < every   # only its stages' parameters (the layers of the other stage are not built)
    assert held[0] | held[2] == every and not held[0] & held[2]   # pp coordinate 0 (ranks 0, 1) and 1 (2, 3)
