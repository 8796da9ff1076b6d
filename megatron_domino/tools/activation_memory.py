"""Per layer stack, stock Megatron-Core against Domino: saved bytes, FP8 casts, TP bytes.

Domino must not give back what stock keeps small: the activation memory sequence parallelism
saves (under ``--sequence-parallel`` stock keeps each column-parallel linear's input as this
rank's shard ``[s/tp, b, h]`` and all-gathers it again in backward, so Domino must too:
:class:`~megatron_domino.saved_shards.SavedInputRegather`), Transformer Engine's one cached
FP8 copy of each weight, and the tensor-parallel bytes on the wire. This module accounts for
all three in one forward and backward of the same model and batch, stock and with Domino:

* **saved**: :func:`saved_bytes`, the distinct storages autograd keeps from the forward until
  its backward, parameters left out (they exist anyway);
* **casts**: FP8 weight casts (the TE stand-ins count them, ``tests/te_fp8_stand_in.py``), for
  the first micro-batch of a global batch (stock: one per weight);
* **fwd / bwd bytes**: payload of every TP collective (:mod:`megatron_domino.analysis.
  collective_bytes`), forward and backward apart.

:func:`measure` runs that on ``tp`` gloo ranks (:mod:`megatron_domino.harness.ranks`) and
reports rank 0's numbers (every rank holds the same shapes). The model is Llama-shaped, bf16
(:data:`MODEL`: 2 layers, h = 256, s = 128, RMSNorm, SwiGLU, RoPE, grouped-query attention
with 16 heads and 8 groups, no biases), micro-batch 4, Domino ``p = 2``, sequence
parallelism on; shape ``coincident`` sets the FFN so that fc1's weight ``[2 ffn / tp, h]`` is
``[h, h]`` and a chunk has ``h`` tokens: where a rank-specific saved tensor looks like the
gathered input. ``impl`` is Megatron's ``local`` linears or ``te-stand-in`` (the CPU stand-ins
for Transformer Engine's in ``tests/te_stand_in.py``, which keep TE 2.x's saving and caching
contract, in the layer form Domino runs under sequence parallelism:
:mod:`megatron_domino.te_spec`, norms apart); precision ``fp8`` runs the stand-ins' FP8 weight
contract with fused weight-gradient accumulation, as Megatron-LM runs by default (TE
stand-ins only).

Command (``te-stand-in`` imports ``tests/te_stand_in.py``: run it from a checkout's root, or
point ``--stand-ins`` at that folder)::

    megatron-domino-activation-memory --tp 2 4 8 --impl local te-stand-in --precision bf16 fp8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from megatron_domino.harness.model_options import LLAMA_FLAVOUR

__all__ = [
    "IMPLS",
    "MODEL",
    "Accounting",
    "Measurement",
    "main",
    "measure",
    "measure_on_rank",
    "saved_bytes",
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
IMPLS = {"local": None, "te-stand-in": "te_stand_in:stand_in_te_norms_apart_layer_spec"}
#: The TE stand-ins' FP8 context (``fp8`` precision).
FP8_CONTEXT = "te_stand_in:fp8_stand_in"
PRECISIONS = ("bf16", "fp8")
SHAPES = ("llama", "coincident")
#: Where ``te_stand_in`` is imported from for ``te-stand-in`` (``--stand-ins``).
STAND_INS = Path("tests")


def saved_bytes(run, exclude: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` executes.

    Counts each storage once, at its full size (a saved view keeps its whole storage alive),
    and leaves out the storages of ``exclude`` (the parameters). Saved-tensor hooks that
    ``run`` pushes itself are innermost; Domino's pass what they keep on to these.
    """
    saved, kept = _saved_bytes_and_output(run, exclude)
    del kept
    return saved


def _saved_bytes_and_output(run, exclude) -> tuple[int, object]:
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        for storage in _storages(tensor):
            if storage.data_ptr() not in excluded:
                storages[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()  # not the tensor itself: a saved output would form a cycle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        kept = run()
    return sum(storages.values()), kept


def _storages(tensor: torch.Tensor) -> list:
    """The storages a saved tensor holds: its own, or a quantized tensor's parts (Transformer
    Engine's ``Float8Tensor`` is a storage-less wrapper of ``_data``, ``_transpose`` and
    ``_scale_inv``)."""
    parts = [getattr(tensor, name, None) for name in ("_data", "_transpose", "_scale_inv")]
    parts = [part for part in parts if isinstance(part, torch.Tensor)]
    return [part.untyped_storage() for part in parts] if parts else [tensor.untyped_storage()]


@dataclass(frozen=True)
class Accounting:
    """One arm's forward and backward (rank 0): saved bytes, FP8 weight casts, TP bytes."""

    saved: int
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
        """Domino's saved bytes over stock's."""
        return self.domino.saved / self.stock.saved


def _model(shape: str, tp: int) -> dict:
    """:data:`MODEL`, or with ``coincident`` its FFN set so fc1's ``[2 ffn / tp, h]`` is
    ``[h, h]`` (a chunk ``[s, b/p, h]`` has ``s b / p = h`` tokens at the defaults)."""
    if shape == "llama":
        return MODEL
    return dict(MODEL, ffn_hidden_size=MODEL["hidden_size"] * tp // 2)


def _account(gpt, batch: dict, fp8_context, *, fused_wgrad: bool) -> Accounting:
    """One forward and backward of ``gpt`` on ``batch``, the first micro-batch of a global
    batch (Megatron's ``set_is_first_microbatch``); with ``fused_wgrad`` the stand-ins
    accumulate weight gradients into ``main_grad`` (``--gradient-accumulation-fusion``)."""
    from megatron_domino.analysis.collective_bytes import CollectiveBytes

    linears = [m for m in gpt.modules() if hasattr(m, "fp8_casts")]
    for linear in linears:
        linear.is_first_microbatch, linear.fp8_casts = True, 0
    if fused_wgrad:  # as Megatron DDP prepares every parameter
        for linear in linears:
            linear.fuse_wgrad_accumulation = True
        for param in gpt.parameters():
            param.main_grad = torch.zeros_like(param, dtype=torch.float32)
            param.grad_added_to_main_grad = False
    gpt.zero_grad(set_to_none=True)
    params = list(gpt.parameters())
    with CollectiveBytes() as forward, fp8_context():
        saved, loss = _saved_bytes_and_output(lambda: gpt(**batch), params)
    with CollectiveBytes() as backward:
        loss.float().mean().backward()
    casts = sum(linear.fp8_casts for linear in linears)
    return Accounting(saved, casts, forward.total, backward.total)


def measure_on_rank(
    cases: list[tuple[str, str, str]], micro_batch: int, chunks: int
) -> dict[tuple, tuple[Accounting, Accounting]]:
    """On every rank: ``{(impl, precision, shape): (stock, domino)}`` accountings."""
    import contextlib

    from megatron.core import parallel_state

    from megatron_domino.analysis.equivalence import token_batch
    from megatron_domino.apply import apply_domino
    from megatron_domino.config import DominoConfig
    from megatron_domino.harness.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.harness.ranks import import_target

    tp = parallel_state.get_tensor_model_parallel_world_size()
    found = {}
    for impl, precision, shape in cases:
        options = GPTOptions(**_model(shape, tp))
        batch = token_batch(options, micro_batch)
        spec = IMPLS[impl]
        gpt = build_gpt_model(options, spec=import_target(spec)() if spec else None)
        fp8 = import_target(FP8_CONTEXT) if precision == "fp8" else contextlib.nullcontext
        fused = precision == "fp8"
        stock = _account(gpt, batch, fp8, fused_wgrad=fused)
        with apply_domino(gpt, DominoConfig(chunks=chunks)):
            domino = _account(gpt, batch, fp8, fused_wgrad=fused)
        found[impl, precision, shape] = (stock, domino)
    return found


def cases_for(impls, precisions, shapes) -> list[tuple[str, str, str]]:
    """Every ``(impl, precision, shape)``; FP8 runs on the TE stand-ins only."""
    return [
        (impl, precision, shape)
        for impl in impls
        for precision in precisions
        for shape in shapes
        if precision == "bf16" or IMPLS[impl]
    ]


def measure(
    tp_sizes, impls=tuple(IMPLS), precisions=("bf16",), shapes=("llama",), *,
    micro_batch: int = MICRO_BATCH, chunks: int = CHUNKS, timeout_s: float = 600.0,
    stand_ins: Path = STAND_INS,
) -> list[Measurement]:  # fmt: skip
    """One :class:`Measurement` per TP size and case (``tp`` CPU ranks per size).

    ``stand_ins``: the folder ``te_stand_in`` is imported from, unless it imports already
    (under pytest, ``tests/`` is on the path).
    """
    from megatron_domino.harness.ranks import run_ranks

    stand_ins = str(Path(stand_ins).resolve())
    if any(IMPLS[impl] for impl in impls) and stand_ins not in sys.path:
        if importlib.util.find_spec("te_stand_in") is None:
            sys.path.insert(0, stand_ins)  # the spawned ranks inherit it
    cases = cases_for(impls, precisions, shapes)
    results = []
    for tp in tp_sizes:
        print(f"accounting {len(cases)} cases on {tp} CPU ranks ...", flush=True)
        found = run_ranks(
            "megatron_domino.tools.activation_memory:measure_on_rank",
            tp,
            device="cpu",
            args=(cases, micro_batch, chunks),
            timeout_s=timeout_s,
        )[0]
        results += [Measurement(*case, tp, *found[case]) for case in cases]
    return results


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f}"


def table(results: list[Measurement]) -> str:
    """The accounting as a markdown table: stock / Domino per column."""
    lines = [
        "| impl | precision | shape | TP | saved MiB stock / Domino | ratio | FP8 casts "
        "stock / Domino | TP fwd MiB stock / Domino | TP bwd MiB stock / Domino |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, d = r.stock, r.domino
        lines.append(
            f"| {r.impl} | {r.precision} | {r.shape} | {r.tp} | {_mib(s.saved)} / "
            f"{_mib(d.saved)} | {r.ratio:.3f}x | {s.casts} / {d.casts} | "
            f"{_mib(s.forward_bytes)} / {_mib(d.forward_bytes)} | "
            f"{_mib(s.backward_bytes)} / {_mib(d.backward_bytes)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-domino-activation-memory",
        description="Saved-activation bytes, FP8 weight casts and TP collective bytes of one "
        "forward and backward, stock sequence parallelism vs Domino (p = 2), on CPU gloo ranks.",
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="TP sizes (ranks)")
    parser.add_argument(
        "--impl", nargs="+", choices=sorted(IMPLS), default=list(IMPLS), help="layer impls"
    )
    parser.add_argument(
        "--precision", nargs="+", choices=PRECISIONS, default=["bf16"],
        help="bf16, and fp8 (the TE stand-ins' FP8 weight contract)",
    )  # fmt: skip
    parser.add_argument(
        "--shape", nargs="+", choices=SHAPES, default=["llama"],
        help="llama, and coincident (fc1's weight shaped like a chunk's gathered input)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--stand-ins",
        type=Path,
        default=STAND_INS,
        help="folder holding te_stand_in.py, for --impl te-stand-in (default: tests)",
    )
    args = parser.parse_args(argv)
    results = measure(args.tp, args.impl, args.precision, args.shape, stand_ins=args.stand_ins)
    print(
        f"model {MODEL}, micro-batch {MICRO_BATCH}, Domino chunks {CHUNKS}; one forward and "
        "backward, rank 0: bytes autograd saves (parameters excluded), FP8 weight casts, TP "
        "collective payload"
    )
    print(table(results))
    if args.json:
        rows = [dict(asdict(r), ratio=r.ratio) for r in results]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
