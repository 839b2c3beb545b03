"""The work of one iteration: model function calls and their dataflow graph, one
builder per algorithm, the length distributions of prompts and responses, and the
lengths a batch is padded to. The lowest floor of the planner above its errors."""
