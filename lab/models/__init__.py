"""Models for the lab and the tests: :mod:`.model_options` and :mod:`.gpt_model` (a
``GPTModel`` from a few options), :mod:`.gpu_check_models` (the GPU check's small models)."""
