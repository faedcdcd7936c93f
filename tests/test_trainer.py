"""Hugging Face Trainer with its default checkpointing on a parallel model (API.md §15): checkpoints every
`save_steps`, `resume_from_checkpoint` on the same or another layout / number of ranks, evaluation; always
against the same Trainer run in one plain process."""
from __future__ import annotations

import os

import pytest
import torch

import hyper_parallel as hp
from tests.harness import pool
from tests.test_workflow import SEQ, _TokenData, _full, tiny

STEPS, SAVE_EVERY, BATCH = 4, 2, 4
LAYOUTS = {  # name -> (mesh axis, parallelize kwargs)
    "hsdp": ("dp", {"hsdp": {"threshold": 0, "optimizer_level": "level3"}}),
    "tp": ("tp", {}),
}


class _EvalData(_TokenData):
    def __init__(self):
        self.rows = torch.randint(0, 96, (6, SEQ), generator=torch.Generator().manual_seed(5))


def _run(trainer_cls, model, out: str, batch: int, resume: str | None = None, **extra):
    """(training losses by step, eval losses by step, final parameters) of a 4-step run saving every 2 steps."""
    from transformers import TrainingArguments
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=3,
                             max_steps=STEPS, logging_steps=1, save_steps=SAVE_EVERY, eval_strategy="steps",
                             eval_steps=SAVE_EVERY, report_to=[], use_cpu=True, learning_rate=1e-2, seed=3,
                             disable_tqdm=True, max_grad_norm=0.5, lr_scheduler_type="linear", **extra)
    trainer = trainer_cls(model=model, args=args, train_dataset=_TokenData(), eval_dataset=_EvalData())
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # a Hugging Face folder in output_dir, beside the checkpoints
    history = trainer.state.log_history
    losses = {h["step"]: h["loss"] for h in history if "loss" in h}
    evals = {h["step"]: h["eval_loss"] for h in history if "eval_loss" in h}
    params = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    return losses, evals, params


def _parallel_model(layout: str, world: int, seed: int = 0):
    axis, kwargs = LAYOUTS[layout]
    model = tiny("llama")
    if seed:  # other weights than the checkpoint's: resuming must overwrite every one
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    return hp.parallelize(model, mesh, **kwargs), (BATCH // world if axis == "dp" else BATCH)


def trainer_checkpoint_resume(rank, world, tmp, saved_by, resumed_by):
    """Run 4 steps under `saved_by` (checkpoints at 2 and 4), then resume from step 2 under `resumed_by`."""
    from hyper_parallel.integrations.transformers import HyperParallelTrainer
    model, batch = _parallel_model(saved_by, world)
    whole = _run(HyperParallelTrainer, model, f"{tmp}/{saved_by}", batch)
    model, batch = _parallel_model(resumed_by, world, seed=7)
    resumed = _run(HyperParallelTrainer, model, f"{tmp}/{saved_by}-{resumed_by}", batch,
                   resume=f"{tmp}/{saved_by}/checkpoint-{SAVE_EVERY}")
    return whole, resumed


# Parameters after AdamW steps (lr 1e-2) against one device: AdamW divides each gradient entry by its own running
# RMS, so an entry near zero turns a reduction-order difference of 1e-8 in the gradient into 1e-5 in the update
# (1.1e-5 seen on tp=2). A dropped, doubled or misplaced gradient moves a parameter by about lr = 1e-2, 200x this.
PARAM_TOL = 5e-5


def _close(a: dict, b: dict, tol: float, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        x, y = a[k], b[k]
        diff = (x - y).abs().max().item() if isinstance(x, torch.Tensor) else abs(x - y)
        assert diff <= tol, (what, k, x, y)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The plain Trainer on one process: the reference for every parallel run (and its checkpoints)."""
    from transformers import Trainer
    out = str(tmp_path_factory.mktemp("one"))
    return out, _run(Trainer, tiny("llama"), out, BATCH)


@pytest.mark.parametrize("saved_by,resumed_by", [("hsdp", "hsdp"), ("tp", "tp"), ("hsdp", "tp")])
def test_trainer_resumed_run_equals_uninterrupted(tmp_path, one_device, saved_by, resumed_by):
    _, (losses, evals, params) = one_device
    assert sorted(losses) == [1, 2, 3, 4] and sorted(evals) == [2, 4]
    for whole, resumed in pool(2).run(trainer_checkpoint_resume, str(tmp_path), saved_by, resumed_by):
        _close(whole[0], losses, 1e-5, "uninterrupted loss vs one device")
        _close(whole[1], evals, 1e-5, "uninterrupted eval loss vs one device")
        _close(whole[2], params, PARAM_TOL, "uninterrupted parameters vs one device")
        same = 0.0 if saved_by == resumed_by else 1e-5  # the same ranks and layout repeat the run exactly
        # steps 1-2 come from the checkpoint's trainer_state.json, steps 3-4 from the resumed run
        _close(resumed[0], whole[0], same, "resumed loss vs uninterrupted")
        _close(resumed[1], whole[1], same, "resumed eval loss vs uninterrupted")
        _close(resumed[2], whole[2], same, "resumed parameters vs uninterrupted")
    ckpt = tmp_path / saved_by / f"checkpoint-{SAVE_EVERY}"
    assert {"hyper_parallel", "scheduler.pt", "trainer_state.json", "config.json", "rng_state_0.pth",
            "rng_state_1.pth"} <= set(os.listdir(ckpt))
    from transformers import AutoModelForCausalLM
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / saved_by))  # save_model kept the checkpoints
    assert (tmp_path / saved_by / f"checkpoint-{STEPS}").is_dir()
    _close(dict(saved.named_parameters()), params, PARAM_TOL, "save_model's folder vs one device")


def test_trainer_resumes_a_two_rank_checkpoint_in_one_process(tmp_path, one_device):
    """Another number of ranks: a checkpoint of 2 hsdp ranks resumed by one plain process."""
    from hyper_parallel.integrations.transformers import HyperParallelTrainer
    _, (losses, evals, params) = one_device
    pool(2).run(trainer_checkpoint_resume, str(tmp_path), "hsdp", "hsdp")
    model = tiny("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    got = _run(HyperParallelTrainer, model, str(tmp_path / "one"), BATCH,
               resume=str(tmp_path / "hsdp" / f"checkpoint-{SAVE_EVERY}"))
    _close(got[0], losses, 1e-5, "resumed loss vs one device")
    _close(got[1], evals, 1e-5, "resumed eval loss vs one device")
    _close(got[2], params, PARAM_TOL, "resumed parameters vs one device")


def best_model_at_end(rank, world, tmp):
    from hyper_parallel.integrations.transformers import HyperParallelTrainer
    model, batch = _parallel_model("hsdp", world)
    return _run(HyperParallelTrainer, model, tmp, batch, load_best_model_at_end=True)


def test_trainer_load_best_model_at_end(tmp_path):
    """The best checkpoint (the lowest eval loss: step 2's, not the last) is read back from its sharded state."""
    from transformers import Trainer
    want = _run(Trainer, tiny("llama"), str(tmp_path / "one"), BATCH, load_best_model_at_end=True)
    last = _run(Trainer, tiny("llama"), str(tmp_path / "last"), BATCH)[2]
    assert any(not torch.equal(want[2][n], last[n]) for n in last)  # the best is not the last step's model
    for got in pool(2).run(best_model_at_end, str(tmp_path / "hsdp")):
        _close(got[2], want[2], PARAM_TOL, "best model vs one device")


# ---- Trainer's mixed precision flags (autocast, as accelerate applies them) and TRL's SFTTrainer -------------
def test_trainer_bf16_flag_autocasts_as_plain_trainer(tmp_path):
    """bf16=True: accelerate wraps the forward in autocast; HyperParallelTrainer keeps that (minus DDP)."""
    from transformers import Trainer, TrainingArguments
    from hyper_parallel.integrations.transformers import HyperParallelTrainer

    def losses(cls, bf16):
        args = TrainingArguments(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=BATCH,
                                 max_steps=2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                                 learning_rate=1e-2, seed=3, disable_tqdm=True, bf16=bf16)
        trainer = cls(model=tiny("llama"), args=args, train_dataset=_TokenData())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    want = losses(Trainer, True)
    assert losses(HyperParallelTrainer, True) == want
    assert losses(Trainer, False) != want  # autocast changed the numbers: the check above can fail


def _sft_losses(cls, model, out: str, batch: int):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)},
                                                                                    unk_token="t0")),
                                        pad_token="t0", eos_token="t1", unk_token="t0")
    rows = torch.randint(2, 96, (16, SEQ), generator=torch.Generator().manual_seed(21))
    args = SFTConfig(output_dir=out, per_device_train_batch_size=batch, max_steps=3, logging_steps=1, report_to=[],
                     save_strategy="no", use_cpu=True, learning_rate=1e-2, seed=3, disable_tqdm=True,
                     max_length=SEQ, bf16=False)
    trainer = cls(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows.tolist()}),
                  processing_class=tokenizer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def sft_parallel(rank, world, tmp):
    from hyper_parallel.integrations.transformers import sft_trainer_class
    out = {}
    for layout in LAYOUTS:
        model, batch = _parallel_model(layout, world)
        out[layout] = _sft_losses(sft_trainer_class(), model, f"{tmp}/{layout}", batch)
    return out


def test_trl_sft_trainer_matches_one_device(tmp_path):
    pytest.importorskip("trl")
    from trl import SFTTrainer
    want = _sft_losses(SFTTrainer, tiny("llama"), str(tmp_path / "one"), BATCH)
    assert len(want) == 3
    for got in pool(2).run(sft_parallel, str(tmp_path)):
        for layout, losses in got.items():
            assert all(abs(a - b) <= 1e-5 for a, b in zip(losses, want)) and len(losses) == 3, (layout, losses, want)
