"""realign's planner: pure planning of RLHF execution plans.

Model and hardware specs, dataflow graphs, device meshes, layouts, the cost model,
the simulator, the search and the plan schema. Imports no torch: a user plans a
128-GPU job on a laptop. Nothing here has side effects at import.
"""
