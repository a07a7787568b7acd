"""torch_serve.py — the --serve loop the PyTorch baselines of the benchmarks share (tide.results.server, the Lua
side, writes one JSON command per line to a FIFO and reads one JSON answer line per command from stdout)."""
import json
import sys


def serve_fifo(path, handle):
    """answers each command on the FIFO `path` with handle(command) -> a dict; "quit" answers {"ok": true} and
    ends the loop. Whatever a command raises is answered as {"error": ...}, so the caller never waits forever."""
    with open(path, "r") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            c = {}
            try:
                c = json.loads(line)
                out = {"ok": True} if c.get("cmd") == "quit" else handle(c)
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
            if isinstance(c, dict) and c.get("cmd") == "quit":
                return
