"""torch.compile with hyper_parallel DTensors (`hp.compile`) against plain torch.compile and our eager, one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compile.py [--model llama_ref|llama_mid] [--repeat 20]
        [--subjects plain,plain_compiled,plain_layers,ours,ours_compiled,ours_model]

Why: issue 28. A model laid out with DTensors should compile to one graph per decoder layer and train at plain
compiled speed. One process, one thread, a world-size-1 gloo group, the single-card scenario (every parameter
and input a DTensor replicated on a 1-rank mesh, as bench/model_overhead.py's "ours"). Subjects:

- plain: the plain model, eager; plain_compiled: `torch.compile(model)` (whole model, the usual baseline);
  plain_layers: `torch.compile` of each decoder layer (torchtitan's per-block compile);
- ours: the DTensor model, eager; ours_compiled: `hp.compile(model)` (per decoder layer);
  ours_model: `hp.compile(model, units="model")` (the whole forward as one unit);
- ours_torch_compile (only when named in --subjects; it replaces bench/compile_explain.py): `torch.compile` applied to
  the DTensor model directly, the graph breaks hp.compile exists to avoid.

Per subject: graphs and graph breaks (plain: dynamo's counters over the warm-up; ours: the graphs hp.compile
compiled, which are whole by construction (layers with the same graph share one), and the units it ran eagerly,
with the reason), compile seconds (wall time of the first no-grad forward plus the first training
step, minus a warm forward and step), forward ms (no grad) and training step ms (forward with labels, backward,
AdamW) as medians of thread CPU time, subjects taking turns in blocks so that the machine's drift moves them
alike; ratios to plain_compiled and to ours. The first step's loss and the logits are compared with the plain
eager model's (max abs difference). One decoder layer's forward is also explained: plain by
`torch._dynamo.explain`, ours by `hyper_parallel.compiler.explain`. `llama_ref` is model_overhead's reference (hidden 64, 2 layers, sequence
16); `llama_mid` is larger (hidden 256, 4 layers, batch 2, sequence 128), where compute weighs more than the
per-op cost.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

OPTIMIZER_KWARGS: dict = {}  # --optimizer foreach / fused: for every subject alike
SUBJECTS = ("plain", "plain_compiled", "plain_layers", "ours", "ours_compiled", "ours_model")
OTHER_SUBJECTS = ("ours_torch_compile",)


def build(name: str, seed: int = 0):
    """(model, inputs, labels), use_cache off (a training step keeps no cache)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    if name == "llama_ref":
        import model_overhead as mo
        case = mo.build("llama_ref", seed)
        model, inputs, labels = case.model, case.inputs, case.labels
    elif name == "llama_mid":
        cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, pad_token_id=0,
                          bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        ids = torch.randint(1, 1000, (2, 128), generator=torch.Generator().manual_seed(seed))
        inputs, labels = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"labels": ids.clone()}
    else:
        raise SystemExit(f"unknown model {name!r}: llama_ref or llama_mid")
    model.config.use_cache = False
    return model, inputs, labels


def _layers(model):
    return model.model.layers


class Subject:
    def __init__(self, name: str, model_name: str):
        import hyper_parallel as hp
        import model_overhead as mo
        self.name = name
        model, inputs, labels = build(model_name)
        ours = name.startswith("ours")
        if ours:
            backend = mo.Ours()
            model = backend.prepare(model)
            inputs, labels = backend.wrap(inputs), backend.wrap(labels)
        if name == "plain_compiled":
            model = torch.compile(model, dynamic=False)
        elif name == "plain_layers":
            for i, layer in enumerate(_layers(model)):
                _layers(model)[i] = torch.compile(layer, dynamic=False)
        elif name == "ours_torch_compile":
            model = torch.compile(model, dynamic=False)
        elif name == "ours_compiled":
            hp.compile(model)
        elif name == "ours_model":
            hp.compile(model, units="model")
        self.model, self.inputs, self.labels = model, inputs, labels
        self.opt = None
        self.hp = hp
        self.times: dict = {"fwd": [], "train": []}

    def full(self, t):
        return t.full_tensor() if isinstance(t, self.hp.DTensor) else t

    def forward(self):
        self.model.eval()
        with torch.no_grad():
            return self.model(**self.inputs).logits

    def step(self):
        self.model.train()
        if self.opt is None:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, eps=1e-6, **OPTIMIZER_KWARGS)
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(**self.inputs, **self.labels).loss
        loss.backward()
        self.opt.step()
        return loss.detach()


def counters() -> tuple[int, int]:
    from torch._dynamo.utils import counters as c
    return c["stats"]["unique_graphs"], sum(c["graph_break"].values())


def layer_explain(model_name: str) -> dict:
    """Graphs and graph breaks of one decoder layer's forward (grad mode, as in training): plain through
    `torch._dynamo.explain`, ours through `hyper_parallel.compiler.explain` (the graph hp.compile makes)."""
    import model_overhead as mo
    from hyper_parallel.compiler import explain
    out = {}
    for name in ("plain", "ours"):
        model, inputs, _ = build(model_name)
        if name == "ours":
            backend = mo.Ours()
            model, inputs = backend.prepare(model), backend.wrap(inputs)
        seen = {}
        layer = _layers(model)[0]
        hook = layer.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
        model.train()
        model(**inputs)
        hook.remove()
        torch._dynamo.reset()
        ex = (torch._dynamo.explain(layer) if name == "plain" else
              lambda *a, **k: explain(layer, *a, **k))(*seen["args"], **seen["kwargs"])
        out[name] = (ex.graph_count, ex.graph_break_count, ex.op_count)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama_ref")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--subjects", default=",".join(SUBJECTS))
    ap.add_argument("--optimizer", choices=("default", "foreach", "fused"), default="default",
                    help="the training step's AdamW: torch's default for the device (on CPU the per-tensor loop), "
                         "foreach=True or fused=True")
    args = ap.parse_args()
    if args.optimizer != "default":
        OPTIMIZER_KWARGS[args.optimizer] = True
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29614")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import transformers
    transformers.logging.set_verbosity_error()
    torch._dynamo.config.cache_size_limit = 64
    # compile seconds are honest only without the on-disk caches earlier runs filled
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.compile(lambda x: x.sin() + 1)(torch.ones(3))  # inductor's one-time start, charged to no subject
    names = [s.strip() for s in args.subjects.split(",") if s.strip()]
    rows = {}
    ref_logits = ref_loss = None
    subjects = []
    for name in names:
        torch._dynamo.reset()
        g0, b0 = counters()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s = Subject(name, args.model)
            t0 = time.perf_counter()
            logits = s.full(s.forward()).detach()
            loss = s.full(s.step())
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            s.forward()
            s.step()
            warm = time.perf_counter() - t0
        g1, b1 = counters()
        if name == "plain":
            ref_logits, ref_loss = logits, loss
        diff = ((logits - ref_logits).abs().max().item(), (loss - ref_loss).abs().item()) if ref_logits is not None \
            else (float("nan"), float("nan"))
        row = dict(graphs=g1 - g0, breaks=b1 - b0, eager="-", compile=max(0.0, first - warm), diff=diff, notes=[])
        if name in ("ours_compiled", "ours_model"):  # hp.compile hands its graphs to the backend without dynamo
            from hyper_parallel.compiler import unit_report
            rep = unit_report(s.model)
            units = [m.forward._hp_unit for m in s.model.modules() if hasattr(m.__dict__.get("forward"), "_hp_unit")]
            row["graphs"] = len({id(e.fn) for u in units for e in u.entries.values() if hasattr(e, "fn")})
            row["breaks"] = 0  # a lowered graph is whole by construction
            row["eager"] = sum(1 for r in rep if r["eager"])
            row["notes"] = [f"{r['name']}: {e}" for r in rep for e in r["eager"]]
        rows[name] = row
        subjects.append(s)
        print(f"  {name}: ready ({first:.1f} s first forward + step)", flush=True)
    layer = layer_explain(args.model)
    # timing: subjects take turns in blocks of 5 calls (the first untimed)
    clock = time.thread_time
    for metric in ("fwd", "train"):
        for _ in range(max(1, args.repeat // 4)):
            for s in subjects:
                fn = s.forward if metric == "fwd" else s.step
                fn()
                for _ in range(4):
                    t0 = clock()
                    fn()
                    s.times[metric].append((clock() - t0) * 1e3)
        gc.collect()
    med = {s.name: {m: statistics.median(s.times[m]) for m in ("fwd", "train")} for s in subjects}
    print(f"\n{args.model}, torch {torch.__version__}, 1 thread, fp32, AdamW {args.optimizer}, thread CPU time, "
          f"median of {4 * max(1, args.repeat // 4)} calls; load {os.getloadavg()[0]:.1f}\n")
    print("| subject | graphs | graph breaks | units run eagerly | compile s | forward ms | train step ms "
          "| vs plain compiled (fwd / step) | vs ours eager (fwd / step) | max diff logits / loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in subjects:
        r, m = rows[s.name], med[s.name]

        def ratio(base):
            b = med.get(base)
            return "-" if b is None else f"{m['fwd'] / b['fwd']:.2f}x / {m['train'] / b['train']:.2f}x"
        comp = "-" if s.name in ("plain", "ours") else f"{r['compile']:.1f}"
        print(f"| {s.name} | {r['graphs']} | {r['breaks']} | {r['eager']} | {comp} | {m['fwd']:.2f} | {m['train']:.2f} "
              f"| {ratio('plain_compiled')} | {ratio('ours')} | {r['diff'][0]:.1e} / {r['diff'][1]:.1e} |")
    print(f"\none decoder layer (training forward): plain torch._dynamo.explain {layer['plain'][0]} graph(s), "
          f"{layer['plain'][1]} break(s), {layer['plain'][2]} ops; ours hyper_parallel.compiler.explain "
          f"{layer['ours'][0]} graph(s), {layer['ours'][1]} break(s), {layer['ours'][2]} ops")
    for s in subjects:
        for note in rows[s.name]["notes"]:
            print(f"{s.name}: eager: {note}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
