"""What moving tensors costs the training on a CPU, measured on this machine.

On a CPU the cores that train also copy (NOTE [ Copies on the compute ] in
``planner.simulate``), so a plan's prediction needs figures of the machine
it runs on, which ``teraio plan`` takes for a CPU profile (and what the
runtime itself adds):

- ``copy_cost_s_per_byte``: the compute time each byte moved takes from the
  training. A loop of training-like ops (``_Compute``: short products, GELUs and
  adds on PyTorch's own threads, as a CPU example's steps) runs alone, then
  while the migration engine moves ``total_bytes`` out
  and back through the posix backend in tensors of ``tensor_bytes``, the way
  the executor does (the training thread frees a storage once its write is
  done and gives it its bytes back before its read); the loop's extra time
  over the bytes moved. Alone and with copies alternate ``rounds`` times; the
  median.
- ``op_overhead_s``: the time the executor adds to an op (its dispatch mode,
  its bookkeeping of each op's storages): a small model's training steps
  (short ops, as a CPU example's: ``_train_small``) under ``teraio run``'s
  executor with a plan that moves nothing, against the same steps plainly,
  over the ops of a step; median of ``rounds``, each the median of a dozen
  steps. (35-39 us per op here. A loop of tiny adds measured 9 us, and plans
  made with that fell short by 40 ms of the small example's 450 ms with
  nothing moved: its ops have more inputs and outputs, and backward's come
  from autograd's engine.)
- ``refault_s_per_byte``: what giving freed memory back to the OS at an
  iteration boundary costs (NOTE [ malloc on CPU ] in ``runtime.memory``): the
  pages the next iteration faults in again, each zeroed by the kernel. A first
  write of a fresh anonymous mapping of ``total_bytes`` over a second write of
  it, per byte; the median of ``rounds``. (It measured 0.45-0.55 ns/byte in
  four processes here, where trimming and re-making tensors measured 0.009-0.49:
  whether glibc then faulted anything in depended on its heap's state.)
- ``transfer_cost_s``: the compute time each transfer takes beyond its
  bytes' copy cost (the executor's bookkeeping on the training thread, the
  workers' Python beside it, the swap file made and removed). The same steps
  with every idle stretch of every tensor moved out and back through the
  posix backend, against the plan that moves nothing; the extra time, less
  the time the steps waited for transfers and the copy cost of the bytes,
  over the transfers. Median of ``rounds``, each the median of a dozen steps.
  (130-300 us here, where the per-byte figure makes a 4 KiB tensor's
  transfer 1.5 us. Before the waits were subtracted it measured 280-330 us,
  about 45% of it waiting.) On CUDA (``device="cuda"``) the same steps run on
  the GPU through the host backend (pinned), each step's kernels waited for:
  the only figure a GPU profile's plan takes from here (NOTE [ Small transfers
  on a GPU ] in ``teraio.cmd_plan``).

- ``transfer_latency_s``: the time each transfer holds its channel beyond
  its bytes (NOTE [ Transfer latency ] in ``planner.simulate``), and
  ``posix_write_bw_bytes_per_s``, ``posix_read_bw_bytes_per_s``: the rate
  of the bytes themselves. Beside the same loop of ops, the
  engine moves 32 tensors of 4 MiB out and back, then 256 of 64 KiB, through
  the posix backend; each direction's time per transfer is ``latency +
  bytes / bandwidth``, and the two sizes give both. Medians of ``rounds``.
  (330-540 us here, and 1.0-1.4 GB/s out and 0.85-1.0 GB/s back, where the
  disk's raw O_DIRECT rate was 1.8-2.5 and 1.1-2.1 GB/s.) A sample whose large
  tensors were not slower than its small ones (noise) is left out.
- ``ssd_duplex``: the share of those rates each direction keeps while both move
  (NOTE [ Duplex ] in ``planner.simulate``): 32 tensors of 4 MiB back while 32
  others go out, beside the same loop; the direction done first moved all its
  bytes at the shared rate, so its time alone over its time beside the other.
  Median of ``rounds``. (0.56 here: the same two cores copy both ways.)

All are measured, never assumed; ``python -m runtime.calibrate`` prints them,
and ``runtime.cpu_costs`` keeps them per machine for ``teraio plan``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import mmap
import statistics
import tempfile
import time
from pathlib import Path

import torch

from planner.plan import Migration, Plan
from runtime.backends import PosixBackend
from runtime.cpu_costs import CpuCosts
from runtime.engine import Job, MigrationEngine
from runtime.storage import byte_view, free_storage, realloc_storage

__all__ = ["measure_copy_cost", "measure_cpu_costs", "measure_op_overhead", "measure_refault",
           "measure_channel", "measure_transfer_cost"]


class _Compute:
    """Training-like ops: 8 layers of a (128, 512) x (512, 512) fp32 product, a GELU and a residual
    add (0.4 ms, 25 us and 20 us each here). Short ops, as a CPU example's (0.3-0.6 ms on
    average), not one long product: between short ops PyTorch's threads spin and the training
    thread holds the GIL, both of which the workers' transfers wait for. Beside one 6 ms product a
    step, the posix backend moved 1.42 GB/s out with 399 us a transfer, and the small example's
    plan at its smallest budget predicted 849 ms against 994 measured (writes busy 401 against
    552 ms); beside these ops, 1.29 GB/s and 425 us, and 955 against 913 ms, and every cell of
    bench/fidelity.py within 10% in two runs of three (BENCHMARKS.md)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(128, 512, generator=gen)
        self.w = torch.randn(512, 512, generator=gen) / 512 ** 0.5

    def step(self) -> float:
        t0 = time.perf_counter()
        x = self.x
        for _ in range(8):
            x = x + torch.nn.functional.gelu(x @ self.w)
        return time.perf_counter() - t0

    def alone(self, seconds: float) -> float:
        """The median time of one step, run for about ``seconds``."""
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            times.append(self.step())
        return statistics.median(times)


def _out_and_back(compute: _Compute, backend: PosixBackend, tensor_bytes: int, count: int,
                  step_s: float = 0.0) -> tuple[float, float, float]:
    """``count`` tensors of ``tensor_bytes`` out through the engine, then back, the compute loop
    running beside them as training would (its steps free each storage once written and give it its
    bytes back before its read, as the executor does before each op). Returns the wall seconds out,
    those back, and the compute seconds lost over steps of ``step_s`` alone."""
    engine = MigrationEngine(2)
    storages = [torch.empty(tensor_bytes, dtype=torch.uint8).fill_(i % 251).untyped_storage()
                for i in range(count)]
    took, lost = [], 0.0
    try:
        for direction in ("write", "read"):
            t0 = time.perf_counter()
            for key, storage in enumerate(storages):
                view = byte_view(storage)
                work = ((lambda key=key, view=view: backend.write(key, view)) if direction == "write"
                        else (lambda key=key, view=view: backend.read(key, view)))
                engine.submit(Job(key, direction, tensor_bytes, work))
            done = 0
            while done < count:
                for job in _drain(engine, 0):
                    if direction == "write":
                        free_storage(storages[job.tensor_id])
                    done += 1
                lost += compute.step() - step_s
            took.append(time.perf_counter() - t0)
            if direction == "write":
                for storage in storages:
                    realloc_storage(storage, tensor_bytes)
    finally:
        engine.close()
    return took[0], took[1], lost


def _both_ways(compute: _Compute, backend: PosixBackend, tensor_bytes: int, count: int) -> tuple[float, float]:
    """``count`` tensors of ``tensor_bytes`` back through the engine while ``count`` others go out,
    the compute loop beside them; the wall seconds until the last write ends and the last read."""
    engine = MigrationEngine(2)
    out = [torch.empty(tensor_bytes, dtype=torch.uint8).fill_(i % 251).untyped_storage() for i in range(count)]
    back = [torch.empty(tensor_bytes, dtype=torch.uint8).untyped_storage() for _ in range(count)]
    ended: dict[str, float] = {}
    try:
        for key, storage in enumerate(back):  # what will be read: written first, untimed
            view = byte_view(storage)
            engine.submit(Job(key, "write", tensor_bytes, functools.partial(backend.write, key, view)))
        _drain(engine, count)
        t0 = time.perf_counter()
        for key in range(count):
            read_view, write_view = byte_view(back[key]), byte_view(out[key])
            engine.submit(Job(key, "read", tensor_bytes, functools.partial(backend.read, key, read_view)))
            engine.submit(Job(count + key, "write", tensor_bytes,
                              functools.partial(backend.write, count + key, write_view)))
        left = {"write": count, "read": count}
        while any(left.values()):
            for job in _drain(engine, 0):
                left[job.direction] -= 1
                if left[job.direction] == 0:
                    ended[job.direction] = time.perf_counter() - t0
            compute.step()
    finally:
        engine.close()
    return ended["write"], ended["read"]


def _drain(engine: MigrationEngine, at_least: int) -> list[Job]:
    """The jobs the engine has completed, waiting for ``at_least`` of them; raises a job's error."""
    done: list[Job] = []
    while True:
        while engine.completed:
            job = engine.completed.popleft()
            if job.error is not None:
                raise job.error
            done.append(job)
        if len(done) >= at_least:
            return done
        time.sleep(1e-4)


def measure_channel(swap_dir: str | Path | None = None, rounds: int = 3) -> tuple[float, float, float, float]:
    """Seconds each transfer holds its channel beyond its bytes, the bandwidth of the bytes out
    and back (bytes per second), and the share of it each direction keeps while both move; see
    the module docstring."""
    compute = _Compute()
    compute.alone(0.1)  # warm up
    big, small = 4 << 20, 64 << 10
    latencies: list[float] = []
    per_byte: tuple[list[float], list[float]] = ([], [])
    duplex: list[float] = []
    with tempfile.TemporaryDirectory(prefix="teraio-calibrate-", dir=swap_dir) as d:
        backend = PosixBackend(d)
        try:
            for _ in range(rounds):
                alone = _out_and_back(compute, backend, big, 32)[:2]
                t_big = [t / 32 for t in alone]
                both = _both_ways(compute, backend, big, 32)
                # while both move each keeps f of its rate: the direction done first did all its
                # bytes at f (NOTE [ Duplex ] in planner.simulate)
                first = min(range(2), key=lambda i: both[i])
                duplex.append(min(max(alone[first] / both[first], 0.05), 1.0))
                t_small = [t / 256 for t in _out_and_back(compute, backend, small, 256)[:2]]
                for way, tb, ts in zip(per_byte, t_big, t_small, strict=True):  # t = latency + bytes / bw
                    if tb > ts:
                        way.append((tb - ts) / (big - small))
                        latencies.append(max(ts - small * way[-1], 0.0))
        finally:
            backend.close()
    if not (latencies and all(per_byte)):
        raise RuntimeError("calibration: moving 4 MiB tensors never took longer than 64 KiB ones; the "
                           "machine was too busy to measure, try again")
    return (statistics.median(latencies), 1 / statistics.median(per_byte[0]), 1 / statistics.median(per_byte[1]),
            statistics.median(duplex))


def measure_copy_cost(swap_dir: str | Path | None = None, total_bytes: int = 128 << 20,
                      tensor_bytes: int = 4 << 20, rounds: int = 5) -> float:
    """Compute seconds lost per byte moved through the posix backend; see the module docstring."""
    compute = _Compute()
    compute.alone(0.2)  # warm up
    costs = []
    with tempfile.TemporaryDirectory(prefix="teraio-calibrate-", dir=swap_dir) as d:
        backend = PosixBackend(d)
        try:
            for _ in range(rounds):
                step_s = compute.alone(0.3)
                lost = _out_and_back(compute, backend, tensor_bytes, total_bytes // tensor_bytes, step_s)[2]
                costs.append(max(lost, 0.0) / (2 * total_bytes))
        finally:
            backend.close()
    return statistics.median(costs)


def _train_small(steps: int, times: list[float] | None = None, device: str = "cpu") -> None:
    """A small model's training steps (short ops, as a CPU example's), its parameters made first;
    each step's seconds appended to ``times`` (on CUDA, until its kernels are done)."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 8)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        t0 = time.perf_counter()
        x = torch.randn(128, 64, generator=gen).to(device)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize()
        if times is not None:
            times.append(time.perf_counter() - t0)


@dataclasses.dataclass(frozen=True)
class _SmallPlans:
    """``_train_small`` profiled here, and two plans of it: nothing moved, and every idle stretch
    of every tensor moved out after its last use and back before its next."""

    num_ops: int  # per step
    nothing: Plan
    everything: Plan

    @classmethod
    def make(cls, device: str = "cpu") -> _SmallPlans:
        from profiles import inactive_periods, made_bytes
        from torch_patch import ProfileComplete, Tracer

        tracer = Tracer(warmup=1, iters=1)
        try:
            with tracer:
                _train_small(10, device=device)
        except ProfileComplete:
            pass
        prof = tracer.profile({})
        rank = prof.ranks[0]  # RANK, where a launcher left it set in this shell
        names = prof.kernels_of(rank)["op_name"].tolist()
        periods = inactive_periods(prof, rank)
        periods = periods[~periods["wraps"] & periods["reads_back"] & (periods["num_ops"] >= 3)]
        moves = []
        columns = (periods[c].tolist() for c in ("tensor_id", "size_bytes", "start_op", "end_op"))
        for tid, size, start, end in zip(*columns, strict=True):
            # the prefetch starts half way through the stretch, so that the steps seldom wait for it
            fetch = max(start + 2, (start + end) // 2)
            for action, trigger, deadline in (("offload", start + 1, start + 2), ("prefetch", fetch, end)):
                moves.append(Migration(tensor_id=tid, size_bytes=size, action=action, place="ssd",
                                       trigger_op=trigger, deadline_op=deadline, start_us=None, end_us=None,
                                       urgent=False, priority=0, wraps=False, period_start_op=start,
                                       period_end_op=end))

        def plan(migrations: list[Migration]) -> Plan:  # followed as rank 0's
            # a CPU plan is followed without starting CUDA (NOTE [ A CPU script on a GPU machine ] in runtime.api)
            return Plan(signature="", parameters={"host_mem_bytes": 0, "device_type": device}, summary={},
                        migrations={0: migrations},
                        op_names={0: names}, made_bytes={0: made_bytes(prof, rank).tolist()})

        return cls(len(names), plan([]), plan(moves))


def _step_s(plan: Plan | None, swap_dir: str, steps: int, device: str = "cpu") -> float:
    """The median step of ``_train_small`` under ``plan`` (None: plainly), iterations 2 on, less
    the time it waited for transfers (the simulator counts those waits apart, from bandwidth).
    Through the posix backend on the CPU, the host backend (pinned) on CUDA."""
    from runtime.api import offload

    times: list[float] = []
    if plan is None:
        _train_small(steps, times, device)
        return statistics.median(times[2:])  # iterations 0 and 1 warm up
    with offload(plan, swap_dir=swap_dir, backend="posix" if device == "cpu" else "host", rank=0) as ex:
        _train_small(steps, times, device)
    stalls = ex.stats.iteration_stall_s
    return statistics.median(t - w for t, w in zip(times[2:], stalls[2:], strict=False))


def measure_op_overhead(swap_dir: str | Path | None = None, steps: int = 12, rounds: int = 3) -> float:
    """Seconds the executor adds to each op; see the module docstring."""
    plans = _SmallPlans.make()
    costs = []
    with tempfile.TemporaryDirectory(prefix="teraio-calibrate-", dir=swap_dir) as d:
        for _ in range(rounds):
            plain, under = _step_s(None, d, steps), _step_s(plans.nothing, d, steps)
            costs.append(max(under - plain, 0.0) / plans.num_ops)
    return statistics.median(costs)


def measure_transfer_cost(swap_dir: str | Path | None = None, copy_cost_s_per_byte: float = 0.0,
                          steps: int = 20, rounds: int = 5, device: str = "cpu") -> float:
    """Compute seconds each transfer (out or back) takes beyond its bytes' copy cost, on ``device``
    (``cpu`` or ``cuda``); see the module docstring."""
    plans = _SmallPlans.make(device)
    moves = plans.everything.migrations[0]
    moved_bytes = sum(m.size_bytes for m in moves)
    costs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="teraio-calibrate-", dir=swap_dir) as d:
        # every transfer costs the compute something: a median of none is a busy machine's noise
        # (the other processes' load landing on one side of the difference), measured again
        while len(costs) < rounds or (statistics.median(costs) <= 0 and len(costs) < 3 * rounds):
            without, with_moves = _step_s(plans.nothing, d, steps, device), _step_s(plans.everything, d, steps, device)
            lost = with_moves - without - copy_cost_s_per_byte * moved_bytes
            costs.append(max(lost, 0.0) / len(moves))
    return statistics.median(costs)


def measure_refault(total_bytes: int = 128 << 20, rounds: int = 5) -> float:
    """Seconds per byte of faulting memory in again; see the module docstring."""
    costs = []
    for _ in range(rounds):
        with mmap.mmap(-1, total_bytes) as m:
            t = torch.frombuffer(m, dtype=torch.uint8)
            t0 = time.perf_counter()
            t.fill_(1)  # every page faulted in
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            t.fill_(2)
            again = time.perf_counter() - t0
            del t  # before the mapping closes
        costs.append(max(first - again, 0.0) / total_bytes)
    return statistics.median(costs)


def measure_cpu_costs(swap_dir: str | Path | None = None) -> CpuCosts:
    """All the figures; 10-20 s."""
    copy_cost = measure_copy_cost(swap_dir)
    latency, write_bw, read_bw, duplex = measure_channel(swap_dir)
    return CpuCosts(copy_cost_s_per_byte=copy_cost, op_overhead_s=measure_op_overhead(swap_dir),
                    refault_s_per_byte=measure_refault(),
                    transfer_cost_s=measure_transfer_cost(swap_dir, copy_cost), transfer_latency_s=latency,
                    posix_write_bw_bytes_per_s=write_bw, posix_read_bw_bytes_per_s=read_bw, ssd_duplex=duplex)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Measure what moving tensors costs the training on this CPU.")
    p.add_argument("--swap-dir", default=None, help="where the posix backend writes (default: the temp dir)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (seconds)")
    p.add_argument("--cuda", action="store_true",
                   help="only the time each transfer takes the training on this machine's GPU")
    args = p.parse_args()
    if args.cuda:
        if not torch.cuda.is_available():
            raise SystemExit("runtime.calibrate: --cuda: no CUDA device here")
        cost = measure_transfer_cost(args.swap_dir, device="cuda")
        print(json.dumps({"transfer_cost_s": cost}) if args.json else
              f"{cost * 1e6:.1f} us per transfer on {torch.cuda.get_device_name()}")
        return
    costs = measure_cpu_costs(args.swap_dir)
    if args.json:
        print(json.dumps(dataclasses.asdict(costs)))
    else:
        print(f"copy cost {costs.copy_cost_s_per_byte * 1e9:.3f} ns per byte moved; op overhead "
              f"{costs.op_overhead_s * 1e6:.2f} us per op; refault {costs.refault_s_per_byte * 1e9:.3f} ns per byte; "
              f"{costs.transfer_cost_s * 1e6:.1f} us per transfer, which holds its channel "
              f"{costs.transfer_latency_s * 1e6:.1f} us more; the posix backend moves "
              f"{costs.posix_write_bw_bytes_per_s / 1e9:.2f} GB/s out and {costs.posix_read_bw_bytes_per_s / 1e9:.2f} "
              f"GB/s back beside training, each keeping {costs.ssd_duplex:.2f} of that while both move")


if __name__ == "__main__":
    main()
