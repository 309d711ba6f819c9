"""`teraio profile` and `teraio inspect` as a user runs them: real subprocesses, real scripts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiles import read_profile
from tests.conftest import EXAMPLE, SMALL_GPT, run_teraio


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def one_line_error(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("teraio: error:")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr.split("teraio: error:")[0] or "raise" in stderr
    return errors[0]


def test_profile_writes_four_files_and_passes_script_args(tmp_path: Path) -> None:
    out = tmp_path / "p"
    r = run_teraio("profile", EXAMPLE, "--out", out, "--iters", "2", "--", *SMALL_GPT,
                   "--steps", "4")
    assert r.returncode == 0, r.stderr
    tables = ["accesses.parquet", "kernels.parquet", "meta.json", "tensors.parquet"]
    assert sorted(f.name for f in out.iterdir()) == sorted([*tables, "first_iteration"])
    assert sorted(f.name for f in (out / "first_iteration").iterdir()) == tables
    assert r.stdout.count("step ") == 2  # stopped inside the 3rd step (warm-up + 2), before its print
    assert r.stderr.count("(recorded)") == 2 and "(warm-up)" in r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["script_args"][-2:] == ["--steps", "4"] and meta["mode"] == "real"


def test_default_out_is_newest_under_profiles(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    write(script, "import torch\nw = torch.nn.Parameter(torch.ones(2))\n"
                  "o = torch.optim.SGD([w], lr=0.1)\n"
                  "for _ in range(3):\n    (w * 2).sum().backward(); o.step()\n")
    r = run_teraio("profile", script, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    made = [p for p in (tmp_path / "profiles").iterdir()]
    assert len(made) == 1 and made[0].name.startswith("tiny-")
    assert (made[0] / "meta.json").is_file()


def test_missing_script(tmp_path: Path) -> None:
    r = run_teraio("profile", tmp_path / "nope.py")
    assert r.returncode == 2
    assert "no such script" in one_line_error(r.stderr)


def test_script_that_raises_shows_its_traceback_and_leaves_nothing(tmp_path: Path) -> None:
    script = write(tmp_path / "boom.py", "def f():\n    raise ValueError('bad batch')\nf()\n")
    out = tmp_path / "p"
    r = run_teraio("profile", script, "--out", out)
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr
    assert 'boom.py", line 2, in f' in r.stderr and "ValueError: bad batch" in r.stderr
    assert "teraio/" not in r.stderr.split("ValueError")[0]  # no teraio frames
    assert "failed (exit status 1)" in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".p.tmp-*"))


def test_script_exit_code_is_passed_on(tmp_path: Path) -> None:
    script = write(tmp_path / "quit.py", "import sys\nsys.exit(7)\n")
    r = run_teraio("profile", script, "--out", tmp_path / "p")
    assert r.returncode == 7
    assert not (tmp_path / "p").exists()


def test_script_without_optimizer(tmp_path: Path) -> None:
    script = write(tmp_path / "noopt.py", "import torch\nx = torch.ones(3) * 2\nprint('done')\n")
    r = run_teraio("profile", script, "--out", tmp_path / "p")
    assert r.returncode == 2
    assert "no iteration boundary seen: " in one_line_error(r.stderr)
    assert "teraio.mark_iteration()" in r.stderr
    assert not (tmp_path / "p").exists()


def test_a_script_that_trains_in_processes_it_spawns_is_told_to_use_torchrun(tmp_path: Path) -> None:
    """Training in processes the script starts (``torch.multiprocessing.spawn``) is not seen; the
    error said to call ``teraio.mark_iteration()``, which the spawned process has no teraio for."""
    script = write(tmp_path / "spawned.py", (
        "import torch, torch.multiprocessing as mp\n"
        "def train(rank):\n"
        "    w = torch.nn.Parameter(torch.ones(4))\n"
        "    opt = torch.optim.SGD([w], lr=0.1)\n"
        "    for _ in range(4):\n"
        "        (w * w).sum().backward(); opt.step(); opt.zero_grad()\n"
        "if __name__ == '__main__':\n"
        "    mp.spawn(train, nprocs=1)\n"))
    r = run_teraio("profile", script, "--out", tmp_path / "p")
    assert r.returncode == 2, r.stderr
    assert "built no torch.optim optimizer in this process" in one_line_error(r.stderr)
    assert "torchrun" in r.stderr and "--nproc" in r.stderr


def test_an_optimizer_never_stepped_is_named(tmp_path: Path) -> None:
    """Two optimizers built, one stepped every step and one never (its layers frozen): no
    boundary, and the error says which optimizer it waited for, not that none stepped (the
    optimizers are locals of ``main``, gone when the script ends)."""
    script = write(tmp_path / "idle.py", (
        "import torch\n"
        "def main():\n"
        "    head, body = torch.nn.Linear(8, 2), torch.nn.Linear(8, 8)\n"
        "    opt_head = torch.optim.SGD(head.parameters(), lr=0.1)\n"
        "    opt_body = torch.optim.AdamW(body.parameters(), lr=0.1)\n"
        "    for _ in range(4):\n"
        "        head(body(torch.randn(4, 8)).detach()).sum().backward()\n"
        "        opt_head.step()\n"
        "main()\n"))
    r = run_teraio("profile", script, "--out", tmp_path / "p")
    assert r.returncode == 2
    error = one_line_error(r.stderr)
    assert "every torch.optim optimizer the script built has stepped, and 1 never did" in error
    assert "(AdamW over 2 parameters)" in error and "teraio.mark_iteration()" in error


def test_script_too_short(tmp_path: Path) -> None:
    r = run_teraio("profile", EXAMPLE, "--out", tmp_path / "p", "--iters", "5", "--",
                   *SMALL_GPT, "--steps", "2")
    assert r.returncode == 2
    assert "ended after 2 iterations" in one_line_error(r.stderr)


ALTERNATING = {  # what changes every other step: (the step's lines, what the profile should say)
    "length": ("""
    x = torch.randn(6 if step % 2 == 0 else 9, 4, 8)
    h = torch.zeros(4, 16)
    for t in range(x.shape[0]):
        h = cell(x[t], h)
    loss = h.square().mean()
""", "its tensor sizes differ, and then its ops", True),
    # a branch into a layer like the one it skips: the same op names on another parameter (a sweep
    # found it told to pad its batches)
    "branch": ("""
    h = cell(torch.randn(4, 8), torch.zeros(4, 16))
    loss = (extra(h) if step % 2 else head(h)).square().mean()
""", "(an evaluation or checkpoint between steps, or a branch some steps take?)", False),
    # an evaluation every other step, from the first recorded one: the evaluations are alike first
    # and kept, and the training steps set aside (a sweep's transformers Trainer was asked whether
    # its training step was an evaluation)
    "evaluation kept": ("""
    h = cell(torch.randn(4, 8), torch.zeros(4, 16))
    loss = head(h).square().mean()
    if step % 2 == 1:
        with torch.no_grad():
            head(cell(torch.randn(4, 8), torch.zeros(4, 16))).sum()
""", "It runs fewer ops than the kept iterations, 79 against 100: if those hold an evaluation or a checkpoint that "
        "comes every few steps, keep training steps instead: start recording at iteration 2 (--warmup 2)", False),
    # a smaller last batch of a data set made before the loop, which is carried into iteration 1 and
    # long-lived from iteration 2 under another id (a review found it said to run other ops)
    "last batch": ("""
    h = cell(data[8 * (step % 3):8 * (step % 3) + 8], torch.zeros(len(data[8 * (step % 3):8 * (step % 3) + 8]), 16))
    loss = head(h).square().mean()
""", "(its tensor sizes differ: a smaller last batch, or dynamic padding?", True),
}


@pytest.mark.parametrize("change", ALTERNATING)
def test_a_step_set_aside_is_said_to_differ_in_what_it_differs_in(change: str, tmp_path: Path) -> None:
    """Batches of two lengths over a loop of the length's steps: the set-aside iterations' sizes
    differ first, then their ops, and the profile says to pad, rather than asking about an
    evaluation (a sweep's packed sequences of two lengths were asked that). A branch into another
    layer of the same ops: its ops differ, though their tensors' sizes differ first too."""
    body, said, sizes_first = ALTERNATING[change]
    script = write(tmp_path / "alternating.py", """
import torch
torch.manual_seed(0)
cell, head, extra = torch.nn.GRUCell(8, 16), torch.nn.Linear(16, 1), torch.nn.Linear(16, 16)
data = torch.randn(20, 8)  # batches of 8, 8 and 4
opt = torch.optim.SGD([*cell.parameters(), *head.parameters(), *extra.parameters()], lr=0.1)
for step in range(8):""" + body + """
    loss.backward()
    opt.step()
    opt.zero_grad()
""")
    r = run_teraio("profile", script, "--out", tmp_path / "p")
    assert r.returncode == 0, r.stderr
    assert "is not in the profile" in r.stderr and said in r.stderr, r.stderr
    assert ("pad to one shape" in r.stderr) == sizes_first, r.stderr
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    # the iterations kept are known at the end, and said there: a line per iteration called the
    # first recorded one kept and a later one set aside, where the profile kept the later one
    assert "set aside" not in r.stderr and f"from iterations {meta['iterations'][0]} and {meta['iterations'][1]}" \
        in r.stderr, r.stderr
    skipped = meta["skipped_iterations"]
    only = change == "last batch"  # the same ops on other sizes
    assert skipped and all(s["sizes_first"] == sizes_first and s["sizes_only"] == only for s in skipped), skipped


PRODUCER = """
import multiprocessing as mp
import torch


def produce(q, n):
    for i in range(n):
        q.put(torch.full((8, 16), float(i)).numpy())
    q.put(None)


if __name__ == "__main__":
    q = mp.get_context("spawn").Queue(maxsize=2)  # bounded: the producer blocks while it is full
    proc = mp.get_context("spawn").Process(target=produce, args=(q, 40))  # not a daemon
    proc.start()
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    while (x := q.get()) is not None:
        model(torch.from_numpy(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    proc.join()
"""


def test_a_producer_process_the_script_started_does_not_keep_the_profile_waiting(tmp_path: Path) -> None:
    """The profile stops the script mid-loop, so its producer (a non-daemon process blocked on a
    full queue) is never read to its end: Python waited for it at exit for ever. It is stopped."""
    script = tmp_path / "producer.py"
    script.write_text(PRODUCER)
    r = run_teraio("profile", script, "--out", tmp_path / "p", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stopping 1 process the script started" in r.stderr
    assert (tmp_path / "p" / "meta.json").exists()


LOGGER_THREAD = """
import threading
import torch

stop = threading.Event()
model = torch.nn.Linear(16, 1)
logged = []
logger = threading.Thread(target=lambda: [logged.append(model.weight.norm().item()) for _ in iter(
    lambda: stop.wait(0.01), True)], daemon=%s)
logger.start()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
stop.set()
logger.join()
"""


@pytest.mark.parametrize("daemon", [False, True])
def test_a_thread_the_script_stops_after_its_loop_does_not_keep_the_profile_waiting(daemon: bool,
                                                                                    tmp_path: Path) -> None:
    """The profile stops the script mid-loop, so its code that stops its logger thread never
    runs: Python waited for a non-daemon thread at exit for ever (a daemon one running ops as
    the interpreter shut down aborted it now and then). The profile is written and it exits."""
    script = tmp_path / "logger.py"
    script.write_text(LOGGER_THREAD % daemon)
    r = run_teraio("profile", script, "--out", tmp_path / "p", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "leaving 1 thread the script started" in r.stderr
    assert (tmp_path / "p" / "meta.json").exists()


def test_existing_out_needs_force(tmp_path: Path) -> None:
    (tmp_path / "p").mkdir()
    r = run_teraio("profile", EXAMPLE, "--out", tmp_path / "p")
    assert r.returncode == 2
    assert "already exists; pass --force" in one_line_error(r.stderr)


def test_inspect_summary_and_json(gpt_profile: Path) -> None:
    r = run_teraio("inspect", gpt_profile)
    assert r.returncode == 0, r.stderr
    for words in ("peak memory", "activation", "optimizer_state", "active bytes",
                  "inactive periods by tensor size", "largest tensors", "iteration 0 "):
        assert words in r.stdout
    j = run_teraio("inspect", gpt_profile, "--json")
    s = json.loads(j.stdout)
    first = s["first_iteration"]
    assert first["num_ops"] > s["num_ops"] and 0 < first["peak_bytes"] < s["peak_bytes"]
    assert 0 < s["active_fraction_mean"] <= s["active_fraction_max"] <= 1
    assert len(s["largest_tensors"]) == 10
    assert set(s["peak_by_kind"]) >= {"param", "activation"}
    assert sum(s["peak_by_kind"].values()) == s["peak_bytes"]
    if read_profile(gpt_profile).meta["device_type"] == "cpu":  # nothing measures scratch there
        assert s["max_scratch_bytes"] == 0 and s["peak_needed_bytes"] == s["peak_bytes"]
        assert "scratch" not in r.stdout
    else:  # NOTE [ Scratch ]: measured on CUDA (an H200: 32 KiB for the example's small model)
        assert s["max_scratch_bytes"] > 0 and s["peak_needed_bytes"] >= s["peak_bytes"]
        assert "scratch" in r.stdout


def test_inspect_damaged_and_wrong_version(gpt_profile: Path, tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(gpt_profile, bad)
    (bad / "kernels.parquet").write_bytes(b"\x00garbage")
    r = run_teraio("inspect", bad)
    assert r.returncode == 2
    assert "kernels.parquet: not a readable Parquet file" in one_line_error(r.stderr)

    old = tmp_path / "old"
    shutil.copytree(gpt_profile, old)
    meta = json.loads((old / "meta.json").read_text())
    (old / "meta.json").write_text(json.dumps({**meta, "format": "teraio-profile/0"}))
    r = run_teraio("inspect", old)
    assert r.returncode == 2
    assert "expected 'teraio-profile/5'" in one_line_error(r.stderr)


def test_a_trace_of_code_with_python_numbers_is_refused_saying_why(tmp_path: Path) -> None:
    """``torch.jit.trace`` under a dispatch mode records ``x * 0.5`` as a value its trace cannot
    run ("Unable to cast 0.5 to Tensor"); teraio says so, and what to use instead (NOTE [ Traced
    code ] in torch_patch/opstream.py)."""
    script = tmp_path / "traced.py"
    script.write_text(
        "import torch\n"
        "class Half(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return super().forward(x) * 0.5\n"
        "block = torch.jit.trace(Half(8, 8), torch.randn(2, 8))\n"
        "opt = torch.optim.SGD(block.parameters(), lr=0.1)\n"
        "for _ in range(4):\n"
        "    block(torch.randn(2, 8)).sum().backward(); opt.step(); opt.zero_grad()\n")
    r = run_teraio("profile", script, "--out", tmp_path / "p")
    assert r.returncode == 1
    assert "torch.jit.trace cannot trace code that uses Python numbers under teraio" in r.stderr
    assert "use torch.jit.script" in r.stderr
