"""The run wing: what a run *is*, before any process starts.

* :mod:`realign.run.spec` — :class:`RunSpec`, the prepared run (config, plan, paths)
  saved as ``RUN/run_spec.json``; the one ``load`` every launcher, the job index and
  the controller use;
* :mod:`realign.run.prepare` — :func:`prepare`: every check that files allow, then
  the plan and the run folder;
* :mod:`realign.run.program` — the compiled program, the one interpreter of an
  :class:`~planner.plan.ExecutionPlan`: the ops every worker executes each step;
* :mod:`realign.run.checkpoint` — the run folder's checkpoint layout.

The CLI, the launchers, the controller, the workers and the benchmarks depend on this
package; it depends on none of them (``make lint`` checks it).
"""
