"""Workers: one process per device; each executes the iteration program's ops."""
