"""The EAGLE-3 head: the module, the public checkpoint layouts, and its capture inside a Megatron model."""
