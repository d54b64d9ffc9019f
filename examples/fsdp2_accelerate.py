"""accelerate's FSDP2 plugin, expert-parallel: the experts sharded over their replicas, the rest over the
world.

    torchrun --nproc-per-node 4 examples/fsdp2_accelerate.py MODEL_DIR [PLAN]
"""

import sys

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/auto-ep2.yaml"

model = hp_rewrite.from_pretrained(model_dir, plan=plan)
plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                        state_dict_type="SHARDED_STATE_DICT")
accelerator = hp_rewrite.prepare_accelerator(Accelerator(fsdp_plugin=plugin))  # before prepare()
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

data = torch.Generator().manual_seed(accelerator.process_index)  # your data loader here
for step in range(3):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=data).to(accelerator.device)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)  # every expert counted once
    optimizer.step()
    optimizer.zero_grad()
    accelerator.print(f"step {step}: loss {loss.item():.4f}")

accelerator.save_state("out/fsdp2_accelerate/state")  # model and optimizer, one distributed checkpoint
accelerator.end_training()
