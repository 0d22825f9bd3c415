"""A plain torchrun script: init gloo from the environment, one all_reduce, then record its GLOO_SOCKET_IFNAME."""

import json
import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
record = {
    "rank": int(os.environ["RANK"]),
    "world_size": dist.get_world_size(),
    "all_reduce": total.item(),
    "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as out:
    json.dump(record, out)
dist.destroy_process_group()
