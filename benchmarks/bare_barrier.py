"""The baseline: torchrun + init_process_group("gloo") + barrier, nothing else."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
