"""What the engine writes down as it runs: the timeline, the per-step records the report
and the autotuner read (``recorder``), and the output files, proven writable first."""
