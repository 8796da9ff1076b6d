"""Per layer stack, stock Megatron-Core against Domino: live bytes, FP8 casts, TP bytes.

Domino must not give back what stock keeps small: the activation memory sequence parallelism
saves (under ``--sequence-parallel`` stock keeps each column-parallel linear's input as this
rank's shard ``[s/tp, b, h]`` and all-gathers it again in backward, so Domino must too:
:class:`~megatron_domino.communication.saved_shards.SavedInputRegather`), Transformer Engine's one cached
FP8 copy of each weight, and the tensor-parallel bytes on the wire. This module accounts for
all three in one forward and backward of the same model and batch, stock and with Domino:

* **alive**: :func:`live_bytes`, every storage the forward allocated that is still alive when
  it returns, parameters left out (they exist anyway): what autograd saved, and anything else
  kept until the backward (a tensor a collective or a Domino object still holds), which a
  count of what passes the saved-tensor hooks would not see;
* **casts**: FP8 casts of a weight (``transformer_engine_torch.quantize`` called on a
  parameter), for the first micro-batch of a global batch (stock: one per weight);
* **fwd / bwd bytes**: payload of every TP collective (:mod:`lab.analysis.collective_bytes`), forward and backward apart.

:func:`measure` runs that on ``tp`` gloo ranks (:mod:`lab.launch.ranks`) and
reports rank 0's numbers (every rank holds the same shapes). The model is Llama-shaped, bf16
(:data:`MODEL`: 2 layers, h = 256, s = 128, RMSNorm, SwiGLU, RoPE, grouped-query attention
with 16 heads and 8 groups, no biases), micro-batch 4, Domino ``p = 2``, sequence
parallelism on; shape ``coincident`` sets the FFN so that fc1's weight ``[2 ffn / tp, h]`` is
``[h, h]`` and a chunk has ``h`` tokens: where a rank-specific saved tensor looks like the
gathered input. ``impl`` is Megatron's ``local`` linears or ``te``: Transformer Engine's own
layers in the form Domino runs under sequence parallelism (:mod:`megatron_domino.specs.te_spec`,
norms apart); precision ``fp8`` (TE only) runs them in FP8 with the ``--fp8-recipe``
given (``delayed`` by default) and fused weight-gradient accumulation, as Megatron-LM runs by
default. Without a GPU, TE's Python runs over the test suite's CPU backend for its compiled
extension (``tests/te_cpu``): run the command from a checkout's root, or point ``--te-cpu`` at
that folder.

Command::

    python -m lab.activation_memory --tp 2 4 8 --impl local te --precision bf16 fp8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lab.models.model_options import LLAMA_FLAVOUR

__all__ = [
    "IMPLS",
    "MODEL",
    "Accounting",
    "Measurement",
    "counting_weight_casts",
    "live_bytes",
    "main",
    "measure",
    "measure_on_rank",
]

#: The measured model (GPTOptions fields); heads and groups divide every TP size up to 8.
MODEL = dict(
    num_layers=2, hidden_size=256, num_attention_heads=16, num_query_groups=8, seq_length=128,
    vocab_size=512, **LLAMA_FLAVOUR, sequence_parallel=True, bf16=True,
)  # fmt: skip
MICRO_BATCH = 4
CHUNKS = 2
#: Layer implementations: name -> ``"module:function"`` returning the layer spec (``None``:
#: the default local spec).
IMPLS = {"local": None, "te": "megatron_domino.specs.te_spec:te_norms_apart_layer_spec"}
PRECISIONS = ("bf16", "fp8")
SHAPES = ("llama", "coincident")
#: Where the CPU backend of TE's extension (``te_cpu``) is imported from (``--te-cpu``).
TE_CPU = Path("tests")
#: What the TE ranks' fork server imports: TE booted on the CPU before Megatron-Core.
TE_PRELOAD = ("torch", "te_cpu.booted")


class _LiveStorages(TorchDispatchMode):
    """While entered: a weak reference to every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made.extend(weakref.ref(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    def alive(self, exclude: list[torch.Tensor]) -> int:
        """Bytes of the distinct storages still alive, those of ``exclude`` left out."""
        excluded = {t.untyped_storage().data_ptr() for t in exclude}
        storages = {}
        for ref in self.made:
            tensor = ref()
            if tensor is not None:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in excluded:
                    storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def live_bytes(run, exclude: list[torch.Tensor] = ()) -> tuple[int, object]:
    """``(bytes, result)``: the storages that ``run()`` allocated and that are alive when it
    returns, each counted once at its full size (a view keeps its whole storage), those of
    ``exclude`` (the parameters) left out; and what ``run`` returned (alive too)."""
    with _LiveStorages() as made:
        result = run()
    return made.alive(list(exclude)), result


@contextlib.contextmanager
def counting_weight_casts(params: list[torch.Tensor]):
    """``[count]`` of FP8 casts of any of ``params`` (Transformer Engine's ``quantize``
    called on a parameter) while entered; ``[0]`` where TE is not loaded."""
    count = [0]
    extension = sys.modules.get("transformer_engine_torch")
    if extension is None:
        yield count
        return
    quantize, ids = extension.quantize, {id(param) for param in params}

    def counted(tensor, *args, **kwargs):
        count[0] += id(tensor) in ids
        return quantize(tensor, *args, **kwargs)

    extension.quantize = counted
    try:
        yield count
    finally:
        extension.quantize = quantize


@dataclass(frozen=True)
class Accounting:
    """One arm's forward and backward (rank 0): live bytes, FP8 weight casts, TP bytes."""

    alive: int
    casts: int
    forward_bytes: int
    backward_bytes: int


@dataclass(frozen=True)
class Measurement:
    """Stock against Domino for one layer implementation, precision, shape and TP size."""

    impl: str
    precision: str
    shape: str
    tp: int
    stock: Accounting
    domino: Accounting

    @property
    def ratio(self) -> float:
        """Domino's live bytes over stock's."""
        return self.domino.alive / self.stock.alive


def _model(shape: str, tp: int) -> dict:
    """:data:`MODEL`, or with ``coincident`` its FFN set so fc1's ``[2 ffn / tp, h]`` is
    ``[h, h]`` (a chunk ``[s, b/p, h]`` has ``s b / p = h`` tokens at the defaults)."""
    if shape == "llama":
        return MODEL
    return dict(MODEL, ffn_hidden_size=MODEL["hidden_size"] * tp // 2)


def _account(gpt, batch: dict, *, fused_wgrad: bool) -> Accounting:
    """One forward and backward of ``gpt`` on ``batch``, the first micro-batch of a global
    batch (Megatron's ``set_is_first_microbatch``); with ``fused_wgrad`` TE's linears
    accumulate weight gradients into ``main_grad`` (``--gradient-accumulation-fusion``).

    An unmeasured step comes first: a process's first step allocates what then lives as long
    as the process (TE's cuBLAS workspace, 32 MiB on Hopper), which is no activation."""
    from lab.analysis.collective_bytes import CollectiveBytes

    linears = [m for m in gpt.modules() if hasattr(m, "fuse_wgrad_accumulation")]
    params = list(gpt.parameters())
    for _warm_up_then_measured in range(2):
        for linear in linears:
            linear.is_first_microbatch = True
            linear.fuse_wgrad_accumulation = fused_wgrad
        if fused_wgrad:  # as Megatron DDP prepares every parameter
            for param in params:
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
                param.grad_added_to_main_grad = False
        gpt.zero_grad(set_to_none=True)
        with CollectiveBytes() as forward, counting_weight_casts(params) as casts:
            alive, loss = live_bytes(lambda: gpt(**batch), params)
        with CollectiveBytes() as backward:
            loss.float().mean().backward()
        del loss
    return Accounting(alive, casts[0], forward.total, backward.total)


def measure_on_rank(
    cases: list[tuple[str, str, str]], micro_batch: int, chunks: int, recipe: str = "delayed"
) -> dict[tuple, tuple[Accounting, Accounting]]:
    """On every rank: ``{(impl, precision, shape): (stock, domino)}`` accountings."""
    from megatron.core import parallel_state

    from lab.analysis.equivalence import token_batch
    from lab.launch.ranks import import_target
    from lab.models.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    found = {}
    for impl, precision, shape in cases:
        te = IMPLS[impl] is not None
        options = GPTOptions(
            **_model(shape, tp),
            transformer_impl="transformer_engine" if te else "local",
            fp8_format="hybrid" if precision == "fp8" else None,
            fp8_recipe=recipe,
        )
        batch = token_batch(options, micro_batch)
        gpt = build_gpt_model(options, spec=import_target(IMPLS[impl])() if te else None)
        fused = precision == "fp8"
        stock = _account(gpt, batch, fused_wgrad=fused)
        with apply_domino(gpt, DominoConfig(chunks=chunks)):
            domino = _account(gpt, batch, fused_wgrad=fused)
        found[impl, precision, shape] = (stock, domino)
    return found


def cases_for(impls, precisions, shapes) -> list[tuple[str, str, str]]:
    """Every ``(impl, precision, shape)``; FP8 runs on TE's layers only."""
    return [
        (impl, precision, shape)
        for impl in impls
        for precision in precisions
        for shape in shapes
        if precision == "bf16" or IMPLS[impl]
    ]


def measure(
    tp_sizes, impls=tuple(IMPLS), precisions=("bf16",), shapes=("llama",), *,
    micro_batch: int = MICRO_BATCH, chunks: int = CHUNKS, recipe: str = "delayed",
    timeout_s: float = 600.0, te_cpu: Path = TE_CPU,
) -> list[Measurement]:  # fmt: skip
    """One :class:`Measurement` per TP size and case (``tp`` CPU ranks per size).

    ``te_cpu``: the folder the CPU backend of TE's extension (``te_cpu``) is imported from for
    ``impl`` ``te``, unless it imports already (under pytest, ``tests/`` is on the path).
    """
    import importlib.util

    from lab.launch.ranks import CPU_PRELOAD, run_ranks

    te = any(IMPLS[impl] for impl in impls)
    if te and importlib.util.find_spec("te_cpu") is None:
        sys.path.insert(0, str(Path(te_cpu).resolve()))  # the ranks' server inherits it
    cases = cases_for(impls, precisions, shapes)
    results = []
    for tp in tp_sizes:
        print(f"accounting {len(cases)} cases on {tp} CPU ranks ...", flush=True)
        found = run_ranks(
            "lab.activation_memory:measure_on_rank",
            tp,
            device="cpu",
            args=(cases, micro_batch, chunks, recipe),
            timeout_s=timeout_s,
            preload=(*TE_PRELOAD, *CPU_PRELOAD) if te else CPU_PRELOAD,
        )[0]
        results += [Measurement(*case, tp, *found[case]) for case in cases]
    return results


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f}"


def table(results: list[Measurement]) -> str:
    """The accounting as a markdown table: stock / Domino per column."""
    lines = [
        "| impl | precision | shape | TP | alive MiB stock / Domino | ratio | FP8 casts "
        "stock / Domino | TP fwd MiB stock / Domino | TP bwd MiB stock / Domino |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, d = r.stock, r.domino
        lines.append(
            f"| {r.impl} | {r.precision} | {r.shape} | {r.tp} | {_mib(s.alive)} / "
            f"{_mib(d.alive)} | {r.ratio:.3f}x | {s.casts} / {d.casts} | "
            f"{_mib(s.forward_bytes)} / {_mib(d.forward_bytes)} | "
            f"{_mib(s.backward_bytes)} / {_mib(d.backward_bytes)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.activation_memory",
        description="Live activation bytes, FP8 weight casts and TP collective bytes of one "
        "forward and backward, stock sequence parallelism vs Domino (p = 2), on CPU gloo ranks.",
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="TP sizes (ranks)")
    parser.add_argument(
        "--impl", nargs="+", choices=sorted(IMPLS), default=list(IMPLS), help="layer impls"
    )
    parser.add_argument(
        "--precision", nargs="+", choices=PRECISIONS, default=["bf16"],
        help="bf16, and fp8 (TE layers only)",
    )  # fmt: skip
    parser.add_argument(
        "--shape", nargs="+", choices=SHAPES, default=["llama"],
        help="llama, and coincident (fc1's weight shaped like a chunk's gathered input)",
    )  # fmt: skip
    parser.add_argument(
        "--fp8-recipe", default="delayed", help="Megatron-LM's --fp8-recipe for --precision fp8"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--te-cpu",
        type=Path,
        default=TE_CPU,
        help="folder holding te_cpu/ (TE's extension on the CPU), for --impl te (default: tests)",
    )
    args = parser.parse_args(argv)
    results = measure(
        args.tp, args.impl, args.precision, args.shape, recipe=args.fp8_recipe, te_cpu=args.te_cpu
    )
    print(
        f"model {MODEL}, micro-batch {MICRO_BATCH}, Domino chunks {CHUNKS}; one forward and "
        "backward, rank 0: bytes the forward leaves alive (parameters excluded), FP8 weight "
        "casts, TP collective payload"
    )
    print(table(results))
    if args.json:
        rows = [dict(asdict(r), ratio=r.ratio) for r in results]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
