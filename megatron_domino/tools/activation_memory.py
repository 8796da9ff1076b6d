"""How many bytes autograd keeps for backward: stock Megatron-Core against Domino.

Domino must not give back the activation memory sequence parallelism saves: under
``--sequence-parallel`` stock Megatron keeps each column-parallel linear's input as this
rank's shard ``[s/tp, b, h]`` and all-gathers it again in backward, so Domino must too
(:class:`~megatron_domino.sequence_parallel.SavedInputRegather`). This module measures it.

:func:`saved_bytes` runs one forward under :func:`torch.autograd.graph.saved_tensors_hooks`
and sums the sizes of the distinct storages autograd saved, parameters left out (they exist
anyway): what one forward keeps alive until its backward. :func:`measure` does that on
``tp`` gloo ranks (:mod:`megatron_domino.harness.ranks`) for the stock model and for the same model
with Domino applied, and reports rank 0's numbers (every rank holds the same shapes).

The model is Llama-shaped (:data:`MODEL`: 2 layers, h = 256, s = 128, RMSNorm, SwiGLU, RoPE,
grouped-query attention with 16 heads and 8 groups, no biases), micro-batch 4, Domino
``p = 2``, sequence parallelism on. ``impl`` picks the layer implementation: Megatron's
``local`` linears, or ``te-stand-in``, the CPU stand-ins for Transformer Engine's linears in
``tests/te_stand_in.py`` (which keep TE's saving contract: under SP the fused norm + column
linear keeps its input and norm-output shards and re-gathers the latter in backward).

Command (``te-stand-in`` imports ``tests/te_stand_in.py``: run it from a checkout's root, or
point ``--stand-ins`` at that folder)::

    megatron-domino-activation-memory --tp 2 4 8 --impl local te-stand-in
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["IMPLS", "MODEL", "Measurement", "main", "measure", "measure_on_rank", "saved_bytes"]

#: The measured model (GPTOptions fields); heads and groups divide every TP size up to 8.
MODEL = dict(
    num_layers=2,
    hidden_size=256,
    num_attention_heads=16,
    num_query_groups=8,
    seq_length=128,
    vocab_size=512,
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    sequence_parallel=True,
)
MICRO_BATCH = 4
CHUNKS = 2
#: Layer implementations: name -> ``"module:function"`` returning the layer spec (``None``:
#: the default local spec).
IMPLS = {"local": None, "te-stand-in": "te_stand_in:stand_in_te_layer_spec"}
#: Where ``te_stand_in`` is imported from for ``te-stand-in`` (``--stand-ins``).
STAND_INS = Path("tests")


def saved_bytes(run, exclude: list[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` executes.

    Counts each storage once, at its full size (a saved view keeps its whole storage alive),
    and leaves out the storages of ``exclude`` (the parameters). Saved-tensor hooks that
    ``run`` pushes itself are innermost; Domino's pass what they keep on to these.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()  # not the tensor itself: a saved output would form a cycle

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        kept = run()
    del kept
    return sum(storages.values())


@dataclass(frozen=True)
class Measurement:
    """Saved bytes of one forward (rank 0) for one TP size and layer implementation."""

    impl: str
    tp: int
    stock: int
    domino: int

    @property
    def ratio(self) -> float:
        return self.domino / self.stock


def measure_on_rank(
    impls: list[str], model: dict, micro_batch: int, chunks: int
) -> dict[str, tuple[int, int]]:
    """On every rank: ``{impl: (stock, domino)}`` saved bytes of one forward of the model."""
    from megatron_domino.analysis.equivalence import token_batch
    from megatron_domino.apply import apply_domino
    from megatron_domino.config import DominoConfig
    from megatron_domino.harness.gpt_model import GPTOptions, build_gpt_model
    from megatron_domino.harness.ranks import _resolve

    options = GPTOptions(**model)
    batch = token_batch(options, micro_batch)
    found = {}
    for impl in impls:
        spec = IMPLS[impl]
        gpt = build_gpt_model(options, spec=_resolve(spec)() if spec else None)
        params = list(gpt.parameters())
        stock = saved_bytes(lambda gpt=gpt: gpt(**batch), params)
        with apply_domino(gpt, DominoConfig(chunks=chunks)):
            domino = saved_bytes(lambda gpt=gpt: gpt(**batch), params)
        found[impl] = (stock, domino)
    return found


def measure(
    tp_sizes, impls=tuple(IMPLS), *, model: dict = MODEL, micro_batch: int = MICRO_BATCH,
    chunks: int = CHUNKS, timeout_s: float = 600.0, stand_ins: Path = STAND_INS,
) -> list[Measurement]:  # fmt: skip
    """One :class:`Measurement` per TP size and implementation (``tp`` CPU ranks per size).

    ``stand_ins``: the folder ``te_stand_in`` is imported from, unless it imports already
    (under pytest, ``tests/`` is on the path).
    """
    from megatron_domino.harness.ranks import run_ranks

    stand_ins = str(Path(stand_ins).resolve())
    if any(IMPLS[impl] for impl in impls) and stand_ins not in sys.path:
        if importlib.util.find_spec("te_stand_in") is None:
            sys.path.insert(0, stand_ins)  # the spawned ranks inherit it
    results = []
    for tp in tp_sizes:
        found = run_ranks(
            "megatron_domino.tools.activation_memory:measure_on_rank",
            tp,
            device="cpu",
            args=(list(impls), model, micro_batch, chunks),
            timeout_s=timeout_s,
        )[0]
        results += [Measurement(impl, tp, *found[impl]) for impl in impls]
    return results


def _table(results: list[Measurement]) -> str:
    lines = [
        "| impl | TP | stock SP (MiB) | Domino (MiB) | Domino / stock |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.impl} | {r.tp} | {r.stock / 2**20:.2f} | {r.domino / 2**20:.2f} | "
            f"{r.ratio:.3f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-domino-activation-memory",
        description="Saved-activation bytes of one forward, stock sequence parallelism vs "
        "Domino (p = 2), on CPU gloo ranks.",
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="TP sizes (ranks)")
    parser.add_argument(
        "--impl", nargs="+", choices=sorted(IMPLS), default=list(IMPLS), help="layer impls"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--stand-ins",
        type=Path,
        default=STAND_INS,
        help="folder holding te_stand_in.py, for --impl te-stand-in (default: tests)",
    )
    args = parser.parse_args(argv)
    results = measure(args.tp, args.impl, stand_ins=args.stand_ins)
    print(
        f"model {MODEL}, micro-batch {MICRO_BATCH}, Domino chunks {CHUNKS}; "
        "bytes autograd saves for one forward (rank 0, parameters excluded)"
    )
    print(_table(results))
    if args.json:
        rows = [dict(asdict(r), ratio=r.ratio) for r in results]
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
