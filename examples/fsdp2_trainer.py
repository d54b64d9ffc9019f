"""transformers Trainer with FSDP2, expert-parallel: the experts sharded over their replicas, the rest over
the world.

    torchrun --nproc-per-node 4 examples/fsdp2_trainer.py MODEL_DIR [PLAN]

fsdp=True with fsdp_config's fsdp_version 2 (without fsdp=True transformers trains with DDP), and
hp_rewrite.prepare_trainer before train().
"""

import sys

import torch
from transformers import Trainer, TrainingArguments

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/auto-ep2.yaml"

model = hp_rewrite.from_pretrained(model_dir, plan=plan)
ids = torch.randint(0, model.config.vocab_size, (32, 64), generator=torch.Generator().manual_seed(0))
train = [{"input_ids": row, "labels": row} for row in ids]  # your tokenized dataset here

args = TrainingArguments(output_dir="out/fsdp2_trainer", per_device_train_batch_size=2, max_steps=3,
                         learning_rate=1e-4, logging_steps=1, save_steps=3, report_to=[], fsdp=True,
                         fsdp_config={"fsdp_version": 2, "reshard_after_forward": True,
                                      "state_dict_type": "SHARDED_STATE_DICT"})
trainer = Trainer(model=model, args=args, train_dataset=train)
hp_rewrite.prepare_trainer(trainer)  # every rank, before train()
trainer.train()
trainer.save_model()                 # a checkpoint plain transformers loads
