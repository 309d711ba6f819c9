"""The simulator: run the profiled ops in order with a plan's transfers on the channels.

Each op takes its profiled duration. Before op ``k`` the transfers triggered
at ``k`` start; then the op waits (a *stall*) until (1) every prefetch whose
deadline is ``k`` is complete, and (2) the resident bytes fit the capacity, as
long as offloads in flight can still make room. An offload's deadline is where
the plan counts its bytes free; no op waits for it there unless the room is
needed (NOTE [ Room ] in ``runtime.executor``). Channels move ``bandwidth *
elapsed`` bytes, serving their pending transfers urgent first, then by plan
priority, preemptively (NOTE [ Channel model ] in ``planner.channels``);
transfers go on during ops and stalls alike.

Memory: a tensor's bytes are counted free when its offload completes and
counted again from the moment its prefetch starts (conservative both ways). A
prefetch triggered while the offload of that period is still in flight
cancels it: the storage is kept and the rest of the write is dropped (with its
host buffer). Host memory is held from an offload's start to the end of its
prefetch.

A move that does not read back (a trailing period, NOTE [ Trailing periods ]
in ``planner.problem``) is never prefetched: at its ``end_op`` the storage
dies, the memory curve no longer counts it, and its offloaded copy (host
buffer included) is dropped; an offload still in flight then is cancelled.

A storage no op of the iteration uses (NOTE [ Untouched storages ] in
``profiles.views``) goes out once: its move of the next iteration finds it
still out, and writes nothing.

A prefetch with ``keep_copy`` leaves its copy where it was (held in host
memory as before), and the storage's next offload with ``reuse_copy`` then
frees it at once, writing nothing; where no copy is kept yet (the first
iteration), that offload writes as any other (NOTE [ Copies kept ] in
``planner.clean``).

On a CPU the cores that train also copy: NOTE [ Copies on the compute ].

The plan repeats every iteration; ``num_iterations`` consecutive iterations
are simulated from a state where everything is resident, and the last one is
reported (the steady state, with the previous iteration's wrap-around
transfers in flight).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.bound import phase_windows
from planner.greedy import Move
from planner.problem import PlanProblem

__all__ = ["CHANNELS", "FREE_BW", "SimResult", "simulate"]

# A channel this fast carries releases, not bytes (a baseline's parameters dropped where
# the master copy is elsewhere): instant, and no copy cost (NOTE [ Copies on the compute ]).
FREE_BW = 1e30  # bytes/s

# NOTE [ Copies on the compute ]: on a GPU, transfers run on copy engines beside
# the kernels, and an op takes its profiled time whatever moves meanwhile. On a
# CPU the cores that train also copy: the workers' copies through the staging
# buffers, the syscalls, the page faults of a storage given its bytes back, the
# compute threads they push aside. There every byte a channel moves while an op
# runs costs the compute ``copy_cost_s_per_byte`` (a figure measured on the
# machine, ``planner.hardware``), added to the op that runs next (so the cost
# lands within an op of where it was paid, and the channels go on moving bytes
# meanwhile, which cost in turn); a byte moved during a stall costs nothing, as
# the training thread only waits then. Every transfer started also costs the compute
# ``transfer_cost_s``, added to the next op: the runtime's own work for it (its
# bookkeeping on the training thread, the workers' Python beside it, a file made and
# removed), which no byte count shows and which dominates for small tensors (a
# 4 KiB tensor's transfer costs a CPU example about 0.3 ms of its compute, its bytes
# 1.5 us). Every op also takes ``op_overhead_s``
# more: the runtime's dispatch mode, which the profiled op times leave out. And
# at each iteration boundary the runtime gives the memory freed back to the OS
# (NOTE [ malloc on CPU ] in runtime/memory.py), which the next iteration faults
# in again up to its peak: ``refault_s_per_byte`` times the previous
# iteration's resident peak over what is resident when the iteration starts,
# added to its first op. On a GPU only the per-transfer figure is charged (measured
# on the GPU: NOTE [ Small transfers on a GPU ] in teraio/cmd_plan.py); the other
# three are 0 there, where the prediction is the profiled ops and the stalls.

# NOTE [ Transfer latency ]: a transfer to or from the SSD holds its channel for
# ``transfer_latency_s`` before its first byte moves (the runtime's worker picking it
# up, a swap file opened and closed, the syscalls a small tensor cannot spread), then
# for its bytes at the channel's bandwidth; the latency is the channel's time, not the
# compute's (that is ``transfer_cost_s``) and moves no bytes, so it is neither counted
# in ``bytes_moved`` nor charged as copies (``busy_us`` holds it). The greedy reserves
# the same time (``planner.greedy``). On this 2-core VM the posix backend, beside a
# training loop, moved 4 MiB tensors at 1.0 GB/s out and 64 KiB ones at 0.09 GB/s:
# 0.3-0.5 ms a transfer that bandwidth does not explain (``runtime.calibrate``
# measures it). Host memory's channels have none: the host backend copies into a pool
# with no file (75-120 us a transfer measured the same way, left out). 0 for a GPU
# profile, where a transfer's latency is microseconds.
CHANNELS = ("ssd_write", "ssd_read", "host_write", "host_read")

# NOTE [ Duplex ]: a device's two directions are two channels, but they need not be independent:
# while both move bytes, each moves ``duplex`` of its bandwidth (``ssd_duplex``, ``host_duplex``;
# 1: independent). Measured: on an H200's pinned host link, one copy each way at once ran at
# 46-49 GB/s each against 53-54 alone (0.86-0.91); on this 2-core VM the posix backend's writes
# and reads, where the cores that copy are the same two, far less (``runtime.calibrate`` measures
# it). Rates change only where a transfer of the pair starts or ends, so the channels advance from
# one such moment to the next. A transfer's latency (NOTE [ Transfer latency ]) is counted at the
# same reduced rate, a slight over-count. The bound (``planner.bound``) leaves this out: a slower
# channel only raises what a plan takes, so it is still a bound.
_TOL = 1e-6  # bytes
# Per-instance state of a move.
_IDLE, _OFFLOADING, _OUT, _CANCELLED, _FETCHING, _BACK, _DEAD = range(7)


@dataclass(frozen=True, eq=False)
class SimResult:
    """The reported (last simulated) iteration. Times us from its start, sizes bytes."""

    iteration_us: float
    ideal_iteration_us: float
    stall_us: float
    num_stalls: int
    capacity_bytes: float
    op_start_us: np.ndarray  # (num_ops,) float64: when each op starts (after its stall)
    stall_us_before: np.ndarray  # (num_ops,) float64: how long each op waited
    resident_bytes: np.ndarray  # (num_ops,) int64: device bytes while each op runs
    host_peak_bytes: int
    bytes_moved: dict[str, float]  # per channel, during the iteration
    busy_us: dict[str, float]  # per channel, time spent moving bytes (and in latency) during the iteration
    waited_offloads: frozenset[int] = field(default_factory=frozenset)  # move indices
    waited_prefetches: frozenset[int] = field(default_factory=frozenset)
    # (num_moves, 2) float64: start and end of each move's offload / prefetch in the iteration
    # they are triggered in (the steady-state occurrence); NaN when it did not run.
    offload_us: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    prefetch_us: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    # time the ops took beyond their profiled time (NOTE [ Copies on the compute ]): the
    # copies' cost with each transfer's own (``transfer_cost_s``), the runtime's per-op overhead,
    # the boundary's faults
    copy_charge_us: float = 0.0
    op_overhead_us: float = 0.0
    refault_us: float = 0.0
    # (num_windows, 4) float64: per channel (``CHANNELS``' order), how long
    # it was busy (as ``busy_us``) from the start of the iteration to the moment the first op of each
    # phase window (``planner.bound.phase_windows``) is reached
    window_busy_us: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))

    @property
    def peak_bytes(self) -> int:
        return int(self.resident_bytes.max()) if len(self.resident_bytes) else 0

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def slowdown(self) -> float:
        return self.iteration_us / self.ideal_iteration_us if self.ideal_iteration_us else 1.0

    @property
    def op_run_us(self) -> np.ndarray:
        """(num_ops,) float64: how long each op ran, its stall left out: its profiled time and
        what NOTE [ Copies on the compute ] adds to it."""
        ends = np.append(self.op_start_us[1:] - self.stall_us_before[1:], self.iteration_us)
        return ends - self.op_start_us if len(self.op_start_us) else np.zeros(0)

    def utilisation(self) -> dict[str, float]:
        """The share of the iteration each channel is busy: moving bytes, or in transfers' latency
        (NOTE [ Transfer latency ]); with none, the bytes moved over what it could move."""
        t = self.iteration_us
        return {c: (self.busy_us[c] / t if t > 0 else 0.0) for c in CHANNELS}


class _Sim:
    def __init__(self, problem: PlanProblem, moves: Sequence[Move], bw: dict[str, float],
                 capacity_bytes: float, num_iterations: int, copy_cost_s_per_byte: float = 0.0,
                 op_overhead_s: float = 0.0, refault_s_per_byte: float = 0.0,
                 transfer_cost_s: float = 0.0, transfer_latency_s: float = 0.0, ssd_duplex: float = 1.0,
                 host_duplex: float = 1.0) -> None:
        self.p = problem
        self.moves = moves
        self.cap = capacity_bytes
        n = problem.num_ops
        self.n, self.iters = n, num_iterations
        nm = len(moves)
        self.nm = nm
        self.bw_us = {c: bw[c] * 1e-6 for c in CHANNELS}  # bytes per us
        self.duplex = {"ssd": ssd_duplex, "host": host_duplex}  # NOTE [ Duplex ]
        self.shared = min(ssd_duplex, host_duplex) < 1.0
        # NOTE [ Transfer latency ]: each transfer first holds its channel this many bytes' time
        self.lat_bytes = {c: transfer_latency_s * bw[c] if c.startswith("ssd") and bw[c] < FREE_BW else 0.0
                          for c in CHANNELS}
        self.heaps: dict[str, list[tuple[tuple[int, int], int]]] = {c: [] for c in CHANNELS}
        # Per transfer: id = (instance * nm + move) * 2 + (0 offload | 1 prefetch).
        total = num_iterations * nm * 2
        self.remaining = [0.0] * total
        self.state = [_IDLE] * (num_iterations * nm)
        self.t_start = [float("nan")] * total
        self.t_end = [float("nan")] * total
        self.size = [float(m.size_bytes) for m in moves]
        self.host = [m.target == "host" for m in moves]
        self.reads_back = [m.reads_back for m in moves]
        # NOTE [ Copies kept ]: per storage, whether a prefetch kept its copy (not yet reused)
        self.tensor = [m.tensor_id for m in moves]
        self.reuse = [m.reuse_copy for m in moves]
        # NOTE [ Untouched storages ] in profiles.views: out from one iteration to the next
        self.untouched = [not m.reads_back and m.end_op == self.n + 1 for m in moves]
        self.keep = [m.keep_copy for m in moves]
        self.kept: dict[int, int] = {}  # storage -> the move whose prefetch kept its copy
        self.write_ch = ["host_write" if h else "ssd_write" for h in self.host]
        self.read_ch = ["host_read" if h else "ssd_read" for h in self.host]
        self.key_off = [(0 if m.urgent_offload else 1, m.priority) for m in moves]
        self.key_pre = [(0 if m.urgent_prefetch else 1, m.read_priority) for m in moves]
        self.offloaded = 0.0
        self.host_used = 0.0
        self.host_peak = 0.0
        self.now = 0.0
        self.measuring = False
        self.moved = dict.fromkeys(CHANNELS, 0.0)
        self.busy = dict.fromkeys(CHANNELS, 0.0)
        self.waited_off: set[int] = set()
        self.waited_pre: set[int] = set()
        # NOTE [ Copies on the compute ]
        self.copy_us_per_byte = copy_cost_s_per_byte * 1e6
        self.op_overhead_us = op_overhead_s * 1e6
        self.transfer_us = transfer_cost_s * 1e6
        self.computing = False  # an op runs: bytes moved now cost the compute
        self.debt_us = 0.0  # the copy cost not yet added to an op
        self.charged_us = 0.0  # copy cost added to the ops of the measured iteration
        self.refault_us_per_byte = refault_s_per_byte * 1e6
        self.refault_us = 0.0  # added to the measured iteration's first op

    # ---- channels ----------------------------------------------------------------------
    def _rates(self) -> dict[str, float]:
        """Bytes per us each channel moves now (NOTE [ Duplex ]; a channel that carries releases,
        ``FREE_BW``, shares nothing)."""
        rates = dict(self.bw_us)
        for dev, f in self.duplex.items():
            w, r = f"{dev}_write", f"{dev}_read"
            if (f < 1.0 and max(self.bw_us[w], self.bw_us[r]) < FREE_BW * 1e-6
                    and self._top(w) is not None and self._top(r) is not None):
                rates[w] *= f
                rates[r] *= f
        return rates

    def _shared_step(self, rates: dict[str, float]) -> float:
        """Us until the first transfer of a device whose directions share it now ends (a hair past,
        so that a step of that length ends it), when the rates change; inf where none shares."""
        step = float("inf")
        for dev in self.duplex:
            w, r = f"{dev}_write", f"{dev}_read"
            if rates[w] < self.bw_us[w]:
                for c in (w, r):
                    top = self._top(c)
                    if top is not None:
                        step = min(step, (self.remaining[top] + 2 * _TOL) / rates[c])
        return step

    def _until(self, tid: int, channel: str) -> float:
        """Us to advance towards the end of transfer ``tid``, the top of ``channel``: to its end at
        the rate now, or to the first moment the rates change, whichever comes first."""
        if not self.shared:
            return self.remaining[tid] / self.bw_us[channel]
        rates = self._rates()
        return min(self.remaining[tid] / rates[channel], self._shared_step(rates))

    def _advance(self, dt: float) -> None:
        """Let every channel work for ``dt`` us from ``now``, then move ``now``; where a device's
        directions share it (NOTE [ Duplex ]), in steps that end where a transfer of the pair ends."""
        if not self.shared:
            self._advance_at(dt, self.bw_us)
            return
        while dt > 0:
            rates = self._rates()
            step = min(dt, self._shared_step(rates))
            self._advance_at(step, rates)
            dt -= step

    def _advance_at(self, dt: float, rates: dict[str, float]) -> None:
        """Let every channel work for ``dt`` us from ``now`` at ``rates``, then move ``now``."""
        for c in CHANNELS:
            heap = self.heaps[c]
            if not heap:
                continue
            bw = rates[c]
            budget, t = dt * bw, self.now
            used = real = 0.0  # channel bytes, and of them the tensors' (not a latency's)
            while heap and budget > _TOL:
                tid = heap[0][1]
                r = self.remaining[tid]
                if r <= 0.0:  # dropped while queued
                    heapq.heappop(heap)
                    continue
                latency = max(r - self.size[(tid // 2) % self.nm], 0.0)  # served first
                take = min(r, budget)
                used += take
                real += max(take - latency, 0.0)
                if r <= budget + _TOL:
                    heapq.heappop(heap)
                    budget -= r
                    t += r / bw
                    self.remaining[tid] = 0.0
                    self._complete(tid, t)
                else:
                    self.remaining[tid] = r - budget
                    budget = 0.0
            if self.measuring:
                self.moved[c] += real
                self.busy[c] += used / bw
            if self.computing and self.bw_us[c] < FREE_BW * 1e-6:  # bytes/us
                self.debt_us += real * self.copy_us_per_byte
        self.now += dt

    def _compute(self, duration_us: float) -> None:
        """Run one op: its profiled time, the runtime's per-op overhead and the copy cost
        owed so far (NOTE [ Copies on the compute ])."""
        extra, self.debt_us = self.op_overhead_us + self.debt_us, 0.0
        if self.measuring:
            self.charged_us += extra - self.op_overhead_us
        self.computing = self.copy_us_per_byte > 0
        self._advance(duration_us + extra)
        self.computing = False

    def _complete(self, tid: int, t: float) -> None:
        self.t_end[tid] = t
        inst, action = divmod(tid, 2)
        m = inst % self.nm
        if action == 0:
            if self.state[inst] == _OFFLOADING:
                self.state[inst] = _OUT
                self.offloaded += self.size[m]
        else:
            self.state[inst] = _BACK
            if self.keep[m]:
                self.kept[self.tensor[m]] = m  # its host copy stays held
            elif self.host[m]:
                self.host_used -= self.size[m]

    def _top(self, channel: str) -> int | None:
        """The transfer the channel serves now (dropping cancelled ones); None if idle."""
        heap = self.heaps[channel]
        while heap and self.remaining[heap[0][1]] <= 0.0:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def _wait_for(self, tid: int, channel: str) -> float:
        """Advance until transfer ``tid`` completes; returns the time waited."""
        t0 = self.now
        while self.remaining[tid] > 0 and (top := self._top(channel)) is not None:
            self._advance(self._until(top, channel))
        return self.now - t0

    # ---- events ------------------------------------------------------------------------
    def _start_offload(self, inst: int) -> None:
        m = inst % self.nm
        tid = inst * 2
        if self.untouched[m] and inst >= self.nm and self.state[inst - self.nm] == _OUT:
            self.state[inst - self.nm] = _DEAD  # NOTE [ Untouched storages ]: still out, nothing written
            self.state[inst] = _OUT
            self.t_start[tid] = self.t_end[tid] = self.now
            return
        keeper = self.kept.pop(self.tensor[m], -1)
        if keeper >= 0:
            if self.reuse[m] and self.host[keeper] == self.host[m]:  # NOTE [ Copies kept ]: nothing written
                self.state[inst] = _OUT
                self.offloaded += self.size[m]
                self.t_start[tid] = self.t_end[tid] = self.now
                return
            if self.host[keeper]:  # a copy kept for no reuse is dropped
                self.host_used -= self.size[keeper]
        self.state[inst] = _OFFLOADING
        self.remaining[tid] = self.size[m] + self.lat_bytes[self.write_ch[m]]
        self.t_start[tid] = self.now
        heapq.heappush(self.heaps[self.write_ch[m]], (self.key_off[m], tid))
        self._started(self.write_ch[m])
        if self.host[m]:
            self.host_used += self.size[m]
            self.host_peak = max(self.host_peak, self.host_used)

    def _start_prefetch(self, inst: int) -> None:
        m = inst % self.nm
        st = self.state[inst]
        if not self.reads_back[m]:
            self._die(inst)
            return
        if st == _OFFLOADING:
            self.state[inst] = _CANCELLED
            tid = inst * 2
            self.remaining[tid] = 0.0  # drop the rest of the write: the tensor stays
            self.t_end[tid] = self.now
            if self.host[m]:
                self.host_used -= self.size[m]
            return
        if st != _OUT:
            return  # never offloaded (the first iteration's wrap-around prefetches)
        tid = inst * 2 + 1
        self.state[inst] = _FETCHING
        self.offloaded -= self.size[m]
        self.remaining[tid] = self.size[m] + self.lat_bytes[self.read_ch[m]]
        self.t_start[tid] = self.now
        heapq.heappush(self.heaps[self.read_ch[m]], (self.key_pre[m], tid))
        self._started(self.read_ch[m])

    def _started(self, channel: str) -> None:
        """A transfer starts: the runtime's work for it, owed to the next op (NOTE [ Copies on
        the compute ])."""
        if self.bw_us[channel] < FREE_BW * 1e-6:
            self.debt_us += self.transfer_us

    def _die(self, inst: int) -> None:
        """The storage of a trailing move's instance is freed: drop its copy or its write."""
        m = inst % self.nm
        st = self.state[inst]
        if st == _OFFLOADING:
            tid = inst * 2
            self.remaining[tid] = 0.0
            self.t_end[tid] = self.now
        elif st == _OUT:
            self.offloaded -= self.size[m]
        else:
            return  # never offloaded (the first iteration's wrap-around deaths)
        self.state[inst] = _DEAD
        if self.host[m]:
            self.host_used -= self.size[m]

    def _schedule(self) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """Per global op: offload and prefetch starts and prefetch deadlines (instance ids)."""
        n, nm, total = self.n, self.nm, self.n * self.iters
        lists: list[list[list[int]]] = [[[] for _ in range(total)] for _ in range(3)]
        if not nm:
            return lists[0], lists[1], lists[2]
        cols = [
            np.array([m.offload_trigger for m in self.moves]),
            np.array([m.prefetch_trigger for m in self.moves]),
            np.array([m.prefetch_deadline for m in self.moves]),
        ]
        for out, col in zip(lists, cols, strict=True):
            for it in range(self.iters):
                g = col + it * n
                ok = (col >= 0) & (g < total)
                for gi, m in zip(g[ok].tolist(), np.flatnonzero(ok).tolist(), strict=True):
                    out[gi].append(it * nm + m)
        return lists[0], lists[1], lists[2]

    def run(self) -> SimResult:
        p, n = self.p, self.n
        starts_off, starts_pre, due_pre = self._schedule()
        dur = p.duration_us.tolist()
        mem = p.memory_bytes.tolist()
        op_start = np.zeros(n)
        stall = np.zeros(n)
        resident = np.zeros(n, np.int64)
        t_iter = 0.0
        is_first = np.zeros(n, bool)
        is_first[phase_windows(p)] = True
        window_starts: list[bool] = is_first.tolist()
        window_busy: list[tuple[float, ...]] = []
        # NOTE [ Copies on the compute ]: the resident peak of the iteration before
        peak_before = float(max(mem)) if n else 0.0
        peak = 0.0
        for g in range(n * self.iters):
            k = g % n
            boundary_us = 0.0
            if k == 0:
                t_iter = self.now
                self.measuring = g == n * (self.iters - 1)
                self.host_peak = self.host_used
                if g:
                    peak_before, peak = peak, 0.0
                boundary_us = max(peak_before - (mem[0] - self.offloaded), 0.0) * self.refault_us_per_byte
                if self.measuring:
                    self.refault_us = boundary_us
            if self.measuring and window_starts[k]:
                window_busy.append(tuple(self.busy[c] for c in CHANNELS))
            for inst in starts_off[g]:
                self._start_offload(inst)
            for inst in starts_pre[g]:
                self._start_prefetch(inst)
            waited = 0.0
            for inst in due_pre[g]:
                if self.state[inst] == _FETCHING and self.remaining[inst * 2 + 1] > 0:
                    m = inst % self.nm
                    waited += self._wait_for(inst * 2 + 1, self.read_ch[m])
                    if self.measuring:
                        self.waited_pre.add(m)
            while mem[k] - self.offloaded > self.cap + _TOL:
                pending = [(self._until(top, c), top)
                           for c in ("ssd_write", "host_write") if (top := self._top(c)) is not None]
                if not pending:
                    break
                dt, tid = min(pending)
                self._advance(dt)
                waited += dt
                if self.measuring:
                    self.waited_off.add((tid // 2) % self.nm)
            peak = max(peak, mem[k] - self.offloaded)
            if self.measuring:
                stall[k] = waited
                op_start[k] = self.now - t_iter
                resident[k] = int(round(mem[k] - self.offloaded))
            self._compute(dur[k] + boundary_us)
        iteration_us = self.now - t_iter
        return SimResult(
            iteration_us=iteration_us, ideal_iteration_us=p.ideal_iteration_us,
            stall_us=float(stall.sum()), num_stalls=int(np.count_nonzero(stall > 0)),
            capacity_bytes=self.cap, op_start_us=op_start, stall_us_before=stall,
            resident_bytes=resident, host_peak_bytes=int(self.host_peak),
            bytes_moved=dict(self.moved), busy_us=dict(self.busy),
            waited_offloads=frozenset(self.waited_off), waited_prefetches=frozenset(self.waited_pre),
            offload_us=self._times(0, t_iter), prefetch_us=self._times(1, t_iter),
            copy_charge_us=self.charged_us, op_overhead_us=self.op_overhead_us * n, refault_us=self.refault_us,
            window_busy_us=np.array(window_busy, np.float64).reshape(-1, len(CHANNELS)),
        )

    def _times(self, action: int, t_iter: float) -> np.ndarray:
        """Start/end of each move's transfer in the iteration it is triggered in (the last one)."""
        n, nm = self.n, self.nm
        out = np.full((nm, 2), np.nan)
        last = self.iters - 1
        for m, mv in enumerate(self.moves):
            trig = mv.offload_trigger if action == 0 else mv.prefetch_trigger
            inst = last - trig // n  # the instance whose trigger falls in the last iteration
            if inst < 0:
                continue
            tid = (inst * nm + m) * 2 + action
            out[m] = (self.t_start[tid] - t_iter, self.t_end[tid] - t_iter)
        return out


def simulate(problem: PlanProblem, moves: Sequence[Move], bw_bytes_per_s: dict[str, float],
             capacity_bytes: float, num_iterations: int = 2, *, copy_cost_s_per_byte: float = 0.0,
             op_overhead_s: float = 0.0, refault_s_per_byte: float = 0.0,
             transfer_cost_s: float = 0.0, transfer_latency_s: float = 0.0, ssd_duplex: float = 1.0,
             host_duplex: float = 1.0) -> SimResult:
    """Simulate ``moves`` on ``problem``'s ops; see the module docstring for the model.

    ``bw_bytes_per_s`` has the channels ``ssd_write, ssd_read, host_write,
    host_read``; ``capacity_bytes`` may be ``inf`` (nothing waits for memory).
    ``copy_cost_s_per_byte``, ``op_overhead_s``, ``refault_s_per_byte`` and
    ``transfer_cost_s``: NOTE [ Copies on the compute ] (``Hardware``'s fields of those names;
    on a GPU all but ``transfer_cost_s`` are 0). ``transfer_latency_s``: NOTE [ Transfer latency ]. ``ssd_duplex``,
    ``host_duplex``: NOTE [ Duplex ].
    """
    if num_iterations < 1:
        raise ValueError("num_iterations must be at least 1")
    if min(copy_cost_s_per_byte, op_overhead_s, refault_s_per_byte, transfer_cost_s, transfer_latency_s) < 0:
        raise ValueError("copy_cost_s_per_byte, op_overhead_s, refault_s_per_byte, transfer_cost_s and "
                         "transfer_latency_s must be >= 0")
    if not (0 < ssd_duplex <= 1 and 0 < host_duplex <= 1):
        raise ValueError(f"ssd_duplex and host_duplex must be in (0, 1], not {ssd_duplex} and {host_duplex}")
    return _Sim(problem, moves, bw_bytes_per_s, capacity_bytes, num_iterations,
                copy_cost_s_per_byte, op_overhead_s, refault_s_per_byte, transfer_cost_s,
                transfer_latency_s, ssd_duplex, host_duplex).run()
