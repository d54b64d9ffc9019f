"""Your own training loop under DDP, expert-parallel.

    torchrun --nproc-per-node 2 examples/loop_ddp.py MODEL_DIR [PLAN]

The model first: under torchrun the load starts the process group (nccl on GPUs, gloo on CPUs) and
each rank keeps only its share of the experts. DDP reduces the replicated weights and hp-rewrite the
experts, so every gradient is the unmodified model's. Without DDP, call hp_rewrite.sync_gradients(model)
after each backward instead.
"""

import os
import sys

import torch
import torch.distributed as dist

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/auto-ep2.yaml"

model = hp_rewrite.from_pretrained(model_dir, plan=plan)  # each rank: its experts, the rest whole
print(f"rank {dist.get_rank()} ({dist.get_backend()}): {model.hp_rewrite.summary}", flush=True)
accelerator = torch.accelerator.current_accelerator()  # cuda, npu, xpu; None on a CPU-only machine
device = torch.device(accelerator.type, int(os.environ["LOCAL_RANK"])) if accelerator else torch.device("cpu")
model.to(device).train()
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

data = torch.Generator().manual_seed(dist.get_rank())  # your data loader here: each rank its own batches
for step in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=data).to(device)
    loss = ddp(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the global norm: each expert counted once
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)

model.save_pretrained("out/loop_ddp")  # every rank: the experts are gathered, rank 0 writes the Hub's layout
dist.destroy_process_group()
