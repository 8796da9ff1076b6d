"""The CPU rank launchers of the lab and the test suite:

* :mod:`.ranks`: one function on N gloo ranks, a process each (the tests, the GPU check);
* :mod:`.script_ranks`: a training script on ranks forked from a preloaded server, as torchrun
  runs it;
* :mod:`.compile_warmup`: torch.compile's per-process set-up, done once in that server.
"""
