"""Run one of examples/ as written under torchrun, as a GPU machine would on these CPUs:
``torchrun ... tests/run_example.py examples/NAME.py ARGS...``.

Two things differ from a GPU machine and are put right here, outside the example: accelerate takes its
FSDP path (on a CPU it silently trains with DDP instead), forced as each Accelerator is built; vLLM's
engine, which does not run here, is the recording stand-in that generates with the checkpoint
(tests/vllm_standin.py) under TRL's real VLLMGeneration. After the example, each rank prints whether the
model it trained was sharded by FSDP2.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _accelerate_takes_fsdp() -> None:
    import accelerate

    from tests.fsdp_engine_script import force_fsdp

    build = accelerate.Accelerator.__init__

    def forced(self, *args, **kwargs):
        if kwargs.get("fsdp_plugin") is not None:  # Trainer passes its fsdp_config's plugin here too
            force_fsdp()
        build(self, *args, **kwargs)

    accelerate.Accelerator.__init__ = forced


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from tests.vllm_standin import vllm_standin

    example = Path(sys.argv[1])
    sys.argv = [str(example), *sys.argv[2:]]
    if "fsdp2" in example.name:
        _accelerate_takes_fsdp()
    with vllm_standin() if "vllm" in example.name else contextlib.nullcontext():
        names = runpy.run_path(str(example), run_name="__main__")
    trained = names.get("trainer").model_wrapped if "trainer" in names else names.get("model")
    sharded = any(isinstance(m, FSDPModule) for m in trained.modules())
    print(f"example {example.name} rank {dist.get_rank() if dist.is_initialized() else 0}: FSDP2 {sharded}",
          flush=True)


if __name__ == "__main__":
    main()
