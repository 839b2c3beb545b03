"""What runs a model replica: the device seam (:mod:`.device`), process groups from
the planner's mesh and layout (:mod:`.groups`), megatron-core models
(:mod:`.model`), Hugging Face checkpoints (:mod:`.hf_checkpoint`) and the engines
(:mod:`.engines`). Nothing here has side effects at import."""
