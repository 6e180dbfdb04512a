"""Benchmarks of hf_dilated's attention kernels, run as `hf-dilated bench SUBCOMMAND` (cli.py).

Nothing else in hf_dilated imports this package. Every case runs in a fresh process (worker.py);
every benchmark times and measures memory the same way (measure.py); report.py writes the tables.
"""
