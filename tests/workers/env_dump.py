"""An unmodified torchrun script: init from the environment, one all_reduce, then record what it was given."""

import json
import os
import sys

STARTED_WARM = "torch" in sys.modules  # a warm worker's interpreter imported torch before the script ran

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "ELASTIC_ROUND",
    "ELASTIC_MEMORY_DIR",
]

dist.init_process_group()
total = torch.ones(1)
dist.all_reduce(total)
record = {name: os.environ.get(name) for name in NAMES}
record["all_reduce"] = total.item()
record["pid"] = os.getpid()
record.update(
    started_warm=STARTED_WARM,
    argv=sys.argv,
    path0=sys.path[0],
    file=__file__,
    name=__name__,
    main_is_this=sys.modules["__main__"].__dict__ is globals(),
    memory_dir_is_dir=os.path.isdir(os.environ.get("ELASTIC_MEMORY_DIR", "")),
)
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as out:
    json.dump(record, out)
dist.destroy_process_group()
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
