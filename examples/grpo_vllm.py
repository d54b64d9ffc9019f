"""TRL's GRPOTrainer with vLLM colocated, expert-parallel, the experts vLLM chose replayed in training.

    torchrun --nproc-per-node 2 examples/grpo_vllm.py MODEL_DIR [PLAN]

The plan turns on rollout routing replay (routing.replay_rollout: true, plans/grpo-ep2.yaml). TRL
builds its vLLM engine inside hp_rewrite.vllm_returns_routes(), so vLLM returns the experts it routed
each token to; prepare_trainer makes TRL's weight sync send vLLM what save_pretrained writes (full
tensors under the Hub's names) and the training forwards replay vLLM's routes.
"""

import sys

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

import hp_rewrite

model_dir = sys.argv[1]
plan = sys.argv[2] if len(sys.argv) > 2 else "plans/grpo-ep2.yaml"


def reward(completions, **kwargs):  # your reward here
    return [float(len(c)) for c in completions]


model = hp_rewrite.from_pretrained(model_dir, plan=plan)
prompts = Dataset.from_dict({"prompt": [f"t{3 + i} t{4 + i} t{5 + i}" for i in range(16)]})  # your prompts here
args = GRPOConfig(output_dir="out/grpo_vllm", use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=4,
                  num_generations=4, max_completion_length=8, max_steps=2, learning_rate=1e-5, logging_steps=1,
                  report_to=[], use_cpu=not torch.accelerator.is_available())  # bf16 (the default) on a CPU needs use_cpu
with hp_rewrite.vllm_returns_routes():  # TRL's vLLM engine returns the experts it chose
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                          processing_class=AutoTokenizer.from_pretrained(model_dir))
hp_rewrite.prepare_trainer(trainer)  # every rank: weight sync, route replay, saves, moe/ logs
trainer.train()
trainer.save_model()
