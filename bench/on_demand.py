"""An evaluation, or a checkpoint, between steps under teraio: the iteration that holds it,
run on demand.

    python bench/on_demand.py [--runs 3] [--budget 50%]

The training loop of tests/compat/scripts/eval_and_checkpoint.py evaluates after step 4 (or,
in the second case, saves the model's and optimizer's state dicts with torch.save then), so
iteration 5's ops leave the plan and it runs on demand (NOTE [ On demand within the budget ]
in runtime/executor.py; NOTE [ Streamed saves ] in runtime/saves.py). Each case is profiled
and planned at ``--budget`` of its peak, then run ``--runs`` times with the same plan, with and
without ``--hold-on-demand``, each beside a plain run of the script (same losses required). Per
run: iteration 5's tracked peak over the budget, its time over the median of the iterations
that followed the plan, and the tensors sent out in it. Ends with one line of key=value
figures (medians over the runs; the checkpoint case's keys start with ``save_``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import quiet
from demo import ROOT, losses, sh, teraio

SCRIPT = ROOT / "tests" / "compat" / "scripts" / "eval_and_checkpoint.py"
CASES = {"": ["--eval-after", "4"], "save_": ["--save-after", "4"]}  # key prefix -> the script's arguments


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", default="50%", help="teraio plan --gpu-mem (default 50%% of the peak)")
    args = ap.parse_args()
    figures: dict[str, dict[str, list[float]]] = {}
    for case, case_args in CASES.items():
        with tempfile.TemporaryDirectory(prefix="teraio-on-demand-") as d:
            tmp = Path(d)
            script_args = [*case_args, "--checkpoint-dir", str(tmp / "checkpoints")]
            sh(*teraio("profile", SCRIPT, "--out", tmp / "prof", "--", *script_args))
            sh(*teraio("plan", tmp / "prof", "--gpu-mem", args.budget, "--ssd-bw", "2", "--host-mem", "64M",
                       "--out", tmp / "plan.json"))
            for i in range(args.runs):
                plain = sh(sys.executable, SCRIPT, *script_args, quiet=True)
                for mode, opts in (("", []), ("held_", ["--hold-on-demand"])):
                    report = tmp / f"run{i}.json"
                    run = quiet.sh(*teraio("run", "--plan", tmp / "plan.json", "--swap-dir", tmp, "--report",
                                           report, *opts, SCRIPT, "--", *script_args), label=f"run {i} {case}{mode}")
                    if losses(run.stdout) != losses(plain.stdout):
                        raise SystemExit("on_demand: the losses under teraio differ from the plain run's")
                    r = json.loads(report.read_text())
                    budget, times = r["predicted"]["gpu_mem_bytes"], r["iteration_s"]
                    followed = [t for k, (t, f) in enumerate(zip(times, r["iteration_followed"], strict=True))
                                if k and f]
                    got = figures.setdefault(case + mode, {"peak": [], "slower": [], "sent": []})
                    got["peak"].append(r["iteration_peak_bytes"][5] / budget)
                    got["slower"].append(times[5] / statistics.median(followed))
                    got["sent"].append(r.get("evictions", 0))  # absent before --hold-on-demand
                    print(f"run {i} {' '.join(case_args)} {' '.join(opts) or 'default'}: iteration 5 (on "
                          f"demand) peak {got['peak'][-1]:.3f}x the budget of {budget / 2**20:.1f} MiB, "
                          f"{times[5] * 1e3:.1f} ms = {got['slower'][-1]:.2f}x the followed iterations' median; "
                          f"{got['sent'][-1]} tensors sent out; losses equal", flush=True)
    print(quiet.TALLY.line())
    print(" ".join(f"{mode}on_demand_peak_over_budget={statistics.median(f['peak']):.3f} "
                   f"{mode}on_demand_time_over_followed={statistics.median(f['slower']):.2f} "
                   f"{mode}evictions={statistics.median(f['sent']):g}" for mode, f in figures.items()))


if __name__ == "__main__":
    main()
