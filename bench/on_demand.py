"""An evaluation, or a checkpoint, between steps under teraio: the iterations that hold them,
run on demand.

    python bench/on_demand.py [--runs 3] [--budget 50%]

Three cases. The training loop of tests/compat/scripts/eval_and_checkpoint.py evaluates after
step 4, or (keys ``save_``) saves the model's and optimizer's state dicts with torch.save then,
so iteration 5's ops leave the plan and it runs on demand (NOTE [ On demand within the budget ]
in runtime/executor.py; NOTE [ Streamed saves ] in runtime/saves.py). The loop of
tests/compat/scripts/background_save.py (keys ``background_save_``) saves the same after steps 3
and 4 on a thread of its own, while the next step trains, at the smallest budget. Each case is
profiled and planned at ``--budget`` of its peak (the third at ``min``), then run ``--runs``
times with the same plan, with and without ``--hold-on-demand``, each beside a plain run of the
script (same losses required). Per run: the largest tracked peak over the budget of the
iterations run on demand, their median time over the median of the iterations that followed
the plan, and the tensors sent out. Ends with one line of key=value figures (medians over the
runs).
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

SCRIPTS = ROOT / "tests" / "compat" / "scripts"
CASES = {  # key prefix -> the script, its arguments, the budget (None: --budget)
    "": (SCRIPTS / "eval_and_checkpoint.py", ["--eval-after", "4"], None),
    "save_": (SCRIPTS / "eval_and_checkpoint.py", ["--save-after", "4"], None),
    "background_save_": (SCRIPTS / "background_save.py", ["--overlap"], "min"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", default="50%", help="teraio plan --gpu-mem (default 50%% of the peak)")
    args = ap.parse_args()
    figures: dict[str, dict[str, list[float]]] = {}
    for case, (script, case_args, budget_arg) in CASES.items():
        with tempfile.TemporaryDirectory(prefix="teraio-on-demand-") as d:
            tmp = Path(d)
            script_args = [*case_args, "--checkpoint-dir", str(tmp)]
            sh(*teraio("profile", script, "--out", tmp / "prof", "--", *script_args))
            sh(*teraio("plan", tmp / "prof", "--gpu-mem", budget_arg or args.budget, "--ssd-bw", "2",
                       "--host-mem", "64M", "--out", tmp / "plan.json"))
            for i in range(args.runs):
                plain = sh(sys.executable, script, *script_args, quiet=True)
                for mode, opts in (("", []), ("held_", ["--hold-on-demand"])):
                    report = tmp / f"run{i}.json"
                    run = quiet.sh(*teraio("run", "--plan", tmp / "plan.json", "--swap-dir", tmp, "--report",
                                           report, *opts, script, "--", *script_args), label=f"run {i} {case}{mode}")
                    if losses(run.stdout) != losses(plain.stdout):
                        raise SystemExit("on_demand: the losses under teraio differ from the plain run's")
                    r = json.loads(report.read_text())
                    budget, times = r["predicted"]["gpu_mem_bytes"], r["iteration_s"]
                    ran = list(enumerate(zip(times, r["iteration_followed"], r["iteration_peak_bytes"], strict=True)))
                    followed = [t for k, (t, f, _) in ran if k and f]
                    on_demand = [(k, t, p) for k, (t, f, p) in ran if k and not f]
                    got = figures.setdefault(case + mode, {"peak": [], "slower": [], "sent": []})
                    got["peak"].append(max(p for _, _, p in on_demand) / budget)
                    got["slower"].append(statistics.median(t for _, t, _ in on_demand) / statistics.median(followed))
                    got["sent"].append(r.get("evictions", 0))  # absent before --hold-on-demand
                    print(f"run {i} {script.name} {' '.join(case_args)} {' '.join(opts) or 'default'}: iterations "
                          f"{', '.join(str(k) for k, _, _ in on_demand)} on demand: peak {got['peak'][-1]:.3f}x "
                          f"the budget of {budget / 2**20:.1f} MiB, {got['slower'][-1]:.2f}x the followed "
                          f"iterations' median time; {got['sent'][-1]} tensors sent out; losses equal", flush=True)
    print(quiet.TALLY.line())
    print(" ".join(f"{mode}on_demand_peak_over_budget={statistics.median(f['peak']):.3f} "
                   f"{mode}on_demand_time_over_followed={statistics.median(f['slower']):.2f} "
                   f"{mode}evictions={statistics.median(f['sent']):g}" for mode, f in figures.items()))


if __name__ == "__main__":
    main()
