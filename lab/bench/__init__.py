"""A/B benchmark of Domino against unpatched Megatron-Core: baseline, domino and oracle arms."""
