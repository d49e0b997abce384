"""Launching hvdlite jobs: ``hvdliterun`` and cluster helpers. Imports no framework."""
