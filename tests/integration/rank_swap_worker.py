"""For test_inprocess_rounds: one process in two rounds of a 2-rank world, its rank swapped in the second, ended
as elastic.run ends a round; prints the rows of an FSDP-sharded weight this rank holds in each round."""

import json
import sys

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elastic import process_groups

first_rank, store = int(sys.argv[1]), sys.argv[2]
process_groups.track_group_sockets()
for round_number, rank in enumerate([first_rank, 1 - first_rank]):
    dist.init_process_group("gloo", init_method=f"file://{store}.{round_number}", rank=rank, world_size=2)
    model = nn.Linear(4, 6)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    weight = model.weight.detach()  # an op DTensor propagates: what its caches answer
    print(json.dumps(dict(round=round_number, rank=rank, coordinate=list(weight.device_mesh.get_coordinate()))))
    dist.barrier()
    process_groups.abort_all()
    process_groups.destroy_all()
    process_groups.forget_device_meshes()
