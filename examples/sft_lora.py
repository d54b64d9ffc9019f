"""TRL's SFTTrainer with LoRA on attention and on the experts, expert-parallel (DDP under the hood).

    torchrun --nproc-per-node 2 examples/sft_lora.py MODEL_DIR [PLAN]

SFTConfig's defaults stay on (bf16, activation checkpointing, the load-balancing loss). Each rank
trains the adapters of its own experts; the saved adapter is the one plain PEFT writes, loadable on
the base as the Hub ships it.
"""

import sys

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/auto-ep2.yaml"

model = hp_rewrite.from_pretrained(model_dir, plan=plan)
ids = torch.randint(3, model.config.vocab_size, (32, 64), generator=torch.Generator().manual_seed(0))
train = Dataset.from_dict({"input_ids": ids.tolist()})  # your dataset here (text or token ids)

lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
args = SFTConfig(output_dir="out/sft_lora", per_device_train_batch_size=2, max_steps=3, learning_rate=1e-4,
                 logging_steps=1, save_steps=3, report_to=[],
                 use_cpu=not torch.accelerator.is_available())  # bf16 (SFTConfig's default) on a CPU needs use_cpu
trainer = SFTTrainer(model=model, args=args, train_dataset=train, peft_config=lora,
                     processing_class=AutoTokenizer.from_pretrained(model_dir))
hp_rewrite.prepare_trainer(trainer)  # every rank, before train()
trainer.train()
trainer.save_model()                 # the adapter, as plain PEFT saves it
