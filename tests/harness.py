"""Run a test function on N real gloo processes on localhost, reusing the processes across tests.

`pool(n).run(fn, *args)` calls `fn(rank, world, *args)` on every rank and raises with every rank's
failure. `fn` must be a module-level function (workers import it by name). A rank that hangs past the
timeout gets the pool killed and rebuilt, so one bad test cannot block the rest.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import socket
import sys
import traceback

_POOLS: dict = {}
TIMEOUT = float(os.environ.get("HP_TEST_TIMEOUT", "240"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inbox, outbox, root: str) -> None:
    sys.path.insert(0, root)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), HYPER_PARALLEL_COMM_TIMEOUT=os.environ.get("HP_COMM_TIMEOUT", "120"),
                      OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, args = job
        try:
            fn = getattr(importlib.import_module(module), name)
            torch.manual_seed(1234)
            result = fn(rank, world, *args)
            outbox.put((rank, True, result))
        except BaseException:  # report every failure, including assertion errors
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    def __init__(self, world: int):
        self.world = world
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.inboxes[r], self.outbox, root),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = TIMEOUT) -> list:
        """Run fn(rank, world, *args) on every rank; return the per-rank results."""
        for q in self.inboxes:
            q.put((fn.__module__, fn.__name__, args))
        results, failures = {}, []
        import queue
        for _ in range(self.world):
            try:
                # once a rank failed, its peers may wait in a collective forever: give them a short grace
                rank, ok, value = self.outbox.get(timeout=timeout if not failures else 20)
            except queue.Empty:
                self.close(force=True)
                self._start()
                raise AssertionError(f"{fn.__name__}: ranks {sorted(set(range(self.world)) - set(results))} "
                                     f"did not finish within {timeout}s (pool restarted)"
                                     + "".join(failures))
            results[rank] = value
            if not ok:
                failures.append(f"\n--- rank {rank} ---\n{value}")
        if failures:
            # a failed rank can leave its peers inside a collective: rebuild the pool to be safe
            self.close(force=True)
            self._start()
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} of {self.world} ranks:" + "".join(failures))
        return [results[r] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        for q, p in zip(self.inboxes, self.procs):
            if force:
                p.kill()
            else:
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def pool(world: int) -> Pool:
    if world not in _POOLS:
        _POOLS[world] = Pool(world)
    return _POOLS[world]


def close_all() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


def assert_generate_and_step_equal(model, ref, inputs: dict, labels: dict, max_new_tokens: int, tol: dict):
    """A parallel model against its single-process reference on the same global batch: `generate` gives the same
    tokens, and one training step the same loss and, by name, the same gradient for every parameter (None where
    the reference's is None). Returns the generated tokens and the parallel model's loss."""
    import torch

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    with torch.no_grad():
        want = ref.generate(**inputs, max_new_tokens=max_new_tokens)
        got = full(model.generate(**inputs, max_new_tokens=max_new_tokens))
    assert torch.equal(got, want), (got, want)
    ref.train()
    model.train()
    loss_ref = ref(**inputs, **labels).loss
    loss = model(**inputs, **labels).loss
    torch.testing.assert_close(full(loss), loss_ref, **tol)
    loss_ref.backward()
    loss.backward()
    named_ref = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if named_ref[n].grad is None:
            assert p.grad is None, f"{n}: a gradient where one process has none"
            continue
        torch.testing.assert_close(full(p.grad), named_ref[n].grad, **tol, msg=f"grad of {n}")
    return got, loss
