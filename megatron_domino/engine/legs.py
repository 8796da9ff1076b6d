"""Domino's own backward order: each chunk's work cut into legs, replayed in an order chosen here.

**Why.** Left to autograd, Domino's backward runs the ready node created latest first (torch
``csrc/autograd/engine.h``, the ready queue's order), so the forward's op order decides the
backward's: the op that covers a chunk's input-gradient all-reduce in backward is whatever
other chunk's op the forward created between that chunk's norm (the wait) and its column linear
(the launch). Launching a forward all-reduce earlier takes exactly that op out of the
backward's cover (``docs/benchmarks/p2-schedule_cpu-2core_2026-12-03.md``: the forward's
blocked time halved, the backward's doubled). Here the schedule owns both directions.

**Legs.** The schedule cuts each chunk's op sequence at fixed points (where a collective's
backward launch and its backward wait fall into different ops, :mod:`.schedule`); a chunk's
work between two cuts is one *leg*. At a cut, :meth:`LegBook.cut` detaches the tensors handed
on (the norm output the next column linear reads, the residual; under sequence parallelism also
the collectives' outputs in flight) and starts the next leg from them through :class:`_Entry`,
so every leg has an autograd graph of its own. When a Domino step's forward ends,
:meth:`LegBook.finish` puts one outer autograd node (:class:`_StepNode`) in place of all of the
step's legs: its inputs are the tensors the chunks' first legs started from, its outputs each
chunk's last tensor. Its backward is the driver: it runs the legs' graphs, one nested engine
call per leg (as Megatron-Core's activation recompute runs its replayed graph), in the order
:func:`backward_order` gives, and hands each leg's entry gradients to the leg (or the step
input) they belong to. Megatron's pipeline schedules, recompute and DDP see one ordinary node.

**Gradients in flight.** A leg's backward may end with a collective launched on its entry
gradient (the column linear's dX all-reduce; under sequence parallelism the reduce-scatter of dX).
:class:`_Entry` hands that buffer on as it is, never through a leaf's ``.grad``: an empty
``.grad`` clones a gradient it cannot take over (torch ``functions/accumulate_grad.h``), which
would read a buffer still being reduced. The wait was placed at the end of the previous leg's
forward (the wait identity on the norm output, the collective's launch node), so it is the
first thing that leg's backward runs: between the launch and the wait run the legs the order
puts between them.

**DDP and weights.** Each leg is its own engine call, so a weight that ``p`` chunks' legs use has
its ``AccumulateGrad`` (and Megatron DDP's hook on it) run ``p`` times per micro-batch. Megatron-Core
0.19's bucket groups learn each parameter's count on the first batch
(``golden_per_param_grad_ready_counts``) and start a bucket's reduction once, after its last
leg; the hook asserts a gradient under ``overlap_grad_reduce``, so every leg call gives each
weight one (:mod:`.placeholder_grads`).

**Failure.** An exception inside a leg waits for every collective the step still has in flight
before it propagates, so no handle outlives the step's backward.

Chunk shapes are written for the batch split, ``[s, b/p, h]``; under the sequence split read
``[s/p, b, h]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["Leg", "LegBook", "backward_order"]


@dataclass(eq=False)
class _Hand:
    """Where the gradient of one leg entry goes: output ``index`` of leg ``source``, or, with no
    ``source``, input ``index`` of the step; ``grad`` is what the entry's backward received.
    ``tensor`` is the tensor handed over, held only until the entry is made."""

    source: Leg | None
    index: int
    tensor: torch.Tensor | None = None
    grad: torch.Tensor | None = None


class _Entry(torch.autograd.Function):
    """Forward: an alias of the hand's tensor, where a leg's graph begins; backward: the
    gradient handed to the :class:`_Hand` untouched (no ``AccumulateGrad``: it may be a buffer
    in flight).

    The tensor comes through the hand, not as an input, so that the new graph holds no edge to
    the old one and nothing keeps it alive but its own users (a leaf would be kept by its
    ``AccumulateGrad``: under sequence parallelism a reduce-scatter's output after its wait).
    The ``anchor``, an empty tensor that takes a gradient, makes the alias take one.
    """

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, hand: _Hand):
        ctx.hand = hand
        tensor, hand.tensor = hand.tensor, None
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hand.grad = grad
        return None, None


class Leg:
    """One chunk's ops between two cuts, on an autograd graph of its own.

    Args:
        chunk: the chunk's index ``c``.
        position: the leg's place in the chunk's chain (0: its first leg).
        op: the schedule op the leg begins with (``attention_core``, ...), for labels.
        layer: that op's layer.
    """

    def __init__(self, chunk: int, position: int, op: str, layer: int) -> None:
        self.chunk, self.position, self.op, self.layer = chunk, position, op, layer
        self.entries: list[_Hand] = []
        #: The outputs' places in the leg's graph (not the tensors: an output nothing else keeps
        #: for backward is freed, as in the graph without legs).
        self.outputs: list[torch.autograd.graph.GradientEdge] = []
        self.output_grads: list[torch.Tensor | None] = []
        self.ran = False

    def __repr__(self) -> str:
        return f"Leg(chunk={self.chunk}, {self.op} of layer {self.layer})"

    def enter(
        self, tensor: torch.Tensor, source: Leg | None, index: int, anchor: torch.Tensor
    ) -> torch.Tensor:
        """``tensor`` as a tensor of this leg's graph (behind :class:`_Entry`)."""
        hand = _Hand(source, index, tensor)
        self.entries.append(hand)
        return _Entry.apply(anchor, hand)

    def hand_out(self, tensor: torch.Tensor) -> int:
        """Make ``tensor`` (of this leg's graph) an output; its index."""
        self.outputs.append(torch.autograd.graph.get_gradient_edge(tensor))
        self.output_grads.append(None)
        return len(self.outputs) - 1

    def receive(self, index: int, grad: torch.Tensor) -> None:
        """Add ``grad`` to the gradient of output ``index`` (several only for the keys and values
        that later chunks read under the sequence split)."""
        if self.ran:
            raise RuntimeError(
                f"Domino bug: {self} received a gradient after its backward ran; the backward "
                "order broke a dependency between legs."
            )
        current = self.output_grads[index]
        self.output_grads[index] = grad if current is None else current + grad

    def run_backward(self) -> None:
        """Run this leg's graph backward from its outputs' gradients (one nested engine call,
        which frees the graph)."""
        pairs = [
            (o, g) for o, g in zip(self.outputs, self.output_grads, strict=True) if g is not None
        ]
        self.outputs, self.output_grads, self.ran = [], [], True
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def backward_order(chains: list[list[Leg]], *, lag: int, serial: bool = False) -> Iterator[Leg]:
    """The order in which the legs' backward runs: a wavefront over legs, last chunk first.

    ``chains[c]`` is chunk ``c``'s legs in forward order. At backward tick ``T`` chunk ``c`` runs
    its ``(T - lag * (p-1-c))``-th leg counted from its last, chunks from ``p-1`` down to 0. So
    between a chunk's leg and its next one (a collective launched by the first's backward and
    waited by the second's) run ``p - 1`` other chunks' legs: with ``lag`` 0 the other chunks'
    legs of the same position (below) and of the next (above); with ``lag`` 1 those one position
    behind and two ahead, which pairs each small leg with another chunk's large one when the
    chain cycles through legs of different sizes (the three legs per sub-layer under sequence
    parallelism; :mod:`.schedule` has the tables). Later chunks go first also because under the
    sequence split their legs hand gradients to the keys and values of earlier chunks' legs.

    ``serial`` (a negative control, ``--domino-backward-order serial``): each chunk's legs
    back to back, last chunk first: every collective launched at a cut is waited right after,
    with nothing of another chunk in between.
    """
    reversed_chains = [list(reversed(chain)) for chain in chains]
    p = len(chains)
    if serial:
        for chunk in reversed(range(p)):
            yield from reversed_chains[chunk]
        return
    longest = max((len(chain) for chain in chains), default=0)
    for tick in range(longest + lag * (p - 1)):
        for chunk in reversed(range(p)):
            position = tick - lag * (p - 1 - chunk)
            if 0 <= position < len(reversed_chains[chunk]):
                yield reversed_chains[chunk][position]


class _StepNode(torch.autograd.Function):
    """One outer node for all legs of a step: forward returns aliases of each chunk's last
    tensor; backward runs the legs (:meth:`LegBook.run_backward`)."""

    @staticmethod
    def forward(ctx, book: LegBook, last: list[torch.Tensor], *inputs: torch.Tensor):
        ctx.book = book
        return tuple(tensor.detach() for tensor in last)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        book, ctx.book = ctx.book, None
        return None, None, *book.run_backward(grads)


class LegBook:
    """The legs of one Domino step (one block forward, or one recomputed range of layers).

    Args:
        chunks: ``p``.
        lag: :func:`backward_order`'s lag for this step's cuts.
        serial: :func:`backward_order`'s negative control.
        in_flight: the step's backward collectives still in flight (drained on an exception).
    """

    def __init__(
        self,
        chunks: int,
        *,
        lag: int,
        serial: bool,
        in_flight: Callable[[], list],
    ) -> None:
        self.lag, self.serial, self._in_flight = lag, serial, in_flight
        self.chains: list[list[Leg]] = [[] for _ in range(chunks)]
        self.inputs: list[torch.Tensor] = []
        self._anchor: torch.Tensor | None = None
        self.ends: list[tuple[Leg, int]] = []
        self._node_inputs = 0

    def _open(self, chunk: int) -> Leg | None:
        chain = self.chains[chunk]
        return chain[-1] if chain else None

    def _source(self, chunk: int, tensor: torch.Tensor) -> tuple[Leg | None, int]:
        """Where ``tensor``, made by ``chunk``'s open leg or before its first, is handed from."""
        leg = self._open(chunk)
        if leg is not None:
            return leg, leg.hand_out(tensor)
        self.inputs.append(tensor)
        return None, len(self.inputs) - 1

    def cut(self, chunk: int, op: str, layer: int, *tensors: torch.Tensor | None) -> tuple:
        """End ``chunk``'s open leg with ``tensors`` (or, before its first leg, take them as
        inputs of the step) and begin its next leg, which starts with op ``op`` of layer
        ``layer``, from them: ``tensors`` as tensors of the new leg's graph (``None`` and
        tensors that take no gradient are passed on as they are)."""
        leg = Leg(chunk, len(self.chains[chunk]), op, layer)
        handed = []
        for tensor in tensors:
            if tensor is None or not tensor.requires_grad:
                handed.append(tensor)
                continue
            source, index = self._source(chunk, tensor)
            handed.append(leg.enter(tensor, source, index, self._anchor_for(tensor)))
        self.chains[chunk].append(leg)
        return tuple(handed)

    def share(self, owner: int, tensor: torch.Tensor) -> tuple[Leg | None, int] | None:
        """Hand ``tensor``, just made by chunk ``owner``'s open leg, to later chunks' legs (the
        keys and values ``[s/p, b, g/tp, d]`` of the sequence split): the token :meth:`borrow`
        takes, or ``None`` where ``tensor`` takes no gradient (later chunks read it as it is)."""
        return self._source(owner, tensor) if tensor.requires_grad else None

    def borrow(self, chunk: int, token: tuple[Leg | None, int], tensor: torch.Tensor):
        """``tensor``, shared by another chunk (:meth:`share`, ``token``), as a tensor of
        ``chunk``'s open leg; its gradient goes back to the sharing leg."""
        source, index = token
        return self._open(chunk).enter(tensor, source, index, self._anchor_for(tensor))

    def _anchor_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The step's anchor for :class:`_Entry` (made once, on ``tensor``'s device)."""
        if self._anchor is None:
            self._anchor = torch.empty(0, device=tensor.device, requires_grad=True)
        return self._anchor

    def finish(self, last: list[torch.Tensor]) -> list[torch.Tensor]:
        """End every chunk's leg with its last tensor ``last[c]`` (``[s, b/p, h]``) and put the
        step's node in place of the legs: the tensors to hand on, outside the legs."""
        for chunk, tensor in enumerate(last):
            leg = self._open(chunk)
            if leg is None:
                raise RuntimeError(f"Domino bug: chunk {chunk} ended its step without a leg.")
            self.ends.append((leg, leg.hand_out(tensor)))
        inputs, self.inputs = self.inputs, []
        if not any(tensor.requires_grad for tensor in inputs):
            # Nothing outside the legs takes a gradient (a frozen embedding): the anchor makes
            # the step's node part of the graph, so that the legs' weights still get theirs.
            inputs.append(self._anchor_for(last[0]))
        self._node_inputs = len(inputs)
        return list(_StepNode.apply(self, last, *inputs))

    def run_backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """The driver (``_StepNode``'s backward): run every leg in :func:`backward_order`; the
        gradients of the step's inputs (possibly still in flight, waited outside)."""
        for (leg, index), grad in zip(self.ends, grads, strict=True):
            if grad is not None:
                leg.receive(index, grad)
        input_grads: list[torch.Tensor | None] = [None] * self._node_inputs
        try:
            for leg in backward_order(self.chains, lag=self.lag, serial=self.serial):
                leg.run_backward()
                for hand in leg.entries:
                    if hand.grad is None:
                        continue
                    if hand.source is None:
                        input_grads[hand.index] = hand.grad
                    else:
                        hand.source.receive(hand.index, hand.grad)
                    hand.grad = None
        except BaseException:
            for collective in self._in_flight():
                collective.finish()
            raise
        finally:
            self.chains, self.ends = [], []
        return input_grads
