"""Parameter reallocation: the executor of the planner's transfer plans, release and
offload of a replica's storage, and the naive baseline.

Import what you need from the submodules (``executor``, ``offload``, ...); this
package imports nothing at import time.
"""
