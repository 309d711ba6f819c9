"""Fake-mode profiling: trace a training step without running it (DESIGN.md section 8).

``FakeTracer`` is the ``Tracer`` with PyTorch's ``FakeTensorMode`` under it:
every tensor made inside carries shape, dtype and a storage of the right size
but no memory, every op computes only its output metadata, and each op's
duration comes from a ``RooflineCostModel`` for a named device instead of a
clock. The op stream sits *above* the fake mode, so it sees exactly the ops
the script issues (the ones a real run would see) on fake tensors whose
``untyped_storage()`` objects live and die like real ones; storage ids,
accesses and lifetimes are therefore the same as in a real profile.

What a user's script needs to run in fake mode (``teraio profile --fake``):

* it builds its model, optimizer and data *inside* the run, through PyTorch
  (``nn.Module`` constructors, ``torch.randn``/``randint``, ``torch.optim``);
  tensors it loads from files or NumPy become fake constants of the same size;
* it never branches on tensor values: ``.item()``, ``float(t)`` and ``bool(t)``
  return a placeholder (1, or False for booleans), so logging a loss works
  but a loop that waits for a value does not, and ops whose output shape depends on values (``nonzero``,
  boolean-mask indexing) fail;
* it uses no custom CUDA/C++ extensions without meta kernels.
Fake tensors keep the device the script asks for; timing is always for the
``--gpu`` device.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from profiles import Profile
from torch_patch.costmodel import RooflineCostModel
from torch_patch.opstream import OpInfo
from torch_patch.tracer import Tracer

__all__ = ["FakeTracer"]

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_LIFT_FRESH = torch.ops.aten.lift_fresh.default
# NOTE [ Fake functional collectives ]: where fake mode waits at once, what a real run records
_WAIT = torch.ops._c10d_functional.wait_tensor.default if torch.distributed.is_available() else None
_WRAP_INFO = OpInfo("_c10d_functional._wrap_tensor_autograd.default", False, frozenset(), frozenset())


def _placeholder(dtype: torch.dtype) -> bool | int | float:
    """What ``.item()`` gives in fake mode: 1 (no division by zero, e.g. Adam's bias
    correction at a placeholder step), and False for booleans (no NaN found)."""
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return 1.0
    return 1


def _no_memo(_meta: torch.Tensor, _fake: torch.Tensor) -> None:
    return None


class FakeTracer(Tracer):
    """A ``Tracer`` over ``FakeTensorMode`` that times ops with ``cost_model``.

    Use it as a context manager around model building and training, like
    ``Tracer``; leaving it leaves the fake mode too. Times start at 0 and add
    up the modelled op durations (ops run back to back, as on one stream).
    """

    def __init__(self, cost_model: RooflineCostModel, warmup: int = 1, iters: int = 1,
                 on_iteration: Any = None) -> None:
        super().__init__(warmup=warmup, iters=iters, on_iteration=on_iteration, cuda_timing=False)
        self.cost_model = cost_model
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        # NOTE [ Fake outputs without memo ]: FakeTensorMode memoizes each op's output in
        # a WeakValueDictionary keyed by its fresh meta tensor, a memo that can never hit
        # again but leaves a weak reference on every fake tensor, and
        # torch.utils.swap_tensors (which Module.to()/_apply() uses on fake parameters)
        # refuses tensors with weak references. Dropping that memo makes `model.to(...)`
        # work on fake models. Conversions of real tensors keep their own memo.
        self.fake_mode.fake_tensor_converter.set_tensor_memo = _no_memo  # type: ignore[method-assign,assignment]
        self._script_meta: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()
        self._clock_ns = 0.0
        self._now = self._clock  # type: ignore[assignment]
        self._t0 = 0
        self._wrapping = False  # NOTE [ Fake functional collectives ]
        self._orig_wrap: Any = None
        self._orig_from: Any = None

    # NOTE [ The script's meta tensors ]: every fake tensor's storage is a meta one, which stands
    # for the memory of the device the fake tensor says it is on; but a tensor the script itself
    # puts on the meta device (``t.to("meta")``: torch 2.11's pipeline stages keep one per
    # micro-batch as a placeholder) holds no memory in a real run. Counted, a fake pipeline rank's
    # curve stood 256 bytes above the real rank's, and a script's 1 MiB meta tensor 1 MiB. A fake
    # tensor's device tells the two apart.
    def _note(self, tid: int, t: torch.Tensor, storage: torch.UntypedStorage | None) -> None:
        if storage is not None and t.device.type == "meta":
            self._script_meta.add(storage)
        super()._note(tid, t, storage)

    def _bytes(self, storage: torch.UntypedStorage) -> int:
        return 0 if storage in self._script_meta else storage.nbytes()

    def _clock(self) -> float:
        return self._clock_ns

    def run_op(self, index, func, args, kwargs, inputs):  # type: ignore[no-untyped-def]
        if func is _LOCAL_SCALAR:  # .item() and friends: no data to read
            out: Any = _placeholder(args[0].dtype)
        elif self._wrapping and func is _WAIT:  # NOTE [ Fake functional collectives ]: no new storage
            out = args[0]
        else:
            out = func(*args, **kwargs)
        if func is _LIFT_FRESH and out is not args[0]:
            # NOTE [ Fake constants ]: ``torch.tensor(3.0)`` makes a real tensor and lifts it
            # with ``lift_fresh``, which in a real run returns it (one storage, first seen as
            # the op's input) and in fake mode returns a fake copy (a second storage, the
            # op's output). The copy takes the constant's id, so that the storages, and the
            # ids of a fake profile, are a real run's (the AdamW step counters among them).
            self.ids.move(args[0].untyped_storage(), out.untyped_storage())
        rec = self._rec
        if rec is not None:
            self._note_peer(rec, func, args)
            us = self.cost_model.op_us(func, args, kwargs, [t for _, t, _ in inputs], out)
            rec.timed(self._clock_ns, us * 1e3)
            self._clock_ns += us * 1e3
        return out

    # NOTE [ Fake functional collectives ]: a functional collective
    # (``torch.distributed._functional_collectives``, which DTensor's redistributions use)
    # wraps its result with ``_c10d_functional._wrap_tensor_autograd`` in a real run, and the
    # op that first uses the wrapper waits for it inside the wrapper's own dispatch, where no
    # mode sees it; until then the result is in flight. Under fake mode torch takes itself to be
    # tracing and waits at once (``wait_tensor``), so a fake profile had an op a real run does
    # not have there, and the result counted as done: a plan of it could move the result while
    # a real run's collective still wrote it, and a real run left such a plan there, every
    # iteration; its result, a new fake tensor, was a storage a real run does not have. The
    # wait is recorded as the wrapping and returns the collective's result itself, as the
    # wrapping wraps it (a fake tensor has nothing in flight to wait for).
    def _wrap_as_a_real_run(self, orig: Any) -> Any:
        def wrap(t: torch.Tensor) -> torch.Tensor:
            self._wrapping = True
            try:  # below autograd, which makes an op returning its input a view: an op of its own
                with torch._C._AutoDispatchBelowAutograd():
                    orig(t)
            finally:
                self._wrapping = False
            return t

        return wrap

    # Torch 2.11 (an H200's, on 2026-11-27) wraps ``all_gather_tensor_autograd``'s result in an
    # autograd function, ``_FromTorchTensor``, which returns the wrapping: the result itself here,
    # which autograd makes a view, with an op of its own. Its stand-in returns a view of it taken
    # uncounted, whose backward passes the gradient on as the original's does, with no op.
    def _from_torch_tensor(self, funcol: Any) -> Any:
        stream = self

        class FromTorchTensor(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
                funcol._maybe_wrap_tensor(t)
                stream.uncounted += 1
                try:
                    return t.view_as(t)
                finally:
                    stream.uncounted -= 1

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
                return grad

        return FromTorchTensor

    def after_op(self, index: int, info: OpInfo, inputs: list[tuple[int, torch.Tensor, bool]],
                 outputs: list[tuple[int, torch.Tensor, bool]]) -> None:
        if self._wrapping and info.name == str(_WAIT):  # NOTE [ Fake functional collectives ]
            info = _WRAP_INFO
        super().after_op(index, info, inputs, outputs)

    def profile(self, meta: dict[str, Any]) -> Profile:
        dev = self.cost_model.device
        return super().profile({
            "mode": "fake",
            "device_type": "cuda",
            "device_name": dev.name,
            "device_memory_bytes": dev.memory_bytes,
            "cost_model": self.cost_model.describe(),
            **meta,
        })

    # NOTE [ Fake parameters ]: ``nn.Parameter(data)`` makes a plain tensor a parameter
    # without an op, but a tensor subclass (a fake tensor) through ``data.detach()``, an
    # op a real run never sees. Counted, it would shift every later op of iteration 0
    # (which makes the model) and the plan made for it would not match a real run; the
    # detach makes no storage, so it passes uncounted.
    def _parameter_new(self) -> Any:
        orig, stream = torch.nn.Parameter.__new__, self

        def new(cls: Any, data: Any = None, requires_grad: bool = True) -> Any:
            stream.uncounted += 1
            try:
                return orig(cls, data, requires_grad)
            finally:
                stream.uncounted -= 1

        return orig, new

    def __enter__(self):  # type: ignore[no-untyped-def]
        self.fake_mode.__enter__()
        self._orig_parameter_new, new = self._parameter_new()
        torch.nn.Parameter.__new__ = new  # type: ignore[method-assign,assignment]
        if torch.distributed.is_available():
            import torch.distributed._functional_collectives as funcol

            self._orig_wrap = funcol._maybe_wrap_tensor
            funcol._maybe_wrap_tensor = self._wrap_as_a_real_run(self._orig_wrap)
            self._orig_from = getattr(funcol, "_FromTorchTensor", None)
            if self._orig_from is not None:
                funcol._FromTorchTensor = self._from_torch_tensor(funcol)  # type: ignore[attr-defined]
        try:
            return super().__enter__()
        except BaseException:
            self._restore()
            self.fake_mode.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()
            self.fake_mode.__exit__(*exc)

    def _restore(self) -> None:
        torch.nn.Parameter.__new__ = self._orig_parameter_new  # type: ignore[method-assign]
        if self._orig_wrap is not None:
            import torch.distributed._functional_collectives as funcol

            funcol._maybe_wrap_tensor = self._orig_wrap
            self._orig_wrap = None
            if self._orig_from is not None:
                funcol._FromTorchTensor = self._orig_from  # type: ignore[attr-defined]
                self._orig_from = None
