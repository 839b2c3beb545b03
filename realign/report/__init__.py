"""The run report (``realign report RUN_DIR``): a self-contained HTML page of a run's
learning curves, times against the plan, timelines and reallocations
(:mod:`realign.report.page`, pictures by :mod:`realign.report.charts`)."""
