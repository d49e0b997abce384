"""What a user reads about a running job, beyond Horovod: the balance report and its
plot, the scaling model behind ``hvdlite.forecast``, and the autotuner that acts on the
step records (HVDLITE_AUTOTUNE)."""
