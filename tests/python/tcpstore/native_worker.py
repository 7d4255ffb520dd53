"""A rank of the rallypoint package under `rallypoint launch`: all pass barrier
'warmup'; then rank FAIL_RANK drops its client without closing it (lost to its peers
at once) and exits 3 a little later, while its peers, told, drop theirs too and
linger (until the launcher takes them down). The peers' connections close before the
failed rank is reaped: the launcher must still name the failed rank, not a peer."""

import os
import sys
import time

import rallypoint as rp

rank = int(os.environ["RANK"])
client = rp.Client.from_env()
client.barrier("warmup", timeout=60)
if rank == int(os.environ["FAIL_RANK"]):
    del client
    time.sleep(0.3)
    sys.exit(3)
try:
    client.barrier("step", timeout=60)
except rp.PeerLost as error:
    print(f"rank {rank} told: {error}", flush=True)
    del client
    time.sleep(1.5)
    sys.exit(4)
