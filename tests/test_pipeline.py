"""Pipeline parallel (hyper_parallel.pipeline) against one plain process training on the global batch."""
from __future__ import annotations

import itertools
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel.parallel.pipeline import cut

VOCAB, BATCH, SEQ, LR, STEPS = 96, 8, 10, 1e-3, 2


def tiny_model(kind: str, layers: int = 4, device: str = "cpu"):
    """A tiny random causal LM, identical in every process (fixed seed); device="meta" builds no data."""
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    deepseek = dict(moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                    first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                    qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
    name, extra = {"llama": ("Llama", {}), "qwen2": ("Qwen2", {}), "qwen3": ("Qwen3", {"head_dim": 8}),
                   "mistral": ("Mistral", {"sliding_window": 4}), "qwen3_moe": ("Qwen3Moe", {"head_dim": 8, **moe}),
                   "deepseek_v3": ("DeepseekV3", deepseek),
                   "qwen3_tied": ("Qwen3", {"head_dim": 8, "tie_word_embeddings": True})}[kind]
    config = getattr(transformers, f"{name}Config")(**{**common, **extra})
    cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config).float()


def batch():
    """Global batch; labels with -100 spread unevenly, so micro-batches hold different token counts."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :7] = -100
    labels[3, 2:] = -100
    labels[5, ::3] = -100
    return ids, labels


def reference(kind: str):
    """One plain process on the global batch: losses per step and every parameter after the steps."""
    model = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids, labels = batch()
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _full(t):
    from hyper_parallel import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_pipelined(rank, world, kind, mesh_shape, names, kwargs):
    """Worker: the same training through pipeline(); losses, own parameters (full), stage layers."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", mesh_shape, names)
    pipe = hp.pipeline(tiny_model(kind), mesh, **kwargs)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    ids, labels = batch()
    share = slice(None)
    if hp.data_world(mesh) > 1:   # API §12: each data-parallel rank feeds its share, pp/tp/cp ranks the same one
        rows = BATCH // hp.data_world(mesh)
        share = slice(hp.data_rank(mesh) * rows, (hp.data_rank(mesh) + 1) * rows)
    losses = []
    for _ in range(STEPS):
        losses.append(pipe.step(ids[share], labels=labels[share]).item())
        opt.step()
        opt.zero_grad()
    params = {k: _full(v).detach().clone() for k, v in pipe.named_parameters()}
    logits = pipe.eval_forward(ids[share])   # logits of this rank's share
    return losses, params, [list(s.layers) for s in pipe.specs], (share, logits)


def check_against_reference(results, kind, pp):
    ref_losses, ref_params = reference(kind)
    seen = {}
    for rank, (losses, params, _, _) in enumerate(results):
        assert losses == pytest.approx(ref_losses, abs=1e-5), (rank, losses, ref_losses)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
            seen.setdefault(name, set()).add(rank)
    assert set(seen) == set(ref_params), sorted(set(ref_params) - set(seen))
    # each pp rank holds only its stages: every parameter lives on world/pp ranks (its dp replicas)
    assert all(len(r) == len(results) // pp for r in seen.values())
    # eval logits: equal the plain model's after the same steps, on every rank
    model = tiny_model(kind)
    model.load_state_dict(ref_params, strict=False)
    with torch.no_grad():
        want = model(input_ids=batch()[0]).logits
    for _, _, _, (share, logits) in results:
        torch.testing.assert_close(logits, want[share], atol=1e-5, rtol=0)


SCHEDULE_CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("interleaved_zb", 2),
                  ("zbv", 2)]


@pytest.mark.parametrize("schedule,spr", SCHEDULE_CASES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_schedules_pp2_match_one_process(dist2, kind, schedule, spr):
    kwargs = dict(schedule=schedule, n_microbatches=4, stages_per_rank=spr)
    results = dist2.run(train_pipelined, kind, (2,), ("pp",), kwargs)
    check_against_reference(results, kind, pp=2)
    layers = [sum(r[2], []) for r in results]
    assert sorted(layers[0] + layers[1]) == [0, 1, 2, 3] and not set(layers[0]) & set(layers[1])


def test_pp2_dp2_hsdp_matches_one_process(dist4):
    kwargs = dict(schedule="1f1b", n_microbatches=2, hsdp={"threshold": 0})
    results = dist4.run(train_pipelined, "llama", (2, 2), ("pp", "dp"), kwargs)
    check_against_reference(results, "llama", pp=2)


def test_pp2_tp2_shard_matches_one_process(dist4):
    kwargs = dict(schedule="interleaved_1f1b", stages_per_rank=2, n_microbatches=2, tp="auto")
    results = dist4.run(train_pipelined, "qwen3", (2, 2), ("pp", "tp"), kwargs)
    check_against_reference(results, "qwen3", pp=2)


def test_pp4_qwen3_moe_1f1b(dist4):
    kwargs = dict(schedule="1f1b", n_microbatches=4)
    results = dist4.run(train_pipelined, "qwen3_moe", (4,), ("pp",), kwargs)
    check_against_reference(results, "qwen3_moe", pp=4)


def save_pipelined(rank, world, path):
    import hyper_parallel as hp
    from hyper_parallel.checkpoint import save
    pipe = hp.pipeline(tiny_model("llama"), hp.init_device_mesh("cpu", (2,), ("pp",)), schedule="1f1b")
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    ids, labels = batch()
    pipe.step(ids, labels=labels)
    opt.step()
    save({"model": pipe.state_dict()}, path)
    hp.save_pretrained(pipe, path + "_hf")  # the whole model as a Hugging Face folder, from both stages
    return {k: v.detach().clone() for k, v in pipe.named_parameters()}


def load_pipelined(rank, world, path):
    """A meta build: each rank materialises only its stages, then loads them from the checkpoint."""
    import hyper_parallel as hp
    from hyper_parallel.checkpoint import load
    pipe = hp.pipeline(tiny_model("llama", device="meta"), hp.init_device_mesh("cpu", (2,), ("pp",)),
                       schedule="1f1b")
    assert not any(t.is_meta for t in pipe.model.state_dict().values())
    load({"model": pipe.state_dict()}, path)
    return {k: v.detach().clone() for k, v in pipe.named_parameters()}, pipe.eval_forward(batch()[0])


def test_save_pp2_load_one_process_and_pp2(dist2):
    """checkpoint.save and save_pretrained on pp=2; a checkpoint.load into one process and a meta-built pp=2,
    and plain transformers from the exported folder: identical parameters."""
    from hyper_parallel.checkpoint import load
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        saved = dist2.run(save_pipelined, path)
        whole = {k: v for part in saved for k, v in part.items()}
        assert not set(saved[0]) & set(saved[1])
        model = tiny_model("llama")
        for p in model.parameters():
            torch.nn.init.zeros_(p)
        state = {"model": model.state_dict()}
        load(state, path)
        got = dict(model.named_parameters())
        assert set(got) == set(whole)
        for name, value in whole.items():
            assert torch.equal(got[name], value), name
        with torch.no_grad():
            want = model(input_ids=batch()[0]).logits
        from transformers import AutoModelForCausalLM
        exported = dict(AutoModelForCausalLM.from_pretrained(path + "_hf").named_parameters())
        assert set(exported) == set(whole)
        for name, value in whole.items():
            assert torch.equal(exported[name], value), name
        for params, logits in dist2.run(load_pipelined, path):
            for name, value in params.items():
                assert torch.equal(value, whole[name]), name
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)


def test_errors_are_clear():
    import transformers
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (1,), ("pp",))
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="GPT2Model has no output head"):
        hp.pipeline(gpt2, mesh)
    with pytest.raises(ValueError, match="unknown schedule"):
        hp.pipeline(tiny_model("llama"), mesh, schedule="nope")
    with pytest.raises(ValueError, match="one stage per rank"):
        hp.pipeline(tiny_model("llama"), mesh, schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="split points"):
        hp.pipeline(tiny_model("llama"), mesh, schedule="interleaved_1f1b", stages_per_rank=2, split_points=[0])


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "deepseek_v3"])
def test_one_stage_equals_plain_model(kind):
    """pp=1 in one process (no torch.distributed): the stage forward is the model's forward, padding
    mask included, for every class the cutter knows."""
    import hyper_parallel as hp
    ids, _ = batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[6, :5] = 0
    with torch.no_grad():
        want = tiny_model(kind)(input_ids=ids, attention_mask=mask).logits
        pipe = hp.pipeline(tiny_model(kind), hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="gpipe")
        got = pipe.stages[0](ids, attention_mask=mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert pipe.model._hp_applied[-1].startswith("pp: 1 stages over 'pp' (gpipe")


# ---- the cutter and balancer: property test ------------------------------------------------------------
def _brute_force_best(weights, n_stages, first, last):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        bounds = (0,) + cuts + (n,)
        cost = max(sum(weights[a:b]) + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)
                   for s, (a, b) in enumerate(zip(bounds, bounds[1:])))
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 5), st.integers(0, 80),
       st.integers(0, 80), st.data())
def test_balance_property(weights, n_stages, first, last, data):
    if n_stages > len(weights):
        with pytest.raises(ValueError, match="at least one layer"):
            cut.balance(weights, n_stages, first, last)
        return
    stages = cut.balance(weights, n_stages, first, last)
    assert [i for r in stages for i in r] == list(range(len(weights)))     # every layer once, in order
    assert all(len(r) >= 1 for r in stages)
    cost = max(sum(weights[i] for i in r) + (first if s == 0 else 0) + (last if s == n_stages - 1 else 0)
               for s, r in enumerate(stages))
    assert cost == _brute_force_best(weights, n_stages, first, last)       # optimal max stage weight
    # split points: stages start exactly there
    starts = sorted(data.draw(st.sets(st.integers(1, max(1, len(weights) - 1)), min_size=n_stages - 1,
                                      max_size=n_stages - 1))) if len(weights) > n_stages - 1 else []
    if len(starts) == n_stages - 1 and (not starts or starts[-1] < len(weights)):
        given_stages = cut.stages_from_split_points(starts, len(weights), n_stages, "model.layers")
        assert [r.start for r in given_stages[1:]] == starts
        assert [i for r in given_stages for i in r] == list(range(len(weights)))


# ---- input embeddings tied to the head, on different stages ------------------------------------------------
TIED = ("model.embed_tokens.weight", "lm_head.weight")


def train_tied(rank, world, mesh_shape, names, kwargs, folder, accumulate):
    """Worker: a tied Qwen3 (tie_word_embeddings=True) trained through pipeline(), built on the meta device
    with a different random start per rank (the copies of the tied weight initialised apart) or read from a
    transformers folder; two steps per optimizer step when `accumulate`. Returns the losses, the parameters
    before and after training (full), and the logits after."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", mesh_shape, names)
    if folder:
        pipe = hp.from_pretrained(folder, mesh, **kwargs)
    else:
        torch.manual_seed(rank)
        pipe = hp.pipeline(tiny_model("qwen3_tied", device="meta"), mesh, **kwargs)
    opt = torch.optim.AdamW(pipe.parameters(), lr=LR)
    ids, labels = batch()
    rows = BATCH // hp.data_world(mesh)
    share = slice(hp.data_rank(mesh) * rows, (hp.data_rank(mesh) + 1) * rows)
    halves = [share] if not accumulate else [slice(share.start, share.start + rows // 2),
                                             slice(share.start + rows // 2, share.stop)]
    initial = {k: _full(v).detach().clone() for k, v in pipe.named_parameters()}
    losses = []
    for _ in range(STEPS):
        for half in halves:
            losses.append(pipe.step(ids[half], labels=labels[half]).item())
        opt.step()
        opt.zero_grad()
    params = {k: _full(v).detach().clone() for k, v in pipe.named_parameters()}
    return losses, initial, params, (share, pipe.eval_forward(ids[share]))


def check_tied(results, plain, accumulate):
    """Every rank against one plain process from the same start: losses, each copy of the tied weight and
    every other parameter after training, logits."""
    opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    ids, labels = batch()
    halves = [slice(None)] if not accumulate else [slice(0, BATCH // 2), slice(BATCH // 2, None)]
    losses = []
    for _ in range(STEPS):
        for half in halves:
            loss = plain(input_ids=ids[half], labels=labels[half]).loss
            loss.backward()   # as Pipeline.step: each step's gradients add into .grad
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    want = dict(plain.named_parameters())
    with torch.no_grad():
        logits = plain(input_ids=ids).logits
    copies = 0
    for got_losses, _, params, (share, got_logits) in results:
        assert got_losses == pytest.approx(losses, abs=1e-5), (got_losses, losses)
        for name, value in params.items():
            copies += name in TIED
            torch.testing.assert_close(value, want[TIED[0] if name in TIED else name], atol=1e-5, rtol=0,
                                       msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(got_logits, logits[share], atol=1e-5, rtol=0)
    assert copies == len(results)   # pp=2: every rank holds one copy, the embeddings' or the head's


@pytest.mark.parametrize("accumulate", [False, True])
def test_tied_embeddings_on_two_stages_train_as_one_weight(dist2, accumulate):
    """tie_word_embeddings=True (Qwen3 up to 4B, Gemma, Llama 3.2): the embeddings on stage 0 and the head on
    stage 1 stay one weight: the same start though each rank initialised its own random copy, the same
    summed gradient (also when two steps accumulate before the optimizer's), the same values after AdamW,
    logits equal to one plain process from that start."""
    _check_tied_from_meta(dist2, (2,), ("pp",), dict(schedule="1f1b", n_microbatches=2), accumulate)


def test_tied_embeddings_on_two_stages_with_tp(dist4):
    """The same on a pp x tp mesh, the two copies laid out by the model's own tp plan (vocab split)."""
    _check_tied_from_meta(dist4, (2, 2), ("pp", "tp"), dict(schedule="1f1b", n_microbatches=2, tp="auto"), False)


def _check_tied_from_meta(pool, shape, names, kwargs, accumulate):
    results = pool.run(train_tied, shape, names, kwargs, None, accumulate)
    start = {k: v for _, initial, _, _ in results for k, v in initial.items()}
    first, last = results[0][1], results[-1][1]   # a rank of stage 0 and one of stage 1
    assert torch.equal(first[TIED[0]], last[TIED[1]])
    plain = tiny_model("qwen3_tied")
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(start[name])
    check_tied(results, plain, accumulate)


def test_tied_from_pretrained_pp2_dp2_hsdp(dist4):
    """A tied transformers folder (one tensor for both) read by from_pretrained on a pp x dp mesh with hsdp:
    each stage's copy comes from that one tensor, and training equals one plain process."""
    from transformers import AutoModelForCausalLM
    with tempfile.TemporaryDirectory() as tmp:
        tiny_model("qwen3_tied").save_pretrained(tmp)
        kwargs = dict(schedule="1f1b", n_microbatches=2, hsdp={"threshold": 0})
        results = dist4.run(train_tied, (2, 2), ("pp", "dp"), kwargs, tmp, False)
        check_tied(results, AutoModelForCausalLM.from_pretrained(tmp).float(), False)


# ---- placement by where the forward names a module -----------------------------------------------------
ORDER_HIDDEN = 8


def _causal_lm(shift: int | None = None, smoothing: float = 0.0, headless: bool = False) -> list:
    """The source of a causal LM around a source's `Decoder` (its constructor's arguments are the model's after
    the config). `shift`: its forward takes labels= and returns its own loss, the cross-entropy against the
    labels shifted by `shift` (1: transformers' causal-LM loss; 0: TrOCR's), with label smoothing `smoothing`.
    `headless`: get_output_embeddings() is None and the head's weight is the embeddings' (BLIP's, inside its text
    decoder)."""
    lines = ["class Model(nn.Module):", "    def __init__(self, config, *args):",
             "        super().__init__()", "        self.config = config", "        self.model = Decoder(*args)",
             f"        self.lm_head = nn.Linear({ORDER_HIDDEN}, {VOCAB}, bias=False)"]
    lines += ["        self.lm_head.weight = self.model.embed.weight"] if headless else []
    lines += ["", "    def get_input_embeddings(self):", "        return self.model.embed", "",
              "    def get_output_embeddings(self):", f"        return {'None' if headless else 'self.lm_head'}", "",
             "    def get_decoder(self):", "        return self.model", "",
             "    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None):",
             "        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, "
             "attention_mask=attention_mask)[0]", "        logits = self.lm_head(hidden)"]
    if shift is None:
        return lines + ["        return (logits,)", ""]
    return lines + ["        if labels is None:", "            return CausalLMOutput(logits=logits)",
                    f"        target = torch.nn.functional.pad(labels, (0, {shift}), value=-100)[:, {shift}:]",
                    "        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), "
                    f"target.reshape(-1), ignore_index=-100, label_smoothing={smoothing})",
                    "        return CausalLMOutput(loss=loss, logits=logits)",
                    ""]


def _ordered_model(registered: list, before: list, after: list, n_layers: int, seed: int, side: bool = False,
                   stream: bool = False, shift: int | None = None, smoothing: float = 0.0, headless: bool = False):
    """A tiny causal LM whose decoder registers its children in the order `registered` (names from `before`,
    `after`, "embed" and "layers") and whose forward calls `before` between the embeddings and the layer
    list and `after` behind it: written to a file, so that the cutter reads the forward's source as it
    reads a transformers model's. `side`: every layer is also handed a per-token input computed from the
    embeddings before the loop (half their width, so not the hidden state's shape). `stream`: the embeddings are
    added to the layer list's output again behind it (a second stream beside the layers, as HRM's high-level
    state). `shift`: the forward takes labels= and returns its own loss, the cross-entropy against the labels
    shifted by `shift` (1: transformers' causal-LM loss; 0: TrOCR's), label-smoothed by `smoothing`; `headless`:
    no output head at the root, its head's weight the embeddings' (`_causal_lm`)."""
    import transformers
    lines = ["import torch", "from torch import nn", "from transformers.modeling_outputs import CausalLMOutput", "",
             "class Layer(nn.Module):", "    def __init__(self):",
             "        super().__init__()", f"        self.linear = nn.Linear({ORDER_HIDDEN}, {ORDER_HIDDEN})", "",
             "    def forward(self, x, side=None):",
             "        return torch.tanh(self.linear(x) + (0 if side is None else side.repeat(1, 1, 2)))", "",
             "class Decoder(nn.Module):",
             "    def __init__(self, registered, n_layers):", "        super().__init__()",
             "        for name in registered:",
             "            if name == 'embed':", f"                self.embed = nn.Embedding({VOCAB}, {ORDER_HIDDEN})",
             "            elif name == 'layers':",
             "                self.layers = nn.ModuleList(Layer() for _ in range(n_layers))",
             "            else:", f"                setattr(self, name, nn.Linear({ORDER_HIDDEN}, {ORDER_HIDDEN}))", "",
             "    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None):",
             "        if inputs_embeds is None:", "            inputs_embeds = self.embed(input_ids)",
             "        x = inputs_embeds"]
    lines += [f"        x = torch.tanh(self.{name}(x))" for name in before]
    lines += [f"        side = inputs_embeds[..., :{ORDER_HIDDEN // 2}] * 2" if side else "        side = None"]
    lines += ["        for layer in self.layers:", "            x = layer(x, side)"]
    lines += ["        x = x + inputs_embeds"] if stream else []
    lines += [f"        x = torch.tanh(self.{name}(x))" for name in after]
    lines += ["        return (x,)", ""] + _causal_lm(shift, smoothing, headless)
    key = abs(hash((tuple(registered), tuple(before), tuple(after), n_layers, side, stream, shift, smoothing,
                    headless)))
    module = _module_from_source(lines, f"ordered_{key}")
    torch.manual_seed(seed)
    return module.Model(transformers.PretrainedConfig(vocab_size=VOCAB), registered, n_layers)


def _module_from_source(lines: list, name: str):
    """The Python module of `lines`, written to a file first: the cutter reads a forward's source as it reads a
    transformers model's."""
    import importlib.util
    path = os.path.join(tempfile.mkdtemp(), f"{name}.py")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.integers(2, 5), st.data())
def test_placement_follows_the_forward_property(n_before, n_after, n_layers, data):
    """Children the decoder's forward calls before its layer list go to the first stage, those it calls after
    to the last, whatever order they were registered in; cut into 2..layers stages run one after the other
    in one process, loss and every gradient equal the plain model's."""
    before = [f"pre{i}" for i in range(n_before)]
    after = [f"post{i}" for i in range(n_after)]
    registered = data.draw(st.permutations(["embed", "layers"] + before + after))
    n_stages = data.draw(st.integers(2, n_layers))
    model = _ordered_model(list(registered), before, after, n_layers, seed=0)
    structure = cut.find_structure(model)
    assert set(structure.first) == {"model.embed", *(f"model.{n}" for n in before)}
    assert set(structure.last) == {"lm_head", *(f"model.{n}" for n in after)}
    _check_stages_in_one_process(model, n_stages)


def _check_stages_in_one_process(model, n_stages: int, split_points=None) -> None:
    """`model` cut into `n_stages` stages on one process (a pp axis of size 1, the stages run one after the
    other) against a copy of it: the loss and every gradient of one step equal the plain model's."""
    import copy
    import hyper_parallel as hp
    plain = copy.deepcopy(model)
    ids, labels = batch()
    logits = plain(input_ids=ids)[0]
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), shift.reshape(-1), ignore_index=-100)
    want.backward()
    pipe = hp.pipeline(model, hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                       stages_per_rank=n_stages, n_microbatches=2, split_points=split_points)
    assert len(pipe.stages) == n_stages
    got = pipe.step(ids, labels=labels)
    assert float(got) == pytest.approx(float(want.detach()), abs=1e-5)
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


# ---- what the decoder loop hands its layers besides the hidden state -----------------------------------
HALF = ORDER_HIDDEN // 2
# what the loop of `_stateful_model` hands its layers: "constant" a clone of the embeddings for every layer
# (Zamba), "side" a half-width tensor computed from them (one object for every layer), "slices" per-layer
# slices of one tensor computed before the loop (Gemma 3n), "state" what each layer returns for the next
# (Zaya), "stack" a stack of the layers' inputs the loop grows (Inkling2), "shared" a dict of (key, value)
# tensors, batch first, that layers store and later layers read (Gemma 3n/4's shared K/V), "topk" integer
# indices per token that the even layers select and the odd ones reuse (HY-V4's shared DSA top-k), "rotary"
# a (cos, sin) tuple broadcast over the batch from a module with a parameter (Mistral-Large-4's rotary);
# "recomputed" a per-layer input the loop derives anew from the embeddings at each layer, which no stage
# hand-over can give a later stage
LOOP_INPUTS = ("constant", "side", "slices", "state", "stack", "shared", "topk", "rotary")


def _stateful_model(features: tuple, n_layers: int, seed: int = 0):
    """A tiny causal LM whose decoder loop hands every layer, besides the hidden state, the `features`
    (LOOP_INPUTS, "recomputed"): per-token tensors, a dict of tensors the layers fill and read, integer
    indices, which the layers mix into their output."""
    import transformers
    lines = ["import torch", "from torch import nn", "", "class Rotary(nn.Module):", "    def __init__(self):",
             "        super().__init__()", f"        self.alpha = nn.Parameter(torch.linspace(0.5, 1.5, {HALF}))", "",
             "    def forward(self, x):",
             "        angles = torch.arange(x.shape[1], dtype=x.dtype).view(1, -1, 1) * self.alpha",
             "        return angles.cos(), angles.sin()", "",
             "class Layer(nn.Module):",
             "    def __init__(self, index, n_layers, use_topk):",
             "        super().__init__()", f"        self.linear = nn.Linear({ORDER_HIDDEN}, {ORDER_HIDDEN})",
             f"        self.gate = nn.Linear({HALF}, {HALF})", f"        self.kv = nn.Linear({HALF}, {HALF})",
             "        self.index, self.n_layers, self.use_topk = index, n_layers, use_topk", "",
             "    def forward(self, x, constant=None, side=None, state=None, stack=None, shared=None, topk=None,",
             "                rotary=None):",
             "        y = self.linear(x)",
             "        y = y if rotary is None else y + (rotary[0] * rotary[1]).repeat(1, 1, 2)",
             "        if shared is not None and self.index >= 1:   # reuse the last even layer's (k, v)",
             "            k, v = shared['k0']",
             f"            y = y + (k * v).transpose(1, 2).reshape(*y.shape[:-1], {HALF}).repeat(1, 1, 2)",
             "        if shared is not None and self.index < self.n_layers - 1:   # store this layer's",
             f"            kv = torch.tanh(self.kv(x[..., :{HALF}])).view(*x.shape[:-1], 2, {HALF // 2})",
             "            kv = kv.transpose(1, 2)",
             "            shared[f'k{self.index % 2}'] = (kv, kv + 1)",
             "        if self.use_topk:",
             "            topk = topk if self.index % 2 else x[..., :4].argsort(-1)[..., :2]",
             "            y = y + torch.gather(y, -1, topk).mean(-1, keepdim=True)",
             "        y = y if constant is None else y + constant",
             "        y = y if side is None else y + side.repeat(1, 1, 2)",
             "        y = y if stack is None or stack.shape[-2] == 0 else y + stack.mean(-2)",
             "        y = torch.tanh(y)",
             f"        new_state = torch.tanh(self.gate(y[..., :{HALF}]) + (0 if state is None else state))",
             "        return y + new_state.repeat(1, 1, 2), new_state, topk", "",
             "class Decoder(nn.Module):", "    def __init__(self, features, n_layers):", "        super().__init__()",
             "        self.features = tuple(features)", f"        self.embed = nn.Embedding({VOCAB}, {ORDER_HIDDEN})",
             "        self.rotary = Rotary() if 'rotary' in features else None",
             "        self.layers = nn.ModuleList(Layer(i, n_layers, 'topk' in features) for i in range(n_layers))", "",
             "    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None):",
             "        if inputs_embeds is None:", "            inputs_embeds = self.embed(input_ids)",
             "        x, features, n = inputs_embeds, self.features, len(self.layers)",
             "        constant = torch.clone(inputs_embeds) * 0.5 if 'constant' in features else None",
             f"        side = inputs_embeds[..., :{HALF}] * 2 if 'side' in features else None",
             "        scales = torch.arange(1, n + 1, dtype=x.dtype).view(1, 1, n, 1)",
             f"        per_layer = inputs_embeds[..., :{HALF}].unsqueeze(2) * scales",
             f"        stack = inputs_embeds.new_zeros(*inputs_embeds.shape[:-1], 0, {ORDER_HIDDEN})",
             "        stack = stack if 'stack' in features else None",
             "        state, topk = None, None",
             "        shared = {} if 'shared' in features else None",
             "        rotary = self.rotary(inputs_embeds) if 'rotary' in features else None",
             "        for i, layer in enumerate(self.layers):",
             "            if 'slices' in features:", "                side = per_layer[:, :, i, :]",
             "            if 'recomputed' in features:",
             f"                side = inputs_embeds[..., :{HALF}] * (i + 1)",
             "            new_x, new_state, new_topk = layer(x, constant, side, state, stack, shared, topk, rotary)",
             "            topk = new_topk if 'topk' in features else None",
             "            if stack is not None:", "                stack = torch.cat([stack, x.unsqueeze(-2)], dim=-2)",
             "            state = new_state if 'state' in features else None",
             "            x = new_x",
             "        x = x if stack is None else x + stack.mean(-2)",
             "        return (x,)", ""] + _causal_lm()
    module = _module_from_source(lines, f"stateful_{'_'.join(features) or 'none'}_{n_layers}")
    torch.manual_seed(seed)
    return module.Model(transformers.PretrainedConfig(vocab_size=VOCAB), features, n_layers)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from(LOOP_INPUTS), unique=True), st.integers(2, 5), st.data())
def test_loop_inputs_carried_across_cuts_property(features, n_layers, data):
    """Whatever the decoder loop hands its layers besides the hidden state (a constant computed before the
    loop, per-layer slices of one, a state each layer hands the next, a stack the loop grows), cut into
    2..layers stages at random layers and run one after the other in one process, the loss and every
    gradient equal the plain model's: each cut carries what the loop hands the next stage's first layer, and
    the later stage's loop goes on from it."""
    n_stages = data.draw(st.integers(2, n_layers))
    split_points = sorted(data.draw(st.lists(st.integers(1, n_layers - 1), min_size=n_stages - 1,
                                             max_size=n_stages - 1, unique=True)))
    _check_stages_in_one_process(_stateful_model(tuple(features), n_layers), n_stages, split_points)


def test_per_layer_input_derived_anew_from_the_embeddings_is_refused():
    """A per-layer input the loop computes anew from the embeddings at each layer (not one tensor handed on)
    reaches a later stage's later layers computed from the placeholder embeddings, which no hand-over at the
    cut fixes: the dry run, run again on other placeholders, finds those layers handed other values and
    refuses by name, rather than train on wrong ones."""
    import hyper_parallel as hp
    model = _stateful_model(("recomputed",), 4)
    pipe = hp.pipeline(model, hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                       stages_per_rank=2, n_microbatches=2)
    ids, labels = batch()
    with pytest.raises(ValueError, match="stage 1 of Model runs on placeholders.*its layer 3 gets 'argument 2'"):
        pipe.step(ids, labels=labels)


def _step_error(rank, world, options):
    """Worker: one pp=2 step of `_ordered_model(**options)`; the error this rank raised (None: it trained), and
    its loss."""
    import hyper_parallel as hp
    pipe = hp.pipeline(_ordered_model(["embed", "layers"], [], [], 4, seed=0, **options),
                       hp.init_device_mesh("cpu", (2,), ("pp",)), schedule="1f1b", n_microbatches=2)
    ids, labels = batch()
    try:
        return None, float(pipe.step(ids, labels=labels))
    except ValueError as e:
        return str(e), None


def test_pp2_embeddings_used_past_the_layers_are_refused_on_every_rank(dist2):
    """A decoder that adds its embeddings to the layer list's output behind it (a second stream, as HRM's
    high-level state) would train the last stage on its placeholder embeddings without an error: the dry run
    sees that stage's output change with random placeholders and every rank raises the same refusal
    (before the schedule: no rank waits on another); the same model without the stream trains as one process."""
    errors = [error for error, _ in dist2.run(_step_error, {"stream": True})]
    refusal = "runs on placeholders where the first stage computed values"
    assert all(e is not None and refusal in e for e in errors), errors
    assert errors[0] == errors[1]
    plain = _ordered_model(["embed", "layers"], [], [], 4, seed=0)
    ids, labels = batch()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    want = torch.nn.functional.cross_entropy(plain(input_ids=ids)[0].reshape(-1, VOCAB), shift.reshape(-1),
                                             ignore_index=-100)
    for error, loss in dist2.run(_step_error, {}):
        assert error is None and loss == pytest.approx(float(want.detach()), abs=1e-5), error


def _loss_step(rank, world, options, labels, n_microbatches, loss, dp=1, schedule=("1f1b", 1)):
    """Worker: one step of `schedule` (name, stages per rank) over pp=2 (x `dp` with hsdp, each dp rank feeding
    its share of the batch) of `_ordered_model(**options)` with pipeline(loss=loss) on `labels` (None: no
    labels); (the error this rank raised, None: it trained; the loss; this rank's gradients, whole)."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (2, dp), ("pp", "dp")) if dp > 1 else hp.init_device_mesh("cpu", (2,), ("pp",))
    pipe = hp.pipeline(_ordered_model(["embed", "layers"], [], [], 4, seed=0, **options), mesh, schedule=schedule[0],
                       stages_per_rank=schedule[1], n_microbatches=n_microbatches, loss=loss,
                       **({"hsdp": {"threshold": 0}} if dp > 1 else {}))
    rows = BATCH // dp
    share = slice(hp.data_rank(mesh) * rows, (hp.data_rank(mesh) + 1) * rows)
    try:
        value = pipe.step(batch()[0][share], labels=None if labels is None else labels[share])
    except ValueError as e:
        return str(e), None, None
    return None, float(value), {n: _full(p.grad).clone() for n, p in pipe.named_parameters() if p.grad is not None}


def _plain_step(options, labels, loss=None):
    """One plain step of `_ordered_model(**options)` on the global batch: its own loss given `labels`, or
    `loss(output, batch)`; (the loss, every gradient, under every name of a tied weight)."""
    model = _ordered_model(["embed", "layers"], [], [], 4, seed=0, **options)
    ids = batch()[0]
    out = model(input_ids=ids, labels=labels) if loss is None else model(input_ids=ids)
    value = out.loss if loss is None else loss(out, {"input_ids": ids})
    value.backward()
    return float(value.detach()), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)
                                   if p.grad is not None}


def _assert_trains_as_one_process(results, want_loss, want_grads):
    held = {}
    for error, value, grads in results:
        assert error is None, error
        assert value == pytest.approx(want_loss, abs=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
            held[name] = grad
    assert set(held) == set(want_grads), sorted(set(want_grads) ^ set(held))


def test_pp2_model_whose_own_loss_is_not_the_shifted_one_is_refused_with_loss_shifted(dist2):
    """loss="shifted" computes the shifted token cross-entropy from the logits: a model whose own loss labels
    each token with its own label (TrOCR's unshifted cross-entropy) would train another objective, so the dry
    run computes both on the last stage's logits and every rank refuses, naming loss='own'; a model whose own
    loss is the shifted one trains, its loss the plain model's."""
    results = dist2.run(_loss_step, {"shift": 0}, batch()[1], 2, "shifted")
    errors = [error for error, _, _ in results]
    assert all(e is not None and "own loss" in e and "shifted by one" in e and "loss='own'" in e for e in errors)
    assert errors[0] == errors[1]
    labels = batch()[1]
    _assert_trains_as_one_process(dist2.run(_loss_step, {"shift": 1}, labels, 2, "shifted"),
                                  *_plain_step({"shift": 1}, labels))


@pytest.mark.parametrize("loss,schedule", [("auto", ("1f1b", 1)), ("own", ("1f1b", 1)), ("auto", ("zbv", 2)),
                                           ("auto", ("interleaved_1f1b", 2))])
def test_pp2_unshifted_own_loss_trains_as_one_process_weighted_by_label_counts(dist2, loss, schedule):
    """TrOCR's own loss (the unshifted token cross-entropy): loss="auto" (and "own") trains on it, each
    micro-batch's mean weighted by its count of labels other than -100, so the loss and every gradient equal one
    device's on a batch whose micro-batches count different numbers of labels (batch()'s uneven -100s), under
    the one-stage, interleaved and zero-bubble (split backward) schedules alike."""
    labels = batch()[1]
    _assert_trains_as_one_process(dist2.run(_loss_step, {"shift": 0}, labels, 4, loss, 1, schedule),
                                  *_plain_step({"shift": 0}, labels))


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.lists(st.integers(0, BATCH * SEQ - 1), max_size=12), st.booleans(),
       st.sampled_from([0.0, 0.1]))
def test_pp2_own_loss_exact_or_refused_on_every_rank_property(n_microbatches, masked, even, smoothing):
    """Random label masks (`even`: the first micro-batch's mask repeated in every micro-batch, so they count
    alike) and micro-batch counts. An own loss the dry run does not recognise as a token cross-entropy
    (label-smoothed) is the mean of the micro-batches' means: one device's loss and gradients when every
    micro-batch counts as many labels, else refused on both ranks alike (no rank trains); the unshifted token
    cross-entropy (no smoothing) is weighted by the counts and trains as one device unless a micro-batch counts
    none (its mean would be NaN: refused alike)."""
    from tests import harness
    labels = batch()[0].clone().reshape(-1)
    labels[masked] = -100
    labels = labels.reshape(BATCH, SEQ)
    if even:
        rows = BATCH // n_microbatches
        labels = labels[:rows].repeat(n_microbatches, 1)
    options = {"shift": 0, "smoothing": smoothing}
    results = harness.pool(2).run(_loss_step, options, labels, n_microbatches, "auto")
    counts = [int((chunk != -100).sum()) for chunk in labels.tensor_split(n_microbatches)]
    refusal = ("counts as many labels" if smoothing and len(set(counts)) > 1 else
               "holds no counted label" if not smoothing and 0 in counts else None)
    if refusal:
        errors = [error for error, _, _ in results]
        assert all(e is not None and refusal in e for e in errors), errors
        assert errors[0] == errors[1]
    else:
        _assert_trains_as_one_process(results, *_plain_step(options, labels))


def test_pp2_label_smoothed_own_loss_is_exact_on_micro_batches_that_count_alike_else_refused(dist2):
    """A label-smoothed own loss (not a token cross-entropy the dry run recognises) is the mean of the
    micro-batches' means: on micro-batches that count as many labels (the same rows masked alike in each) one
    device's loss, every gradient equal; on batch()'s unevenly masked rows refused on both ranks alike."""
    labels = batch()[1][:2].repeat(BATCH // 2, 1)
    options = {"shift": 0, "smoothing": 0.1}
    _assert_trains_as_one_process(dist2.run(_loss_step, options, labels, 4, "own"), *_plain_step(options, labels))
    errors = [error for error, _, _ in dist2.run(_loss_step, options, batch()[1], 4, "own")]
    assert all(e is not None and "counts as many labels" in e for e in errors), errors
    assert errors[0] == errors[1]


def test_pp2_dp2_own_loss_weighs_every_data_rank_or_refuses_on_every_rank(dist4):
    """pp=2 x dp=2 (hsdp), each dp rank feeding its half: the unshifted own loss is weighted by the label counts of
    the global batch (summed over the dp ranks), so the loss and every gradient equal one device's on batch()'s
    uneven labels; a label-smoothed own loss on them (micro-batches of the two ranks counting differently) is
    refused on all four ranks alike."""
    labels = batch()[1]
    _assert_trains_as_one_process(dist4.run(_loss_step, {"shift": 0}, labels, 2, "auto", 2),
                                  *_plain_step({"shift": 0}, labels))
    errors = [error for error, _, _ in dist4.run(_loss_step, {"shift": 0, "smoothing": 0.1}, labels, 2, "auto", 2)]
    assert all(e is not None and "counts as many labels" in e for e in errors), errors
    assert len(set(errors)) == 1, errors


def test_pp2_dp2_data_ranks_that_decide_the_loss_differently_are_refused_on_every_rank(dist4):
    """The dry run decides the loss on each data-parallel rank's first micro-batch: one whose labels are all -100
    cannot compare the unshifted own loss and would take the shifted one while the other rank trains on the own
    loss; every rank refuses alike instead of summing pieces of two objectives."""
    labels = batch()[1].clone()
    labels[:2] = -100   # dp rank 0's first micro-batch
    errors = [error for error, _, _ in dist4.run(_loss_step, {"shift": 0}, labels, 2, "auto", 2)]
    assert all(e is not None and "decide the loss differently" in e for e in errors), errors
    assert len(set(errors)) == 1, errors


def test_pp2_dp2_a_refusal_of_one_data_replica_is_raised_on_every_rank(dist4):
    """loss="shifted" on a model whose own loss is unshifted: the replica whose first micro-batch holds labels
    refuses (the dry run compares the losses), the other's holds none and has nothing to compare; the refusal
    reaches the other replica's ranks too (which would otherwise wait in their first collective), so all four
    raise, none trains."""
    labels = batch()[1].clone()
    labels[:2] = -100   # dp rank 0's first micro-batch
    errors = [error for error, _, _ in dist4.run(_loss_step, {"shift": 0}, labels, 2, "shifted", 2)]
    assert all(e is not None for e in errors), errors
    assert sum("another data-parallel replica" in e for e in errors) == 2, errors


def test_pp2_headless_model_with_embeddings_tied_to_a_last_stage_module_matches_one_process(dist2):
    """A model with no output head at its root whose embeddings' weight a module of the last stage shares (BLIP's
    text decoder head): loss="auto" trains it on its own loss, the weight tied across the two stages as a head's
    (each copy's gradient summed over both), so the loss and both copies' gradients equal one device's."""
    labels = batch()[1]
    options = {"shift": 1, "headless": True}
    _assert_trains_as_one_process(dist2.run(_loss_step, options, labels, 2, "auto"), *_plain_step(options, labels))


def test_pp2_headless_model_that_computes_no_loss_is_refused_on_every_rank(dist2):
    """Without an output head, and a forward that computes no loss from the labels it takes, there is nothing to
    train on but a given loss: every rank refuses at the first step, naming loss=callable (a model whose forward
    takes no labels at all is refused at the call: test_errors_are_clear)."""
    errors = [error for error, _, _ in dist2.run(_loss_step, {"headless": True}, batch()[1], 2, "auto")]
    assert all(e is not None and "gives no loss" in e and "loss=callable" in e for e in errors), errors
    assert errors[0] == errors[1]


def mean_square_loss(out, micro_batch):
    """A loss= callable: the mean square of the logits (a per-sample mean, no labels)."""
    return out[0].float().pow(2).mean()


def test_pp2_given_loss_without_labels_trains_as_one_process(dist2):
    """pipeline(loss=callable) trains on the callable's mean of each micro-batch's last-stage output, with no
    labels: the mean over the (equal) micro-batches is one device's loss on the whole batch, and every gradient
    equals one device's."""
    _assert_trains_as_one_process(dist2.run(_loss_step, {}, None, 4, mean_square_loss),
                                  *_plain_step({}, None, mean_square_loss))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_stage_pipeline_decides_its_loss_as_the_cut_ones(smoothing):
    """A pipeline of one stage (pp=1, "gpipe": the whole model, no dry run of cuts) decides its loss alike: the
    unshifted own loss weighted by label counts on batch()'s uneven labels equals one device's, loss and every
    gradient; label-smoothed, on those unevenly counted micro-batches, it is refused."""
    import hyper_parallel as hp
    options = {"shift": 0, "smoothing": smoothing}
    pipe = hp.pipeline(_ordered_model(["embed", "layers"], [], [], 4, seed=0, **options),
                       hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="gpipe", n_microbatches=4)
    ids, labels = batch()
    if smoothing:
        with pytest.raises(ValueError, match="counts as many labels"):
            pipe.step(ids, labels=labels)
        return
    value = pipe.step(ids, labels=labels)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    _assert_trains_as_one_process([(None, float(value), grads)], *_plain_step(options, labels))


def test_from_pretrained_passes_loss_to_the_pipeline():
    """from_pretrained on a pp mesh takes pipeline's loss= too: a callable reaches the Pipeline, an unknown name is
    refused as pipeline refuses it."""
    import hyper_parallel as hp
    mesh = hp.init_device_mesh("cpu", (1,), ("pp",))
    with tempfile.TemporaryDirectory() as folder:
        tiny_model("llama").save_pretrained(folder)
        pipe = hp.from_pretrained(folder, mesh, schedule="interleaved_1f1b", stages_per_rank=2, loss=mean_square_loss)
        assert pipe.loss is mean_square_loss
        with pytest.raises(ValueError, match="unknown loss 'mean'"):
            hp.from_pretrained(folder, mesh, schedule="interleaved_1f1b", stages_per_rank=2, loss="mean")


def test_unknown_loss_is_refused_before_anything_changes():
    """loss= takes "auto", "shifted", "own" or a callable: anything else is refused at the call, naming them,
    before the model is pruned."""
    import hyper_parallel as hp
    model = _ordered_model(["embed", "layers"], [], [], 4, seed=0, shift=0)
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="unknown loss 'mean'"):
        hp.pipeline(model, hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                    stages_per_rank=2, loss="mean")
    assert {n for n, _ in model.named_parameters()} == set(before)


def test_batch_packed_in_one_row_is_refused_naming_n_microbatches():
    """An input packing every sample's image patches into one row (MiniCPM-V's NaViT pixel_values, (1, ...))
    cannot be cut into micro-batches along dim 0: refused at the feed, saying what to use instead."""
    import hyper_parallel as hp
    pipe = hp.pipeline(tiny_model("llama"), hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                       stages_per_rank=2, n_microbatches=2)
    ids, labels = batch()
    with pytest.raises(Exception, match="packs the whole batch into one row.*n_microbatches=1"):
        pipe.step(ids, labels=labels, pixel_values=torch.zeros(1, 3, 4, 64))


def pipeline_census_type(rank, world, model_type, image_tokens_per_row=None):
    """Worker: the census's own pp comparison (census_scenarios.pipeline_run) of one transformers type;
    `image_tokens_per_row`: its image tokens cut to that many per row (the others made text tokens)."""
    import hyper_parallel as hp
    from hyper_parallel.tools.auto_models import build_model_type
    from hyper_parallel.tools.census_scenarios import pipeline_run
    template = build_model_type(model_type, 0)
    if image_tokens_per_row is not None:
        ids = template.inputs["input_ids"]
        image = ids == template.model.config.image_token_id
        ids[image & (image.cumsum(1) > image_tokens_per_row)] = int(ids[~image].flatten()[0])
    import copy
    report = pipeline_run(model_type, lambda: copy.deepcopy(template), hp.init_device_mesh("cpu", (2,), ("pp",)),
                          record=False)
    return report.equal, report.error, report.detail


def test_pp2_module_registered_after_its_layers_matches_one_process(dist2):
    """Phi-4-multimodal registers the embeddings' extension (embed_tokens_extend) after its final norm and
    calls it before the layers: placed on the first stage by its forward's text, pp=2 trains as one process
    (loss and every stage's gradient)."""
    for equal, error, detail in dist2.run(pipeline_census_type, "phi4_multimodal"):
        assert error is None and equal, (error, detail)


def train_census_type_pp2(rank, world, model_type, tp=False):
    """Worker: one 1F1B step of the census's tiny `model_type` through pipeline() over pp=2 (2 micro-batches;
    `tp`: x tp=2 with the model's own shard plan): the loss and this rank's stages' gradients (whole)."""
    import hyper_parallel as hp
    from hyper_parallel.tools.auto_models import build_model_type
    case = build_model_type(model_type, 0)
    inputs = dict(case.inputs)
    ids = inputs.pop("input_ids")
    mesh = hp.init_device_mesh("cpu", (2, 2), ("pp", "tp")) if tp else hp.init_device_mesh("cpu", (2,), ("pp",))
    pipe = hp.pipeline(case.model.float(), mesh, schedule="1f1b", n_microbatches=2, **({"tp": "auto"} if tp else {}))
    case.model.train()
    loss = pipe.step(ids, labels=case.labels["labels"], **inputs)
    return float(loss), {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}


def _census_type_trains_as_one_process(pool, model_type, tp=False):
    """`train_census_type_pp2` on every rank of `pool` against one plain step: the loss, and every parameter's
    gradient on the ranks that hold it, within 1e-5."""
    from hyper_parallel.tools.auto_models import build_model_type
    case = build_model_type(model_type, 0)
    _assert_ranks_train_as(case.model.float(), case, lambda: pool.run(train_census_type_pp2, model_type, tp))


def _assert_ranks_train_as(model, case, run_ranks):
    """One plain step of `model` on `case`, then `run_ranks()` (per rank: its loss and its stages' gradients):
    every rank's loss, and every gradient on the ranks that hold it, within 1e-5, and every gradient held."""
    model.train()
    want = model(**case.inputs, **case.labels).loss
    want.backward()
    plain = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    held = {}
    for loss, grads in run_ranks():
        assert loss == pytest.approx(float(want.detach()), abs=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain[name], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
            held[name] = grad
    assert set(held) == set(plain), sorted(set(plain) ^ set(held))


@pytest.mark.parametrize("model_type", ["zamba", "zaya", "gemma3n_text", "hy_v4", "mistral_large4", "gemma4_text"])
def test_pp2_loop_inputs_besides_the_hidden_state_match_one_process(dist2, model_type):
    """Zamba's loop hands every layer a clone of the embeddings, Zaya's each layer the router states the
    layer before returned, Gemma 3n's "reuse" layers the K/V its "store" layers left in shared_kv_states,
    HY-V4's "shared" DSA layer the top-k indices (integers) the layer before selected, Mistral-Large-4's
    every layer the (cos, sin) of a rotary embedding with a trained parameter, Gemma 4's every layer its slice
    of per-layer inputs that a later stage cannot derive (it reverses the embeddings): carried across the cut
    with the hidden state, pp=2 over gloo trains as one process (the loss, and every parameter's gradient on
    the rank that holds it, within 1e-5: the K/V's gradient flows back to the first stage's layer)."""
    _census_type_trains_as_one_process(dist2, model_type)


def test_pp2_tp2_own_loss_is_computed_on_whole_tokens_and_matches_one_process(dist4):
    """With tp the tokens are whole on every rank, so the last stage computes TrOCR's own (unshifted) loss there
    too: pp=2 x tp=2 trains as one process (the loss, every gradient)."""
    _census_type_trains_as_one_process(dist4, "trocr", tp=True)


# census types given layers that leave state for later layers: Gemma 4's last 2 of 4 layers reuse the K/V
# that layers 0 (sliding) and 1 (full attention) store; Mistral-Large-4's layers 1 and 2 reuse layer 0's latent
# K/V, and its "shared" DSA layers 1 and 3 the top-k indices of layers 0 and 2
SHARED_STATE_CONFIGS = {
    "gemma4_text": {"num_hidden_layers": 4, "num_kv_shared_layers": 2,
                    "layer_types": ["sliding_attention", "full_attention"] * 2},
    "mistral_large4": {"kv_source_layers": [0, 0, 0, 3], "no_rope_layers": [1, 1, 1, 0],
                       "indexer_types": ["full", "shared", "full", "shared"]},
}


def _shared_state_model(model_type: str):
    """The census's tiny `model_type` with its text config changed by SHARED_STATE_CONFIGS (rebuilt, so that
    what the config derives follows), random weights from seed 0; and the census's inputs."""
    import copy
    from hyper_parallel.tools.auto_models import build_model_type
    case = build_model_type(model_type, 0)
    config = copy.deepcopy(case.model.config)
    text = config.get_text_config()
    fields = {**text.to_dict(), **SHARED_STATE_CONFIGS[model_type]}
    rebuilt = type(text)(**{k: v for k, v in fields.items() if k not in ("kv_sharing_modes", "per_layer_config")})
    if text is config:
        config = rebuilt
    else:
        config.text_config = rebuilt
    assert "reuse" in rebuilt.kv_sharing_modes
    torch.manual_seed(0)
    return type(case.model)(config).float(), case


def train_shared_state_pp2(rank, world, model_type, split):
    """Worker: one 1F1B step of `_shared_state_model` over pp=2 cut before layer `split`: loss, this rank's
    gradients."""
    import hyper_parallel as hp
    model, case = _shared_state_model(model_type)
    inputs = dict(case.inputs)
    ids = inputs.pop("input_ids")
    pipe = hp.pipeline(model, hp.init_device_mesh("cpu", (2,), ("pp",)), schedule="1f1b", n_microbatches=2,
                       split_points=[split])
    model.train()
    loss = pipe.step(ids, labels=case.labels["labels"], **inputs)
    return float(loss), {n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("model_type", sorted(SHARED_STATE_CONFIGS))
def test_pp2_state_shared_across_the_cut_matches_one_process(dist2, model_type, split):
    """Layers that reuse the K/V (and top-k indices) earlier layers left them: cut before layer 1, 2 or 3,
    what the first stage's layers stored crosses to the second with the hidden state (and Gemma 4's per-layer
    inputs, which the second stage cannot derive without the embeddings); pp=2 over gloo trains as one
    process (the loss, and every gradient, the storing layers' K/V projections' included, within 1e-5)."""
    model, case = _shared_state_model(model_type)
    _assert_ranks_train_as(model, case, lambda: dist2.run(train_shared_state_pp2, model_type, split))


def test_pp2_head_inside_a_last_stage_module_matches_one_process(dist2):
    """BERT-generation's head is lm_head.decoder, inside the lm_head the last stage runs: pp=2 trains it as one
    process (loss and every stage's gradient)."""
    for equal, error, detail in dist2.run(pipeline_census_type, "bert-generation"):
        assert error is None and equal, (error, detail)


@pytest.mark.parametrize("model_type", ["blip-2", "instructblip", "kosmos-2", "kosmos-2.5"])
def test_pp2_first_stage_inputs_and_towers_a_later_stage_reads_match_one_process(dist2, model_type):
    """What a later stage's forward reads of the first stage's inputs and modules: BLIP-2's forward requires
    pixel_values and input_ids and runs its vision tower and Q-Former whatever it is given (the caller's inputs,
    and stand-ins giving placeholders in the towers' output form: model outputs of the same shapes);
    InstructBLIP's, given no ids there, finds its image tokens by comparing the placeholder embeddings with the
    image token's (a stand-in's NaN: it finds none, where a placeholder would match every position); Kosmos-2's
    text model reads the caller's image_embeds_position_mask (a per-token input: handed to every stage's forward);
    Kosmos-2.5's reads its segment embeddings' weight (a stand-in's zero-stride shadow), and fed text alone it
    carries image features no later stage uses (their modules get no gradient, as on one device, not zeros).
    pp=2 over gloo trains each as one process: the loss and every stage's gradient, None where it is None."""
    for equal, error, detail in dist2.run(pipeline_census_type, model_type):
        assert error is None and equal, (error, detail)


@pytest.mark.parametrize("model_type", ["rwkv", "molmo2"])
def test_pp2_stage_follows_the_models_train_mode(dist2, model_type):
    """A stage's copies of the modules on the path to the layers take the model's mode at each forward (built
    in eval mode, set to train by `model.train()`): RWKV rescales its blocks when its own mode and the state of
    its weights disagree (reading every block, other stages' stand-ins included); Molmo2 requires
    mm_token_type_ids in train mode (a per-token input every stage's forward is handed). pp=2 trains each as
    one process (loss and every stage's gradient)."""
    for equal, error, detail in dist2.run(pipeline_census_type, model_type):
        assert error is None and equal, (error, detail)


@pytest.mark.parametrize("model_type,reason", [("git", "hands its layers a sequence of"),
                                               ("hrm_text", "placeholders"),
                                               ("musicgen", "labels of shape (2, 8, 4) do not match")])
def test_pp2_census_types_that_cannot_be_cut_are_refused_on_every_rank(dist2, model_type, reason):
    """GIT joins its image features to the tokens (a longer sequence than later stages rebuild), HRM adds its
    embeddings to its stacks' output (a second stream), MusicGen's tokens are one row per codebook while its labels, mask and hidden state are one
    per sample (labels of another shape than the tokens need loss='own', and its mask is then refused): each
    refused with its reason on both ranks, not trained wrong."""
    results = dist2.run(pipeline_census_type, model_type)
    for equal, error, detail in results:
        assert not equal and error is not None and reason in error, (error, detail)


def test_pp2_forward_that_mixes_a_batchs_samples_is_refused_on_every_rank(dist2):
    """InstructBLIP fed one image token per row for its 32 query features scatters one sample's features into
    the next's tokens, across the batch: a micro-batch alone gets other values than its rows of the whole
    batch, which the first stage's probe sees (the pair of micro-batches run together and each alone) and
    refuses on both ranks, not trained wrong."""
    for equal, error, detail in dist2.run(pipeline_census_type, "instructblip", 1):
        assert not equal and error is not None and "mixes the samples" in error, (error, detail)


@pytest.mark.parametrize("model_type", ["trocr", "xlnet", "nemotron_h_omni"])
def test_pp2_census_types_trained_on_their_own_loss_match_one_process(dist2, model_type):
    """TrOCR's and XLNet's own losses are unshifted token cross-entropies (XLNet's later stages also get its
    token_type_ids, its segment matrix's input); Nemotron-H-Omni has no output head at its root: loss="auto"
    trains each on its own loss over pp=2 as one process (the loss and every stage's gradient)."""
    for equal, error, detail in dist2.run(pipeline_census_type, model_type):
        assert error is None and equal, (error, detail)


def test_learned_positions_of_floating_tokens_run_on_a_later_stage():
    """TrOCR's learned positions read `inputs_embeds[:, :, -1]`, a floating (batch, sequence) tensor: on a later
    stage their placeholder has the hidden width, and the two stages' logits equal the plain model's."""
    import copy
    import hyper_parallel as hp
    from hyper_parallel.tools.auto_models import build_model_type
    case = build_model_type("trocr", 0)
    plain = copy.deepcopy(case.model).eval()
    inputs = dict(case.inputs)
    ids = inputs.pop("input_ids")
    with torch.no_grad():
        want = plain(input_ids=ids, **inputs).logits
    pipe = hp.pipeline(case.model, hp.init_device_mesh("cpu", (1,), ("pp",)), schedule="interleaved_1f1b",
                       stages_per_rank=2, n_microbatches=2)
    pipe.eval()
    torch.testing.assert_close(pipe.eval_forward(ids, **inputs), want.float(), atol=1e-5, rtol=0)
