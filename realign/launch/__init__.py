"""Launchers start the worker processes: local (this machine), Slurm and Ray later.
They share one small interface (:class:`realign.launch.base.Launcher`)."""
