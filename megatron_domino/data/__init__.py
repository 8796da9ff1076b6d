"""The data path of Megatron-style GPT pretraining: corpus -> tokenizer + indexed dataset ->
GPT datasets -> micro-batches. Import from the submodules (nothing is re-exported here, so that
``python -m megatron_domino.data.prepare`` does not import its own module twice):

* :mod:`megatron_domino.data.corpus`: documents from text/JSONL files or from the Python
  standard library (a demo corpus available offline everywhere).
* :mod:`megatron_domino.data.prepare`: trains a SentencePiece tokenizer
  (:mod:`megatron_domino.data.tokenizer`) and writes Megatron's ``.bin/.idx`` files, cached
  and atomically (``python -m megatron_domino.data.prepare``, ``megatron-domino-prepare-data``).
* :mod:`megatron_domino.data.datasets`: Megatron-Core's tokenizer, the train/valid/test
  ``GPTDataset`` splits and micro-batch iteration, on CPU.
* :mod:`megatron_domino.data.files`: file checks, fingerprints and atomic publishing shared by
  both ends.
"""
