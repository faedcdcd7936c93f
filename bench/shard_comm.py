"""Tensor-parallel communication and speed of `hyper_parallel.shard`.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 bench/shard_comm.py [--iters 5] [--skip-timing] [--train-only]

Part 1 counts the collectives of one forward (and one forward+backward) of a tiny TP=2 Llama with
`comm_counter()`, per decoder layer (counted between the layer's own pre- and post-hooks), against the
Megatron minimum: one all-reduce of the hidden states after attention and one after the MLP.
Part 2 times one forward of a small Llama (hidden 1024, 4 layers, seq 256) at TP=1 on plain tensors,
at TP=2 with `shard` and at TP=2 with torch's `parallelize_module` (ColwiseParallel/RowwiseParallel
on the same projections), in the same run, and prints the ratios. Part 3 (`--train-only` runs just it)
times a training step (forward with labels, backward, AdamW step) of a Llama hidden 512 the same way.
"""
from __future__ import annotations

import argparse
import copy
import time
from collections import Counter

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.parallel.shard.plan import sequence_parallel_plan

LAYER_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
              "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
              "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
              "model.layers.*.mlp.down_proj": "rowwise"}


def llama(hidden, layers, heads, kv_heads, inter, vocab, seed=0):
    import transformers as T
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                        tie_word_embeddings=False)
    return T.LlamaForCausalLM(cfg).eval()


def say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ---- part 1: collectives per decoder layer ---------------------------------------------------------
def per_layer_counts(model, run):
    """Run `run()` under comm_counter; return the collectives inside each decoder layer and in total."""
    layers = model.model.layers
    marks, handles = {}, []
    state = {}

    def pre(i):
        def hook(mod, args, kwargs):
            marks[i] = (Counter(state["c"].counts), Counter(state["c"].bytes))
        return hook

    def post(i):
        def hook(mod, args, kwargs, out):
            c0, b0 = marks[i]
            state.setdefault("layers", []).append((i, Counter(state["c"].counts) - c0, Counter(state["c"].bytes) - b0))
        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i), with_kwargs=True))
    with hp.comm_counter() as c:
        state["c"] = c
        run()
    for h in handles:
        h.remove()
    return state.get("layers", []), c


def part1():
    B, S, H = 2, 16, 64
    model = hp.shard(llama(H, 2, 4, 2, 128, 256), "auto")
    ids = torch.randint(0, 256, (B, S))
    hidden_bytes = B * S * H * 4
    say(f"\n== collectives, tiny Llama TP=2 (batch {B}, seq {S}, hidden {H}, 2 layers, plan='auto') ==")
    with torch.no_grad():
        layers, total = per_layer_counts(model, lambda: model(ids, use_cache=False))
    say("forward, per decoder layer:           measured                        Megatron minimum")
    for i, counts, nbytes in layers:
        say(f"  layer {i}: {dict(counts)!s:28} {dict(nbytes)!s:30} {{'all_reduce': 2}} "
            f"{{'all_reduce': {2 * hidden_bytes}}}")
    say(f"forward, whole model: {dict(total.counts)}  bytes {dict(total.bytes)}")
    say("  minimum for the whole model: 2 all_reduce per layer + 1 (vocab-parallel embedding) + 1 all_gather "
        "(vocab-parallel lm_head, gathered logits)")
    model.train()
    with hp.comm_counter() as c:
        model(ids, labels=ids, use_cache=False).loss.backward()
    say(f"forward+backward, whole model: {dict(c.counts)}  bytes {dict(c.bytes)}")
    say("  minimum: forward as above; backward mirrors it: 2 all_reduce per layer (input gradients of the "
        "column-parallel projections) + 1 for the lm_head input")

    say("\nwith sequence parallelism (plan.sequence_parallel_plan()): per decoder layer")
    sp = hp.shard(llama(H, 2, 4, 2, 128, 256), sequence_parallel_plan())
    with torch.no_grad():
        layers, total = per_layer_counts(sp, lambda: sp(ids, use_cache=False))
    for i, counts, nbytes in layers:
        say(f"  layer {i}: {dict(counts)!s:46} {dict(nbytes)!s:52} minimum {{'reduce_scatter': 2, 'all_gather': 2}} "
            f"{{'reduce_scatter': {2 * hidden_bytes}, 'all_gather': {hidden_bytes}}}")
    say(f"forward, whole model: {dict(total.counts)}  (+1 reduce_scatter after the embedding, +1 all_gather "
        f"before lm_head, +1 all_gather of the logits)")


# ---- part 2: timing ---------------------------------------------------------------------------------
def timed_interleaved(fns: dict, iters: int) -> dict:
    """Median time of each function; rounds alternate between them so that load changes hit all alike."""
    for fn in fns.values():
        fn()  # warm-up (decision caches, allocator)
    times = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    dist.barrier()
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def torch_tp(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                                         "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                         "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                         "mlp.down_proj": RowwiseParallel()})
    return model


def part2(iters):
    hidden, layers, seq = 1024, 4, 256
    ref = llama(hidden, layers, 16, 8, 2816, 32000)
    ids = torch.randint(0, 32000, (1, seq))
    say(f"\n== forward time, Llama hidden {hidden}, {layers} layers (16 heads, 8 KV heads, MLP 2816), seq {seq}, "
        f"vocab 32000, {torch.get_num_threads()} thread(s) per rank, median of {iters} interleaved rounds ==")
    variants = {"TP=1 plain": ref,
                "TP=2 hyper_parallel (layers plan)": hp.shard(copy.deepcopy(ref), LAYER_PLAN),
                "TP=2 hyper_parallel (plan='auto')": hp.shard(copy.deepcopy(ref), "auto"),
                "TP=2 torch parallelize_module": torch_tp(copy.deepcopy(ref))}
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        for label, model in variants.items():
            got = model(ids, use_cache=False).logits
            got = got.full_tensor() if isinstance(got, hp.DTensor) else got
            say(f"  {label:36} max |logits - plain| {(got - want).abs().max().item():.1e}")
        results = timed_interleaved({k: (lambda m=m: m(ids, use_cache=False)) for k, m in variants.items()}, iters)
    base = results["TP=1 plain"]
    torch_t = results["TP=2 torch parallelize_module"]
    for label, t in results.items():
        say(f"  {label:36} {t * 1e3:8.1f} ms   {t / base:5.2f}x plain   {t / torch_t:5.2f}x torch TP=2")


def part3(iters):
    """Training step (forward with labels, backward, AdamW step) at TP=2: shard(model, "auto") vs torch's
    parallelize_module with the equivalent plan (issue 19), TP=1 plain for scale."""
    hidden, layers, seq, vocab = 512, 2, 128, 8000
    ref = llama(hidden, layers, 8, 4, 1408, vocab)
    ids = torch.randint(0, vocab, (1, seq))
    say(f"\n== training step time, Llama hidden {hidden}, {layers} layers (8 heads, 4 KV heads, MLP 1408), seq {seq}, "
        f"vocab {vocab}, AdamW, {torch.get_num_threads()} thread(s) per rank, median of {iters} interleaved rounds ==")
    variants = {"TP=1 plain": copy.deepcopy(ref),
                "TP=2 hyper_parallel (plan='auto')": hp.shard(copy.deepcopy(ref), "auto"),
                "TP=2 torch parallelize_module": torch_tp(copy.deepcopy(ref))}
    steps = {}
    for label, model in variants.items():
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()
            opt.step()
        steps[label] = step
    results = timed_interleaved(steps, iters)
    base = results["TP=1 plain"]
    torch_t = results["TP=2 torch parallelize_module"]
    for label, t in results.items():
        say(f"  {label:36} {t * 1e3:8.1f} ms   {t / base:5.2f}x plain   {t / torch_t:5.2f}x torch TP=2")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--train-only", action="store_true", help="only the TP=2 training-step timing (part 3)")
    args = ap.parse_args()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    if args.train_only:
        part3(args.iters)
    else:
        part1()
        if not args.skip_timing:
            part2(args.iters)
            part3(args.iters)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
