"""Run a Megatron-LM script, e.g. the patched ``pretrain_gpt.py``, on the CPU under torchrun.

    CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=$MLM python -m torch.distributed.run --standalone \
        --nproc-per-node 2 patches/cpu_launch.py $MLM/pretrain_gpt.py <its flags>

A test harness for ``cpu_smoke.py``, not part of the patch: on a GPU machine the patched script
runs as it is. Each rank runs the script as ``__main__`` (``runpy``), with three additions:

1. the megatron-core wheel's prebuilt dataset helpers (``helpers_cpp``) stand in for a
   checkout's, which are not compiled (building them needs pybind11), and only when both were
   built from the same ``helpers.cpp``;
2. :func:`megatron_domino.training.loop_runtime.megatron_loop_runtime`, what Megatron-LM's
   loop needs to run without CUDA (with CUDA it only replaces the helpers' compilation);
3. with ``CPU_LAUNCH_RECORD=PATH``, each rank writes ``PATH.rank<N>.json``: the loss and
   gradient norm of every iteration (from ``train_step``, unaveraged), the TP size Megatron
   set up, whether Domino is bound to the model's layer stack (a ``TransformerBlock`` or a
   ``HybridStack``), and the
   ``megatron_domino`` modules imported by the end (the launcher's own runtime imports some;
   without ``--domino`` the patch must import none of the others).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path


def _use_wheel_dataset_helpers() -> None:
    """Load the wheel's ``helpers_cpp`` as ``megatron.core.datasets.helpers_cpp`` if needed."""
    name = "megatron.core.datasets.helpers_cpp"
    if importlib.util.find_spec(name) is not None:
        return
    import megatron.core.datasets as datasets

    wheel = importlib.metadata.distribution("megatron-core")
    files = {str(f): wheel.locate_file(f) for f in wheel.files or ()}
    built = [p for f, p in files.items() if "datasets/helpers_cpp" in f and f.endswith(".so")]
    source = files.get("megatron/core/datasets/helpers.cpp")
    ours = Path(datasets.__file__).with_name("helpers.cpp")
    if not built or source is None or Path(source).read_bytes() != ours.read_bytes():
        raise RuntimeError(
            f"{ours.parent} has no compiled helpers_cpp and the megatron-core wheel's was built "
            "from another helpers.cpp: run `make -C megatron/core/datasets` in the checkout."
        )
    spec = importlib.util.spec_from_file_location(name, built[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    datasets.helpers_cpp = module


class _Recorder:
    """Wraps ``megatron.training.training.train_step`` (looked up by the loop at call time)."""

    def __init__(self) -> None:
        from megatron.training import training

        self.iterations: list[dict] = []
        self.domino_bound: bool | None = None
        self._train_step = training.train_step

    def train_step(self, *args, **kwargs):
        from megatron.core import parallel_state
        from megatron.core.models.hybrid.hybrid_block import HybridStack
        from megatron.core.transformer.transformer_block import TransformerBlock

        model = args[2] if len(args) > 2 else kwargs["model"]
        stacks = (TransformerBlock, HybridStack)
        blocks = [m for chunk in model for m in chunk.modules() if isinstance(m, stacks)]
        self.domino_bound = any("forward" in vars(block) for block in blocks)
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        result = self._train_step(*args, **kwargs)
        loss_dict, grad_norm = result[0], result[5]
        if "lm loss" in loss_dict:
            self.iterations.append(
                {
                    "loss": float(loss_dict["lm loss"]),
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                }
            )
        return result

    def write(self, path: str, finished: bool) -> None:
        record = {
            "finished": finished,
            "tp_size": getattr(self, "tp_size", None),
            "domino_bound": self.domino_bound,
            "iterations": self.iterations,
            "megatron_domino_modules": sorted(
                m for m in sys.modules if m.split(".")[0] == "megatron_domino"
            ),
        }
        Path(f"{path}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} SCRIPT.py [flags]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    _use_wheel_dataset_helpers()

    from megatron.training import training

    from megatron_domino.runtime.patch import Patch
    from megatron_domino.training.loop_runtime import megatron_loop_runtime

    record = os.environ.get("CPU_LAUNCH_RECORD")
    recorder = _Recorder()
    patch = Patch(training, "train_step", recorder.train_step, "per-iteration records")
    finished = False
    try:
        with megatron_loop_runtime(), patch.applied():
            runpy.run_path(script, run_name="__main__")
        finished = True
    finally:
        if record:
            recorder.write(record, finished)


# The guard matters: dist_checkpointing's writer process re-imports __main__ (spawn).
if __name__ == "__main__":
    main()
