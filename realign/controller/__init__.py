"""The controller: executes an execution plan's dataflow graph on workers."""
