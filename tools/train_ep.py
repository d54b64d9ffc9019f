"""Fine-tune a MoE checkpoint expert-parallel for a few steps (example; CPU + gloo here).

    hp-rewrite make-tiny qwen3_moe /tmp/tiny
    torchrun --standalone --nproc-per-node 2 tools/train_ep.py /tmp/tiny --plan plans/auto-ep2.yaml --steps 5
"""

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hp_rewrite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--plan", default="plans/auto-ep2.yaml")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    with hp_rewrite.auto_patch(args.plan):  # from_pretrained returns the expert-parallel model
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, attn_implementation="eager")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)  # every rank its own batch (data parallel)
    for step in range(args.steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        hp_rewrite.sync_gradients(model)  # replicated grads: world mean; expert grads: see the contract
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach().clone(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step}: loss {mean.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
