"""A Hugging Face Trainer run as a user runs one, for test_hf.py:

    torchrun --nproc-per-node 2 hf_script.py --trainer stock|wfbp|priority|decoupled --out DIR
        [--accumulate N] [--clip X] [--bf16] [--no-use-cpu]

A 2-layer GPT-2 built from a config (no downloads) on random tokens, AdamW
with a linear warm-up schedule, 6 optimizer steps, then evaluate() and
save_model(). `stock` is transformers.Trainer (DDP over Gloo); the others are
hemiola.hf.Trainer with that schedule. Rank 0 writes DIR/result.pt: the
parameters, the logged gradient norms and losses, the evaluation loss, and
the largest difference between the ranks' parameters."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import hemiola.hf

parser = argparse.ArgumentParser()
parser.add_argument("--trainer", default="stock")
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--accumulate", type=int, default=1)
parser.add_argument("--clip", type=float, default=0.0)
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--save-every", type=int, default=0,
                    help="save a checkpoint (model, optimizer, scheduler) every N steps")
parser.add_argument("--no-use-cpu", action="store_true",
                    help="leave use_cpu off (transformers then does not distribute on a CPU)")
args = parser.parse_args()

torch.set_num_threads(1)
transformers.set_seed(1234)
config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = transformers.GPT2LMHeadModel(config)
tokens = torch.randint(0, 64, (128, 16), generator=torch.Generator().manual_seed(0))
train = [{"input_ids": x, "labels": x.clone()} for x in tokens]
held_out = [{"input_ids": x, "labels": x.clone()} for x in tokens[:16]]
training = transformers.TrainingArguments(
    output_dir=str(args.out / "run"), use_cpu=not args.no_use_cpu, report_to=[],
    save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 500,
    dataloader_num_workers=0, seed=1234, data_seed=1234, per_device_train_batch_size=4,
    per_device_eval_batch_size=4, gradient_accumulation_steps=args.accumulate,
    max_grad_norm=args.clip, max_steps=6, learning_rate=3e-3, warmup_steps=2,
    lr_scheduler_type="linear", optim="adamw_torch", weight_decay=0.01, bf16=args.bf16,
    logging_steps=1, disable_tqdm=True)
common = {"model": model, "args": training, "train_dataset": train, "eval_dataset": held_out}
if args.trainer == "stock":
    trainer = transformers.Trainer(**common)
else:
    trainer = hemiola.hf.Trainer(**common, schedule=args.trainer)
out = trainer.train()
metrics = trainer.evaluate()
trainer.save_model(str(args.out / "saved"))

state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
flat = torch.cat([v.float().reshape(-1) for v in state.values()])
every = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(every, flat)
if dist.get_rank() == 0:
    torch.save({
        "params": state, "steps": out.global_step, "eval_loss": metrics["eval_loss"],
        "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        "rank_spread": max((e - every[0]).abs().max().item() for e in every),
        "wrapped": type(trainer.model_wrapped).__name__,
        "saved": sorted(p.name for p in (args.out / "saved").iterdir()),
        "optimizer_states": {
            c.name: len(torch.load(c / "optimizer.pt", weights_only=False)["state"])
            for c in sorted((args.out / "run").glob("checkpoint-*"))},
        "parameters": sum(1 for p in trainer.model.parameters() if p.requires_grad),
    }, args.out / "result.pt")
