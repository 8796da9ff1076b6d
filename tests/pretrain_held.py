"""``pretrain_gpt_domino.py`` with pauses where the fault tests strike (test-only).

A tiny model's iteration takes about 0.1 s and its checkpoint save as long, shorter than a
loaded test machine takes to notice a log line and send a signal. So the fault tests run this
wrapper, which holds the ranks at named points until the test has struck, instead of racing
them. ``DOMINO_TEST_HOLDS`` lists ``attempt:point`` pairs (the attempt is torchrun's
``TORCHELASTIC_RESTART_COUNT``); the points are:

* ``iterationN``: every rank, at the start of iteration N's first forward step (its batch not
  yet read): a kill or a signal there lands in the middle of iteration N;
* ``write``: rank 0, in a checkpoint save, before it writes its shard (the other ranks write
  theirs): a kill there leaves a half-written checkpoint folder.

At a point, a rank creates ``DOMINO_TEST_HOLD_DIR/attempt<A>-<point>-rank<R>`` and waits until
``attempt<A>-<point>.go`` appears there (or 120 s pass). Everything else is the real script:
the same ``main()``, Megatron-LM's loop, its checkpoint writer. The product has no such hook.
"""

if __name__ == "__main__":  # dist_checkpointing's spawned helper re-imports this file
    import os
    import time
    from pathlib import Path

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training import get_args

    from megatron_domino.training import pretrain

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank = os.environ.get("RANK", "0")
    holds = os.environ.get("DOMINO_TEST_HOLDS", "").split(",")
    points = {hold.split(":", 1)[1] for hold in holds if hold.startswith(f"{attempt}:")}
    folder = Path(os.environ.get("DOMINO_TEST_HOLD_DIR", "."))

    def hold(point: str) -> None:
        if point not in points:
            return
        points.discard(point)  # once
        (folder / f"attempt{attempt}-{point}-rank{rank}").touch()
        go, deadline = folder / f"attempt{attempt}-{point}.go", time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    forward_step = pretrain.forward_step

    def held_forward_step(data_iterator, model):
        hold(f"iteration{get_args().curr_iteration + 1}")
        return forward_step(data_iterator, model)

    writer = filesystem_async.FileSystemWriterAsync
    write = writer.write_preloaded_data_multithread

    def held_write(transform_list, use_msc, writer_rank, write_buckets, results_queue):
        if writer_rank == 0:
            hold("write")
        return write(transform_list, use_msc, writer_rank, write_buckets, results_queue)

    pretrain.forward_step = held_forward_step
    writer.write_preloaded_data_multithread = staticmethod(held_write)
    pretrain.main()
