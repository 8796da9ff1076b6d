"""Domino on Transformer Engine's own layers (TE's Python on the CPU, :mod:`te_cpu`).

Each rank builds a TP = 2 model of real TE modules (:mod:`te_models`: Megatron-Core's TE spec
without sequence parallelism, the norms-apart spec Domino runs under it), runs a forward and
backward with the stock block, then with Domino per setting, then stock again after
``revert``, and compares the per-token loss and every gradient
(:func:`~lab.analysis.equivalence.compare_with_stock`), in three precisions:

* fp32: element-wise, ``atol = 1e-6, rtol = 1e-5``
  (:data:`lab.analysis.equivalence.TOLERANCES`);
* bf16, and bf16 with FP8 delayed scaling (``--fp8-format hybrid``, TE's real ``fp8_autocast``
  and its FP8 casts, GEMMs and amax/scale updates on the CPU backend): norm-relative error
  against an fp32 model with the same weights, within ``1.5 x`` stock's own error per tensor
  (:data:`~lab.analysis.equivalence.BF16_BOUND`). Under FP8 every step updates
  TE's scales and amax histories, so every run starts from the same FP8 state
  (:func:`te_models.fp8_start_fixed`), and Domino's FP8 state after the step is compared with
  stock's (under SP: stock's on the fused layer, whose FP8 numerics Domino reproduces).

Under sequence parallelism the norms' weight gradients are compared after summing them over
the TP ranks (what ``finalize_model_grads`` does for parameters marked ``sequence_parallel``):
only the totals agree. What TE ran is read from TE itself (:class:`te_models.TECalls`: each
linear call's ``parallel_mode``, ``sequence_parallel``, ``is_first_microbatch`` and FP8
autocast). What this does not show: TE's CUDA kernels (cuBLAS, fused norms, attention
backends), which ``tests/gpu/test_transformer_engine_gpu.py`` runs on two GPUs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from multiproc import run_on_ranks
from te_models import (
    FP8_DELAYED,
    LAYERS,
    LinearCall,
    TECalls,
    fp8_meta_state,
    fp8_start_fixed,
    load_fp8_meta_state,
    te_options,
    te_spec,
)

from lab.analysis.equivalence import (
    compare_with_stock,
    forward_backward,
    fp32_reference_model,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import build_gpt_model
from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig, DominoUnsupportedError
from megatron_domino.base.settings import setting as named_setting

pytestmark = pytest.mark.te

#: The settings (names: megatron_domino.base.settings). Without SP, TE keeps its backward
#: all-reduce, so backward overlap must be off (see refusals.te_problems).
SETTINGS = [
    named_setting(name)
    for name in (
        "sp-p2",
        "sp-p4",
        "sp-p2-intra-layer",
        "p2-no-backward-overlap",
        "p4-no-backward-overlap",
    )
]
#: The precisions compared: fp32 for every setting; bf16 and FP8 (delayed) for the first
#: setting of each SP mode (the precision changes TE's casts, not Domino's schedule).
PRECISIONS = {
    "fp32": {},
    "bf16": dict(bf16=True),
    "fp8": dict(bf16=True, **FP8_DELAYED),
    # The other recipes' schedule: the same collectives, overlapped the same way (under
    # tensorwise the gathered casts' amax reductions run on a group of their own,
    # tests/ranks/test_te_amax_group.py; their numerics: tests/ranks/test_te_fp8_gradients.py).
    # At these shapes TE gathers blockwise's shards in bf16, synchronously (Domino warns):
    # its spans order as the schedule launches and waits, the gather itself is a GPU's to time.
    "fp8-tensorwise": dict(bf16=True, fp8_format="hybrid", fp8_recipe="tensorwise"),
    "fp8-blockwise": dict(bf16=True, fp8_format="hybrid", fp8_recipe="blockwise"),
}


def _compare(sequence_parallel: bool) -> dict:
    """On every rank: each setting against the stock block, per precision; spans, TE calls and
    (FP8) TE's FP8 state per setting."""
    settings = [n for n in SETTINGS if n.sequence_parallel == sequence_parallel]
    return {
        precision: _compare_in(
            te_options(sequence_parallel, **changes),
            settings if precision == "fp32" else settings[:1],
        )
        for precision, changes in PRECISIONS.items()
    }


def _compare_in(options, named: list) -> dict:
    """:func:`compare_with_stock` on a model built from ``options``, TE's calls logged. Under
    FP8, one step runs first (TE allocates its FP8 state in the first FP8 call); under delayed
    scaling every run then starts from the same FP8 state, and the state after stock's run
    (read once the two stock runs are done) and after each setting's step are kept (current
    and block scaling carry no state from step to step)."""
    spec = te_spec(options.sequence_parallel)
    model = build_gpt_model(options, spec=spec)
    batch = token_batch(options, 4)
    reference = fp32_reference_model(options, model, spec=spec) if options.bf16 else None
    fp8 = options.fp8_format is not None
    delayed = fp8 and options.fp8_recipe == "delayed"
    if fp8:
        forward_backward(model, batch)
    observed = []  # after the stock runs, then after each setting's step

    # Only delayed scaling carries state from step to step (scales, amax histories).
    fixed = fp8_start_fixed(model) if delayed else contextlib.nullcontext({})
    with TECalls(model) as calls, fixed as start:

        def observe() -> dict:
            fp8_state = fp8_meta_state(model) if delayed else {}
            observed.append(dict(calls=calls.take(), fp8_state=fp8_state))
            return observed[-1]

        comparison = compare_with_stock(
            model, batch, {n.name: n.config for n in named}, tolerance_for(options),
            fp32_reference=reference, record=True, observe=observe,
        )  # fmt: skip
    stock = observed[0]
    # Under SP and FP8, Domino casts the norm's fp32 output to FP8 as the fused layer does.
    stock_fp8_state = stock["fp8_state"]
    if delayed and options.sequence_parallel:
        stock_fp8_state = _fused_stock_fp8_state(options, model, batch, start)
    found = dict(
        revert=comparison.revert_error,
        noise=comparison.stock_noise,
        stock_calls=[c for module in stock["calls"] for c in module],
        fp8_start=sorted(start),
        fp8_step_changed=sorted(_differences(stock["fp8_state"], start)),
        settings={},
    )
    for name, compared in comparison.settings.items():
        found["settings"][name] = dict(
            passed=compared.passed,
            mismatches=compared.mismatches[:3],
            pending=compared.left_pending,
            spans=compared.spans,
            calls=[c for module in compared.observed["calls"] for c in module],
            max_error=compared.max_error,
            fp8_differences=_differences(compared.observed["fp8_state"], stock_fp8_state),
        )
    return found


def _fused_stock_fp8_state(options, model, batch, start: dict) -> dict:
    """Under SP: the FP8 state after one step of stock as Megatron-LM builds it without
    ``--spec`` (norms fused into the column linears), with ``model``'s weights (its plain
    ``state_dict`` loads into the fused layer; TE's pickled ``_extra_state`` is left out), from
    the FP8 state ``start``. Its first step allocates TE's FP8 state (and caches the FP8
    weights, cast from TE's initial state as ``model``'s were)."""
    fused = build_gpt_model(options, spec=te_spec(True, fused_norms=True))
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    fused.load_state_dict(weights, strict=False)
    forward_backward(fused, batch)
    load_fp8_meta_state(fused, start)
    forward_backward(fused, batch)
    return fp8_meta_state(fused)


def _differences(state: dict, stock: dict) -> dict:
    """Per FP8 state tensor that differs from stock's: the largest relative difference."""
    assert state.keys() == stock.keys()
    return {
        key: (
            (state[key] - stock[key]).abs().max() / stock[key].abs().max().clamp(min=1e-30)
        ).item()
        for key in stock
        if not torch.equal(state[key], stock[key])
    }


@pytest.fixture(scope="module", params=[True, False], ids=["sequence-parallel", "no-sp"])
def compared(request):
    return request.param, run_on_ranks(_compare, 2, args=(request.param,), te=True)[0]


def test_matches_stock_and_runs_te_without_its_collectives(compared):
    """Loss and gradients match stock in fp32 (within 1e-6), bf16 and FP8 (the bf16 bound),
    nothing left in flight, and the revert restores stock exactly. Stock's TE calls ran with
    TE's own collectives (``row``/``column``, ``sequence_parallel`` as the model); every TE
    linear call made by Domino ran without them, except the column linears without sequence
    parallelism, which keep TE's backward all-reduce; under FP8 every one ran inside an FP8
    autocast (without it TE runs bf16 GEMMs, which the bf16 bound alone would let through)."""
    sequence_parallel, results = compared
    for precision, found in results.items():
        assert (found["revert"], found["noise"]) == (0.0, 0.0), precision
        linears = {c for c in found["stock_calls"] if isinstance(c, LinearCall)}
        assert {(c.parallel_mode, c.sequence_parallel) for c in linears} == {
            ("row", sequence_parallel), ("column", sequence_parallel)
        }, precision  # fmt: skip
        for setting, checked in found["settings"].items():
            assert checked["passed"], (
                precision,
                setting,
                checked["mismatches"],
                checked["pending"],
            )
            if precision == "fp32":
                assert checked["max_error"] < 1e-6, setting
            calls = [c for c in checked["calls"] if isinstance(c, LinearCall)]
            modes = {(call.parallel_mode, call.sequence_parallel) for call in calls}
            expected = {(None, False)} if sequence_parallel else {(None, False), ("column", False)}
            assert modes == expected, (precision, setting, modes)
            in_fp8 = {call.depth == 1 for call in calls}
            assert in_fp8 == {precision.startswith("fp8")}, (precision, setting, in_fp8)


def test_fp8_state_after_a_step_equals_stocks(compared):
    """FP8 delayed scaling, from the same FP8 state: after one step, every TE module's scales
    and amax histories (forward and backward) are exactly stock's. Chunking changes neither
    the amaxes TE records (the maximum over the chunks' casts is the maximum over the batch,
    and the chunks cast the same values) nor when TE updates: the forward update at the end
    of the one autocast, the backward one in the backward of the autocast's first FP8 call,
    which under Domino is chunk 0's and runs after every other chunk's.

    Under SP, "stock" is the layer Megatron-LM builds without ``--spec`` (norms fused into the
    column linears), with the same weights and FP8 state: Domino, on the norms-apart layer,
    casts the norm's fp32 output to FP8 as that fused layer does
    (:mod:`megatron_domino.communication.te_fp8_inputs`), where stock on the norms-apart layer casts the
    norm's bf16 output; against that stock the FP8 state differs by rounding (up to 5 %
    relative in the backward amax histories, measured). The step did update every linear's
    amax histories (so the comparison is not of two untouched states); the attention's FP8
    state (TE's FP8 attention is not enabled) is compared too."""
    _, results = compared
    found = results["fp8"]
    histories = [
        key for key in found["fp8_start"] if ".linear_" in key and key.endswith(".amax_history")
    ]
    assert len(histories) == 2 * 4 * LAYERS, found["fp8_start"]  # fwd, bwd per TE linear
    assert set(histories) <= set(found["fp8_step_changed"])
    for setting, checked in found["settings"].items():
        assert checked["fp8_differences"] == {}, (setting, checked["fp8_differences"])


def test_collectives_match_the_schedule_and_overlap(compared):
    """Counts as for Megatron's linears (SP: gathers and scatters in both directions; no SP:
    forward all-reduces only); with inter-layer overlap (intra-layer mode drains each layer),
    every collective but the schedule's first and last overlapped other work. In every
    precision compared (the FP8 gathers under SP carry FP8 bits, the count is the same)."""
    sequence_parallel, results = compared
    for named in SETTINGS:
        if named.sequence_parallel != sequence_parallel:
            continue
        setting, config = named.name, named.config
        for precision, found in results.items():
            if setting not in found["settings"]:
                continue
            spans = found["settings"][setting]["spans"]
            wrong = count_mismatches(
                spans,
                config,
                num_layers=LAYERS,
                sequence_parallel=sequence_parallel,
                embedding=not sequence_parallel,
                output_layer=not sequence_parallel,
            )
            assert not wrong, (precision, setting, wrong)
            if config.inter_layer:
                violations = overlap_violations(spans, config, sequence_parallel=sequence_parallel)
                assert not violations, (precision, setting, violations[:3])


def _first_microbatch_flags() -> dict:
    """``is_first_microbatch`` as TE received it, per linear and call, for one Domino forward
    of a fresh model (Megatron's wrappers start at True), per SP mode and weight-gradient
    fusion."""
    found = {}
    for sequence_parallel in (True, False):
        options = te_options(sequence_parallel)
        for fused in (True, False):
            model = build_gpt_model(options, spec=te_spec(sequence_parallel))
            with TECalls(model) as calls:
                for linear in calls.modules:
                    linear.fuse_wgrad_accumulation = fused
                config = DominoConfig(chunks=2, backward_overlap=sequence_parallel)
                with apply_domino(model, config):
                    model(**token_batch(options, 4))
                found[sequence_parallel, fused] = [
                    [call.is_first_microbatch for call in module]
                    for module in calls.take()
                    if module and isinstance(module[0], LinearCall)
                ]
    return found


def test_first_microbatch_flag_keeps_weight_gradients_accumulating():
    """TE overwrites main_grad in the backward of a call flagged first (with fused
    weight-gradient accumulation), and the first chunk's backward runs last: Domino never
    passes True. TE receives False for every chunk, with or without fusion and SP, on a fresh
    model whose wrappers would pass True (Domino drops TE's cached FP8 weight instead, so the
    first chunk's call casts it afresh and the others reuse it; ``tests/ranks/test_te_contract.py``
    counts the casts)."""
    found = run_on_ranks(_first_microbatch_flags, 2, te=True)[0]
    for case, flags in found.items():
        assert flags and all(linear == [False, False] for linear in flags), (case, flags)


def _fp8_autocasts() -> dict:
    """FP8 (delayed) under SP: per arm, the FP8 autocasts entered in one forward and
    backward, the autocast (serial, depth) each TE linear call ran in, and TE's scale
    updates."""
    options = te_options(True, bf16=True, **FP8_DELAYED)
    model = build_gpt_model(options, spec=te_spec(True))
    batch = token_batch(options, 4)
    found = {}
    for arm, config in (("stock", None), ("domino", DominoConfig(chunks=4))):
        # Applied before the count: applying probes TE's quantizer slots in an autocast of its
        # own (megatron_domino.communication.te_quantizers), outside any forward.
        with apply_domino(model, config) if config else contextlib.nullcontext():
            with TECalls(model) as calls:
                forward_backward(model, batch)
                linears = [c for m in calls.take() for c in m if isinstance(c, LinearCall)]
                found[arm] = dict(
                    autocasts=calls.autocasts,
                    contexts={(call.autocast, call.depth) for call in linears},
                    calls=len(linears),
                    updates=calls.scale_updates,
                )
    return found


def test_fp8_context_wraps_all_chunks_once():
    """One FP8 autocast (TE's own, entered by Megatron's ``get_fp8_context``) per block forward
    around every chunk's TE calls, not one per chunk: TE's ``FP8GlobalStateManager`` saw one
    ``autocast_enter``, every call of the 4 chunks ran inside it at depth 1, and TE reduced
    amaxes and updated scales once forward and once backward per micro-batch, as for stock."""
    found = run_on_ranks(_fp8_autocasts, 2, te=True)[0]
    for arm, checked in found.items():
        assert checked["autocasts"] == 1, (arm, checked)
        assert checked["contexts"] == {(1, 1)}, (arm, checked)
        assert checked["updates"] == {"forward": 1, "backward": 1}, (arm, checked)
    # Per layer: QKV, proj, fc1, fc2, once per chunk under Domino.
    assert found["domino"]["calls"] == 4 * found["stock"]["calls"] == 4 * 4 * LAYERS


#: ``id -> (sequence parallel, Domino settings, model config changes, expected message)``.
REFUSALS = {
    "column-chunks": (True, dict(chunks=2, column_chunks=2), {}, "--domino-column-chunks > 1 needs"),
    "no-sp-backward-overlap": (False, dict(chunks=2), {}, "add --no-domino-backward-overlap"),
    "fp8-mxfp8": (
        True, dict(chunks=2), dict(fp8="hybrid", fp8_recipe="mxfp8"),
        "--fp8-recipe mxfp8 runs on Blackwell GPUs only",
    ),
    "fp8-no-weight-cache": (
        True, dict(chunks=2),
        dict(fp8="hybrid", fp8_recipe="delayed", disable_parameter_transpose_cache=True),
        "drop --disable-parameter-transpose-cache",
    ),
    "symmetric-ar": (True, dict(chunks=2), dict(symmetric_ar_type="two_shot"), "symmetric all-reduce"),
    "ub": (True, dict(chunks=2), dict(tp_comm_overlap=True), "TE userbuffer overlap"),
    "fused-norms-under-sp": (
        True, dict(chunks=2), {}, "--spec megatron_domino.specs.te_spec te_norms_apart_block_spec"
    ),
}  # fmt: skip


def _refusals() -> dict:
    """Each refusal's message, on a real TE model (the fused-norm case on Megatron's TE spec)."""
    found = {}
    for name, (sequence_parallel, settings, model_changes, _) in REFUSALS.items():
        fused = True if name == "fused-norms-under-sp" else None
        model = build_gpt_model(
            te_options(sequence_parallel), spec=te_spec(sequence_parallel, fused_norms=fused)
        )
        for key, value in model_changes.items():
            setattr(model.config, key, value)
        with pytest.raises(DominoUnsupportedError) as error:
            apply_domino(model, DominoConfig(**settings))
        found[name] = str(error.value)
    return found


@pytest.fixture(scope="module")
def refusals() -> dict:
    return run_on_ranks(_refusals, 2, te=True)[0]


@pytest.mark.parametrize("name", REFUSALS)
def test_refusals_name_the_problem_and_the_fix(refusals, name):
    """What TE cannot run under Domino is refused, naming the flag that fixes it; TE's fused
    norm + column linear under SP would make Domino gather the pre-norm residual (the norm run
    tp times, the whole chunk kept for backward), so it is refused naming the spec that builds
    the norms apart."""
    assert REFUSALS[name][-1] in refusals[name], refusals[name]
