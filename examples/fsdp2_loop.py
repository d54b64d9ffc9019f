"""Your own loop with FSDP2, expert-parallel: hp_rewrite.fully_shard shards the experts over their
replicas and the rest over the world; a distributed checkpoint resumes at this or another EP size.

    torchrun --nproc-per-node 4 examples/fsdp2_loop.py MODEL_DIR [PLAN]
"""

import os
import sys

import torch
import torch.distributed as dist

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/auto-ep2.yaml"

model = hp_rewrite.from_pretrained(model_dir, plan=plan)
accelerator = torch.accelerator.current_accelerator()  # cuda, npu, xpu; None on a CPU-only machine
device = torch.device(accelerator.type, int(os.environ["LOCAL_RANK"])) if accelerator else torch.device("cpu")
model.to(device).train()
hp_rewrite.fully_shard(model)  # over the mesh the EP groups came from: ("efsdp", "ep")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

data = torch.Generator().manual_seed(dist.get_rank())  # your data loader here
for step in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=data).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # FSDP2 reduce-scatters: every gradient final here
    hp_rewrite.clip_grad_norm_(model.parameters(), 1.0)  # torch's own refuses parameters on two meshes
    optimizer.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0:
        print(f"step {step}: loss {loss.item():.4f}", flush=True)

hp_rewrite.save_checkpoint(model, optimizer, "out/fsdp2_loop")  # hp_rewrite.load_checkpoint resumes it
dist.destroy_process_group()
