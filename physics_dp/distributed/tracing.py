"""Whether torch.compile is tracing right now: eager c10d calls cannot be recorded into a graph.

While Dynamo, AOTAutograd or ``make_fx`` trace, tensors are fake or proxied and a c10d call
would run (or hang) at trace time instead of becoming part of the graph; the collectives then
go through PyTorch's functional collectives, which trace.  The checks read torch's dispatch
state, and :func:`kept_in_backward` tags graph nodes for AOTAutograd's partitioner (private
APIs both), so they live here and nowhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._functorch._aot_autograd.graph_capture_wrappers import set_partitioner_tag_must_be_in_backward
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["is_tracing", "kept_in_backward", "outside_trace", "graph_constant"]


# Every dispatch mode (fake, proxy, a user's) turns the Python key on in the thread's dispatch state,
# a pre-dispatch proxy the PreDispatch key, a Python dispatcher its own.
_key_included = torch._C._dispatch_tls_is_dispatch_key_included
_PYTHON, _PRE_DISPATCH, _PYTHON_DISPATCHER = (
    torch._C.DispatchKey.Python, torch._C.DispatchKey.PreDispatch, torch._C.DispatchKey.PythonDispatcher,
)


def is_tracing() -> bool:
    """True under Dynamo, under a fake-tensor mode, or under a proxy (``make_fx``/AOTAutograd) trace.

    Eager code with no dispatch mode active (every op of an eager step asks, several times) is
    told so by three lookups of the dispatch state, without the proxy-mode search (eight Python
    calls)."""
    if torch.compiler.is_compiling():
        return True
    if not (_key_included(_PYTHON) or _key_included(_PRE_DISPATCH) or _key_included(_PYTHON_DISPATCHER)):
        return False
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return True
    if _key_included(_PYTHON_DISPATCHER):
        return True
    return get_proxy_mode() is not None


@contextlib.contextmanager
def kept_in_backward() -> Iterator[None]:
    """Inside AOTAutograd's trace of a backward, tag the nodes traced here to stay in the backward graph.

    The partitioner moves backward work that does not depend on the tangents into the forward
    graph.  On a rank whose output piece is empty, nothing in its backward does (inductor folds
    every empty tensor into a constant), so that rank's backward collectives would run in its
    forward while the other ranks run them after the loss: the ranks' collectives no longer pair
    up and the step hangs.  Pinned to the backward, every rank issues them in the same order.
    Elsewhere (eager, the forward, Dynamo) this does nothing.
    """
    traced_backward = fx_traceback.has_preserved_node_meta() and (
        fx_traceback.current_meta.get("partitioner_tag") == "is_backward"
    )
    if not traced_backward:
        yield
        return
    with set_partitioner_tag_must_be_in_backward():
        yield


@contextlib.contextmanager
def outside_trace() -> Iterator[None]:
    """Run plain planning code (index tables from integer sizes) eagerly, even inside a trace,
    and outside inference mode.

    Plans are cached across calls; built under a fake mode they would hold fake tensors, and
    cached real tensors cannot meet fake ones.  Built under ``torch.inference_mode()`` (a first
    evaluation) they would hold inference tensors, which autograd refuses to save when a later
    call trains.  So plans are always built on real, normal tensors.
    """
    with _disable_current_modes(), torch.inference_mode(False):
        yield


def graph_constant(planned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A planned (real, CPU) tensor as used by an op: moved to ``device``, or inside a trace
    re-created from its values so that it becomes a constant of the graph."""
    if not is_tracing():
        return planned.to(device)
    with outside_trace():
        values = planned.tolist()
    return torch.tensor(values, dtype=planned.dtype, device=device).view(planned.shape)  # (0, k) lists as []
