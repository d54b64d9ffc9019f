"""accelerate, expert-parallel (DDP under the hood), with gradient accumulation and clipping.

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py MODEL_DIR [PLAN]
"""

import sys

import torch
from accelerate import Accelerator

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/auto-ep2.yaml"

model = hp_rewrite.from_pretrained(model_dir, plan=plan)  # first: under torchrun it starts the process group
accelerator = Accelerator(gradient_accumulation_steps=2)
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
vocab = accelerator.unwrap_model(model).config.vocab_size

data = torch.Generator().manual_seed(accelerator.process_index)  # your data loader here
for step in range(6):
    ids = torch.randint(0, vocab, (2, 64), generator=data).to(accelerator.device)
    with accelerator.accumulate(model):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # each expert counted once
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"step {step}: loss {loss.item():.4f}")

accelerator.unwrap_model(model).save_pretrained("out/accelerate_ddp")  # every rank: the experts gathered
accelerator.end_training()
