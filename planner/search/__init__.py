"""Finding the plan: the priced search problem, the simulator, exact branch and bound,
simulated annealing (and its C++ twin), the hand-written heuristics, manual plans, plan
variants for benchmarks, and ``search``, which ties them together."""
