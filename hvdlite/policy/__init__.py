"""Choices made for the user, and the knobs behind them: defaults from the topology and
the CPUs (``defaults``, ``cpus``), the settings every rank must share
(``settings_agreement``), and the autotuner's search (``tuning``)."""
