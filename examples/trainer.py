"""transformers Trainer, expert-parallel (DDP under the hood).

    torchrun --nproc-per-node 2 examples/trainer.py MODEL_DIR [PLAN]

Load first (under torchrun the load starts the process group), build the Trainer after, and call
hp_rewrite.prepare_trainer on every rank before train(): saves and checkpoints then gather the
rank-local experts, and a checkpoint resumes each rank's expert optimizer state.
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

args = TrainingArguments(output_dir="out/trainer", per_device_train_batch_size=2, max_steps=3, learning_rate=1e-4,
                         logging_steps=1, save_steps=3, report_to=[])
trainer = Trainer(model=model, args=args, train_dataset=train)
hp_rewrite.prepare_trainer(trainer)  # every rank, before train()
trainer.train()                      # trainer.train(resume_from_checkpoint=True) resumes bit for bit
trainer.save_model()                 # a checkpoint plain transformers loads
