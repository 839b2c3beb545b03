"""The benchmark studies that are no ``realign bench`` command: one module per study and
question, named ``<study>_<what>`` after its folder under ``benchmarks/`` (which holds
its records and README), each run as ``python -m realign.bench.studies.<module>`` from
the repository root."""
