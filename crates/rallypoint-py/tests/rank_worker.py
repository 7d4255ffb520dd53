"""A rank run as a child process by the tests: `rank_worker.py ACTION`, settings
from the environment (RALLYPOINT_ADDR, RALLYPOINT_JOB, RANK, WORLD_SIZE).
Prints one line per event; the tests wait for them."""

import json
import signal
import sys
import time

import rallypoint as rp


def main() -> None:
    action = sys.argv[1]
    client = rp.Client.from_env(timeout=20.0)
    print("connected", client.rank, flush=True)
    if action == "collectives":
        client.barrier("start")
        gathered = client.all_gather(f"from {client.rank}".encode())
        seed = client.broadcast(b"42" if client.rank == 0 else None, root=0)
        print("result", json.dumps({"gathered": [g.decode() for g in gathered], "seed": seed.decode()}), flush=True)
        client.close()
    elif action == "idle":
        time.sleep(60)  # connected, never arrives: the test kills it
    elif action == "arrive-then-idle":
        for _ in range(2):
            client.barrier("b", timeout=30.0)
        print("arrived", flush=True)
        time.sleep(60)  # never arrives again: the test kills it
    elif action in ("barrier", "seated-barrier"):
        # Ctrl-C raises KeyboardInterrupt, as at a terminal, even when the tests run
        # as a background job of a shell, which starts them with SIGINT ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if action == "seated-barrier":
            # Through a node agent, a barrier's second call asks for a seat in the
            # agent's barrier channel; the third waits in it, in this thread.
            for _ in range(2):
                client.barrier("b", timeout=30.0)
        print("waiting", flush=True)
        started = time.monotonic()
        try:
            client.barrier("b", timeout=30.0)
            print("passed", flush=True)
        except rp.PeerLost as e:
            info = {"rank": e.rank, "pid": e.pid, "host": e.host, "reason": e.reason, "message": str(e)}
            print("peerlost", json.dumps(info), flush=True)
        except rp.ThisRankLost as e:
            info = {"rank": e.rank, "pid": e.pid, "reason": e.reason, "state": e.this.state, "message": str(e)}
            print("thisranklost", json.dumps(info), flush=True)
        except KeyboardInterrupt:
            print("interrupted", round(time.monotonic() - started, 3), flush=True)
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main()
