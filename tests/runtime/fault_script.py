"""Training under a hand plan, in its own process, for the fault tests.

    python -m tests.runtime.fault_script MODE SWAP_DIR [STEPS]

MODE: `fsize` (a 64 KiB file-size limit: every swap write past it fails),
`fsize-nohost` (the same with a host pool too small to take anything),
`forever` (train until interrupted). Prints `step N loss X` and, at the end,
`report K=V ...`.
"""

from __future__ import annotations

import resource
import signal
import sys
import warnings

from runtime.api import offload
from tests.runtime.test_executor import hand_plan, train

mode, swap_dir = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
plan = hand_plan()
host = 1 << 30
if mode.startswith("fsize"):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
    host = 4096 if mode == "fsize-nohost" else host
warnings.simplefilter("always")


def show(step: int) -> None:
    print(f"step {step}", flush=True)


with offload(plan, swap_dir=swap_dir, backend="posix", host_mem_bytes=host) as ex:
    losses, params = train(10**9 if mode == "forever" else steps, hook=show)
for i, loss in enumerate(losses):
    print(f"loss {i} {loss!r}")
print(f"checksum {sum(float(p.double().sum()) for p in params)!r}")
s = ex.stats
print(f"report failed_writes={s.failed_writes} ssd={s.bytes_written.get('ssd', 0)} "
      f"host={s.bytes_written.get('host', 0)}")
