"""Your own training loop on a mixed cluster: a Hugging Face GPT-2 built from a small config (no download), AdamW,
warm-up + cosine schedule, gradient clipping and a held-out evaluation, written as a Ray Train loop.

Each worker computes its share of every global batch (2 : 1 per A100 and V100 here); ``prepare_model`` makes the
backward give every worker the full-batch mean gradient, so clipping and the schedule act as in one process.

    ray job submit --working-dir . -- python examples/own_loop.py [--steps N] [--json]
    ray job submit --working-dir . -- python examples/own_loop.py --check   # against one process: split_max_abs
    python examples/own_loop.py --start-cluster --check                   # no cluster: starts an emulated one

The cluster's nodes carry emulated devices (``--start-cluster`` starts CONFIG's for the run); on real GPUs drop
``emulation`` from CONFIG and name your devices.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import ray
import ray.train
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from transformers import GPT2Config, GPT2LMHeadModel

from hetero_ray.cluster.emulation import EmulatedCluster
from hetero_ray.train import HeteroTrainer, all_reduce_mean, get_context, prepare_data_loader, prepare_model
from hetero_ray.train.data import GlobalBatches, collate
from hetero_ray.workloads.gpt import ByteWindows, stdlib_corpus

MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
CORPUS_BYTES, HELD_OUT = 200_000, 48
LOOP = {"lr": 1e-3, "warmup": 3, "min_lr": 1e-4, "clip": 1.0, "eval_every": 10, "checkpoint_every": 5, "seed": 7}
CONFIG = {
    "devices": {"A100-80GB": 2, "V100-16GB": 2},
    "emulation": {"dilation": 150_000},
    # What the planner profiles: the same GPT-2 as build_model's.
    "workload": {"name": "hf-gpt2", "options": {**MODEL, "corpus_bytes": CORPUS_BYTES}},
    "train": {
        "global_batch": 12,
        "precision": "fp32",
        "split": {"A100-80GB": 2, "V100-16GB": 1},
        # A100s take their 4 samples in two micro-batches of 2: the loop accumulates them.
        "max_micro_batch": 2,
        "seed": LOOP["seed"],
    },
    "run": {"name": "own-loop", "storage_path": "~/hetero-ray-runs"},
}


def build_model() -> GPT2LMHeadModel:
    """GPT-2 from a config: no weights to fetch, no dropout (runs are reproducible)."""
    config = GPT2Config(
        n_layer=MODEL["n_layer"],
        n_head=MODEL["n_head"],
        n_embd=MODEL["n_embd"],
        n_positions=MODEL["block_size"],
        vocab_size=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config)


def byte_windows() -> ByteWindows:
    """Bytes of the Python standard library's sources as tokens: on every machine, nothing to download."""
    return ByteWindows(stdlib_corpus(CORPUS_BYTES), MODEL["block_size"])


def next_byte_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def schedule(optimizer, steps: int, cfg: dict):
    """Linear warm-up, then cosine decay to ``min_lr`` at the last step: torch's own schedulers."""
    warmup = cfg["warmup"]
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / warmup, total_iters=warmup - 1),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps - 1 - warmup, eta_min=cfg["min_lr"]),
        ],
        milestones=[warmup],
    )


def train_loop_per_worker(cfg: dict) -> None:
    """One worker: its share of each global batch, in micro-batches of ``get_context().micro_batch``."""
    ctx = get_context()
    torch.manual_seed(cfg["seed"])  # the same initial weights on every worker
    model = prepare_model(build_model())
    data = byte_windows()
    train_set = Subset(data, range(len(data) - HELD_OUT))
    loader = prepare_data_loader(DataLoader(train_set, batch_size=ctx.global_batch))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    lr_schedule = schedule(optimizer, cfg["steps"], cfg)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        lr_schedule.load_state_dict(state["schedule"])
        step = state["step"] + 1
    held_out = torch.arange(len(data) - HELD_OUT, len(data))
    resumed_from = step
    epoch = step // len(loader)
    while step < cfg["steps"]:
        loader.batch_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * len(loader) + i < step:
                continue  # resumed mid-epoch: these batches were trained on
            parts = list(zip(x.split(ctx.micro_batch), y.split(ctx.micro_batch)))
            loss_sum = 0.0
            for k, (xm, ym) in enumerate(parts):
                last = k == len(parts) - 1
                with nullcontext() if last else model.no_sync():  # only the last backward sums over workers
                    loss = next_byte_loss(model, xm, ym)
                    (loss * len(xm) / len(x)).backward()  # the mean over this worker's share
                loss_sum += float(loss) * len(xm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            optimizer.step()
            optimizer.zero_grad()
            lr_schedule.step()
            metrics = {
                "step": step,
                "loss": all_reduce_mean(loss_sum / len(x)),
                "lr": lr_schedule.get_last_lr()[0],
                "resumed_from_step": resumed_from,
            }
            if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
                model.eval()
                with torch.no_grad():
                    metrics["eval_loss"] = float(next_byte_loss(model, *collate(data, held_out)))
                model.train()
            save = (step + 1) % cfg["checkpoint_every"] == 0 or step + 1 == cfg["steps"]
            _report(metrics, model, optimizer, lr_schedule, step, save)
            step += 1
            if step == cfg["steps"]:
                break
        epoch += 1


def _report(metrics: dict, model, optimizer, lr_schedule, step: int, save: bool) -> None:
    """Every worker reports; when ``save``, the first attaches a checkpoint (the others hold the same state)."""
    if not save or ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as d:
        state = {
            "model": model.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "schedule": lr_schedule.state_dict(),
            "step": step,
        }
        torch.save(state, Path(d) / "state.pt")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))


def one_process(steps: int) -> dict[str, torch.Tensor]:
    """The same training in one process on the full global batch: what any split must reproduce."""
    torch.manual_seed(LOOP["seed"])
    model = build_model()
    data = byte_windows()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LOOP["lr"], weight_decay=0.0)
    lr_schedule = schedule(optimizer, steps, LOOP)
    batches = GlobalBatches(len(data) - HELD_OUT, CONFIG["train"]["global_batch"], LOOP["seed"])
    for step in range(steps):
        next_byte_loss(model, *collate(data, batches.indices(step))).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), LOOP["clip"])
        optimizer.step()
        optimizer.zero_grad()
        lr_schedule.step()
    return model.state_dict()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--storage", default=CONFIG["run"]["storage_path"], help="run.storage_path (a URI too)")
    parser.add_argument("--name", default=CONFIG["run"]["name"], help="the run's name under the storage path")
    parser.add_argument("--check", action="store_true", help="compare with one process; print split_max_abs")
    parser.add_argument("--json", action="store_true", help="print the final metrics as JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON printed to this file")
    parser.add_argument("--start-cluster", action="store_true", help="run on an emulated cluster started for it")
    args = parser.parse_args(argv)
    if args.steps <= LOOP["warmup"] + 1:
        parser.error(f"--steps: must be more than {LOOP['warmup'] + 1} (the warm-up and one cosine step)")
    if args.start_cluster:
        # Again in a process with the cluster's environment: Ray reads its address and auth mode at import.
        rest = [a for a in sys.argv[1:] if a != "--start-cluster"]
        with EmulatedCluster(CONFIG["devices"]) as cluster:
            return subprocess.run([sys.executable, __file__, *rest], env=cluster.env).returncode
    ray.init(address="auto")
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    trainer = HeteroTrainer(
        train_loop_per_worker,
        train_loop_config={**LOOP, "steps": args.steps},
        config={**CONFIG, "run": {"name": args.name, "storage_path": args.storage}},
    )
    result = trainer.fit()
    out = {
        "metrics": result.metrics,
        "checkpoint_path": result.checkpoint.path,
        "plan": trainer.prepared.plan.explanation,
    }
    if args.check:
        with result.checkpoint.as_directory() as d:
            trained = torch.load(Path(d) / "state.pt")["model"]
        reference = one_process(args.steps)
        split_max_abs = max(float((trained[k] - reference[k]).abs().max()) for k in reference)
        devices = [(r.gpu_type, r.local_batch, r.micro_batch) for r in trainer.prepared.plan.roles]
        out = {
            "split_max_abs": split_max_abs,
            "tolerance": 1e-5,
            "steps": args.steps,
            "split": devices,
            "emulated": CONFIG["emulation"].get("mode", "padded"),
            **out,
        }
    if args.output:
        args.output.write_text(json.dumps(out, indent=2))
    if args.check or args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"loss {result.metrics['loss']:.4f}, held-out {result.metrics['eval_loss']:.4f} at step {args.steps - 1}")
    return 0 if not args.check or out["split_max_abs"] <= out["tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
